"""Gated Linear Attention (Yang et al. 2023, "Gated Linear Attention Transformers with
Hardware-Efficient Training", arXiv 2312.06635).

    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,    o_t = K^-1/2 q_t S_t
    log alpha_t = logsigmoid(W_2 W_1 x_t + b) / 16       (rank-16 gate, one value per key channel)
    y_t = W_o (RMSNorm(o_t) * swish(W_r x_t))

The normaliser 16 keeps the decays close to 1 at initialisation. Every linear layer starts
xavier-uniform with gain 2^-2.5 and zero bias, as in the paper's code. A short convolution on
q, k, v is optional (off by default).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .base import LayerState, MixerArgs, register_mixer
from .linear_attention import ShortConvs
from .modules import GatedRMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs

#: GLA divides the log-sigmoid gate by this, so log alpha lies in (-inf, 0] / 16 and starts near 0
GATE_LOGIT_NORMALIZER = 16


def init_linear_xavier_(module: nn.Module, gain: float = 2 ** -2.5) -> None:
    """Xavier-uniform weights (default gain 2^-2.5) and zero biases for every nn.Linear in ``module``."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight, gain=gain)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


@register_mixer("gla")
class GatedLinearAttention(MemoryMixer):
    """GLA: additive write, per-key-channel decay from a low-rank gate, swish-gated RMSNorm output."""

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(D, args.gate_low_rank, bias=False),
                                     nn.Linear(args.gate_low_rank, H * K, bias=True))
        self.g_proj = nn.Linear(D, H * V, bias=False)
        self.convs = ShortConvs({"q": H * K, "k": H * K, "v": H * V}, args)
        self.o_norm = GatedRMSNorm(V, eps=args.norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        init_linear_xavier_(self)

    def recurrence_inputs(
        self, hidden: torch.Tensor, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
    ) -> RecurrenceArgs:
        H = self.args.num_heads
        q, k, v = (
            rearrange(self.convs(n, proj(hidden), cache=cache, cu_seqlens=cu_seqlens), "b t (h d) -> b t h d", h=H)
            for n, proj in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj))
        )
        gate = rearrange(self.gk_proj(hidden).float(), "b t (h k) -> b t h k", h=H)
        log_decay = F.logsigmoid(gate) / GATE_LOGIT_NORMALIZER  # [B, T, H, K] fp32
        return RecurrenceArgs(q=q, k=k, v=v, log_decay=log_decay)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        gate = rearrange(self.g_proj(hidden), "b t (h d) -> b t h d", h=self.args.num_heads)
        return self.o_proj(rearrange(self.o_norm(o, gate), "b t h d -> b t (h d)"))
