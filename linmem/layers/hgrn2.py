"""HGRN-2 (Qin et al. 2024, "HGRN2: Gated Linear RNNs with State Expansion", arXiv 2404.07904).

    f_t = lb + (1 - lb) * sigmoid(W_f x_t)                  forget gate per key channel
    S_t = diag(f_t) S_{t-1} + (1 - f_t)^T i_t,   i_t = W_i x_t
    o_t = silu(W_q x_t) S_t,    y_t = W_o RMSNorm(o_t)      (norm over all heads)

The key is tied to the forget gate, k_t = 1 - f_t. The lower bound lb grows with depth so that deep
layers keep long memories; HGRN learns the bounds of all layers jointly as cumsum(softmax(Gamma))
over layers, a model-level parameter. A layer here owns no other layer, so it uses the value those
bounds take at initialisation (Gamma = 0): lb = l / L for layer l of L (0 in the first layer).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .base import LayerState, MixerArgs, register_mixer
from .modules import RMSNorm, ShortConvs
from .recurrent import MemoryMixer, RecurrenceArgs


def hgrn2_log_forget(logits: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """log(lb + (1 - lb) sigmoid(logits)) in fp32; exactly logsigmoid(logits) when lb = 0."""
    logits = logits.float()
    if lower_bound == 0:
        return F.logsigmoid(logits)
    return torch.log(lower_bound + (1 - lower_bound) * torch.sigmoid(logits))


@register_mixer("hgrn2")
class HGRN2(MemoryMixer):
    """HGRN-2: vector-decay linear RNN with state expansion and a key tied to 1 - forget."""

    memory_projections = ("f_proj", "i_proj")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.lower_bound = args.layer_idx / args.num_layers
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.f_proj = nn.Linear(D, H * K, bias=False)
        self.i_proj = nn.Linear(D, H * V, bias=False)
        self.convs = ShortConvs({"q": H * K, "i": H * V}, args)  # the gate stays per token
        self.o_norm = RMSNorm(H * V, eps=args.norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        split = lambda x: rearrange(x, "b t (h d) -> b t h d", h=self.args.num_heads)  # noqa: E731
        q = split(self.convs("q", self.q_proj(hidden), cache=cache, cu_seqlens=cu_seqlens, activation=F.silu))
        i = split(self.convs("i", self.project("i_proj", hidden, projected), cache=cache, cu_seqlens=cu_seqlens))
        log_forget = split(hgrn2_log_forget(self.project("f_proj", hidden, projected), self.lower_bound))
        k = (-torch.expm1(log_forget)).to(q.dtype)  # 1 - f_t
        return RecurrenceArgs(q=q, k=k, v=i, log_decay=log_forget, scale=1.0)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        return self.o_proj(self.o_norm(rearrange(o, "b t h d -> b t (h d)")))
