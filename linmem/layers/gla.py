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

from ..ops.gates import pointwise
from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvs
from .init import Linear, low_rank, xavier_init
from .norms import GatedRMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs

#: GLA divides the log-sigmoid gate by this, so log alpha lies in (-inf, 0] / 16 and starts near 0
GATE_LOGIT_NORMALIZER = 16
#: gain of the xavier-uniform init of every GLA linear map (the paper's code)
XAVIER_GAIN = 2 ** -2.5


def gla_log_decay(logits: torch.Tensor) -> torch.Tensor:
    """log alpha = logsigmoid(logits) / 16 in fp32 (fp64 for fp64 logits)."""
    return F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))) / GATE_LOGIT_NORMALIZER


def gla_log_decay_derivative(logits: torch.Tensor) -> torch.Tensor:
    """d log alpha / d logits = sigmoid(-logits) / 16."""
    return torch.sigmoid(-logits.to(torch.promote_types(logits.dtype, torch.float32))) / GATE_LOGIT_NORMALIZER


@register_mixer("gla")
class GatedLinearAttention(MemoryMixer):
    """GLA: additive write, per-key-channel decay from a low-rank gate, swish-gated RMSNorm output."""

    memory_projections = ("k_proj", "v_proj", "gk_proj")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        init = xavier_init(XAVIER_GAIN)
        self.q_proj = Linear(D, H * K, init=init)
        self.k_proj = Linear(D, H * K, init=init)
        self.v_proj = Linear(D, H * V, init=init)
        self.gk_proj = low_rank(D, args.gate_low_rank, H * K, bias=True, init=init)
        self.g_proj = Linear(D, H * V, init=init)
        self.convs = ShortConvs({"q": H * K, "k": H * K, "v": H * V}, args)
        self.o_norm = GatedRMSNorm(V, eps=args.norm_eps)
        self.o_proj = Linear(H * V, D, init=init)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        q, k, v = self.convolved_qkv(hidden, cache=cache, cu_seqlens=cu_seqlens, projected=projected)
        gate = rearrange(self.project("gk_proj", hidden, projected), "b t (h k) -> b t h k", k=self.args.key_dim)
        log_decay = pointwise(gate, gla_log_decay, gla_log_decay_derivative)  # [B, T, H, K] fp32
        return RecurrenceArgs(q=q, k=k, v=v, log_decay=log_decay)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        gate = rearrange(self.g_proj(hidden), "b t (h d) -> b t h d", d=self.args.value_dim)
        return self.o_proj(rearrange(self.o_norm(o, gate), "b t h d -> b t (h d)"))
