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

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops.gates import pointwise
from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvs
from .norms import RMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs


def _acc(logits: torch.Tensor) -> torch.Tensor:
    """logits in fp32 (fp64 for fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def hgrn2_log_forget(logits: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """log(lb + (1 - lb) sigmoid(logits)) in fp32 (fp64 for fp64); exactly logsigmoid(logits) when lb = 0."""
    logits = _acc(logits)
    if lower_bound == 0:
        return F.logsigmoid(logits)
    return torch.log(lower_bound + (1 - lower_bound) * torch.sigmoid(logits))


def _log_forget_derivative(logits: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """d log f / d logits = (1 - lb) s (1 - s) / f with s = sigmoid(logits)."""
    logits = _acc(logits)
    if lower_bound == 0:
        return torch.sigmoid(-logits)
    s = torch.sigmoid(logits)
    return (1 - lower_bound) * s * torch.sigmoid(-logits) / (lower_bound + (1 - lower_bound) * s)


def _one_minus_forget(logits: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """The key k = 1 - f = (1 - lb) sigmoid(-logits), fp32 (fp64 for fp64)."""
    return (1 - lower_bound) * torch.sigmoid(-_acc(logits))


def _one_minus_forget_derivative(logits: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """d (1 - f) / d logits = -(1 - lb) s (1 - s)."""
    logits = _acc(logits)
    return -(1 - lower_bound) * torch.sigmoid(logits) * torch.sigmoid(-logits)


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
        split = lambda x, d: rearrange(x, "b t (h d) -> b t h d", d=d)  # noqa: E731
        K, V = self.args.key_dim, self.args.value_dim
        q = split(self.convs("q", self.q_proj(hidden), cache=cache, cu_seqlens=cu_seqlens, activation=F.silu), K)
        i = split(self.convs("i", self.project("i_proj", hidden, projected), cache=cache, cu_seqlens=cu_seqlens), V)
        logits, lb = split(self.project("f_proj", hidden, projected), K), self.lower_bound
        log_forget = pointwise(logits, partial(hgrn2_log_forget, lower_bound=lb),
                               partial(_log_forget_derivative, lower_bound=lb))
        k = pointwise(logits, partial(_one_minus_forget, lower_bound=lb),
                      partial(_one_minus_forget_derivative, lower_bound=lb)).to(q.dtype)  # 1 - f_t
        return RecurrenceArgs(q=q, k=k, v=i, log_decay=log_forget, scale=1.0)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        return self.o_proj(self.o_norm(rearrange(o, "b t h d -> b t (h d)")))
