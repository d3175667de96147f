"""DeltaNet (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length") and Gated DeltaNet (Yang et al. 2025, "Gated Delta Networks").

    S_t = a_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,   o_t = q_t S_t

q, k: short conv + SiLU, L2-normalised per head (x / sqrt(|x|^2 + 1e-6)); beta_t = sigmoid(W_b x_t).
Gated DeltaNet adds the Mamba-2 gate log a_t = -exp(A_log) * softplus(W_a x_t + dt_bias)
and an output gate: o = RMSNorm(o) * silu(W_g x).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.fused import l2_norm
from ..ops.gates import mamba2_log_decay
from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvolution
from .init import init_mamba2_gate_
from .norms import GatedRMSNorm, RMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs


class _DeltaRule(MemoryMixer):
    gated = False

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.use_short_conv = True if args.use_short_conv is None else args.use_short_conv
        if self.use_short_conv:
            self.q_conv = ShortConvolution(H * K, args.conv_size)
            self.k_conv = ShortConvolution(H * K, args.conv_size)
            self.v_conv = ShortConvolution(H * V, args.conv_size)
        if self.gated:
            self.a_proj = nn.Linear(D, H, bias=False)
            self.A_log = nn.Parameter(torch.empty(H))
            self.dt_bias = nn.Parameter(torch.empty(H))
            self.g_proj = nn.Linear(D, H * V, bias=False)
            self.o_norm = GatedRMSNorm(V, eps=args.norm_eps)
        else:
            self.o_norm = RMSNorm(V, eps=args.norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.gated:
            init_mamba2_gate_(self.A_log, self.dt_bias)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        K, V = self.args.key_dim, self.args.value_dim
        q = self.q_proj(hidden)
        k, v = self.project("k_proj", hidden, projected), self.project("v_proj", hidden, projected)
        if self.use_short_conv:
            q = self.q_conv(q, cache=cache, key="conv_q", cu_seqlens=cu_seqlens)
            k = self.k_conv(k, cache=cache, key="conv_k", cu_seqlens=cu_seqlens)
            v = self.v_conv(v, cache=cache, key="conv_v", cu_seqlens=cu_seqlens)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q, k = l2_norm(q, head_dim=K), l2_norm(k, head_dim=K)  # [B, T, H, K], unit norm per head
        v = v.unflatten(-1, (-1, V))
        beta = torch.sigmoid(self.project("b_proj", hidden, projected).float())  # [B, T, H]
        log_decay = None
        if self.gated:  # [B, T, H]
            a = self.project("a_proj", hidden, projected)[..., None]
            log_decay = mamba2_log_decay(a, self.A_log, self.dt_bias[:, None])[..., 0]
        return RecurrenceArgs(q=q, k=k, v=v, log_decay=log_decay, beta=beta)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        if self.gated:
            o = self.o_norm(o, self.g_proj(hidden).unflatten(-1, o.shape[-2:]))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.flatten(-2))


@register_mixer("deltanet")
class DeltaNet(_DeltaRule):
    """DeltaNet: the delta rule with no decay."""

    memory_projections = ("k_proj", "v_proj", "b_proj")


@register_mixer("gated_deltanet")
class GatedDeltaNet(_DeltaRule):
    """Gated DeltaNet: the delta rule with a Mamba-2 scalar decay and an output gate."""

    gated = True
    memory_projections = ("k_proj", "v_proj", "b_proj", "a_proj")
