"""Mamba-2, the state-space dual (SSD) layer (Dao & Gu 2024, "Transformers are SSMs:
Generalized Models and Efficient Algorithms Through Structured State Space Duality",
arXiv 2405.21060).

Per head h, with a scalar decay per token and the state S: [N, P]::

    dt_t = softplus(W_dt x_t + dt_bias_h),     log a_t = -exp(A_log_h) * dt_t   (<= 0)
    S_t  = a_t S_{t-1} + B_t^T (dt_t x_t)
    y_t  = C_t S_t + D_h x_t
         = sum_{s<=t} (C_t . B_s) exp(sum_{s<r<=t} log a_r) dt_s x_s + D_h x_t

One input projection gives (z, x, B, C, dt); x, B and C pass a short causal
convolution + SiLU; B and C are shared by all heads (ngroups = 1). The output is
``out_proj(RMSNorm(y * silu(z)))``: as in Mamba-2 the gate comes *before* the norm,
and the norm runs over the whole inner width H * P (one group).

:class:`MixerArgs` mapping: heads H = ``num_heads``, state size N = ``key_dim``
(``head_dim``, default D / H), head dim P = ``value_dim`` (= N * ``expand_v``), inner
width H * P (Mamba-2's ``expand = H * P / D``; its defaults N = 128, P = 64, expand 2
are ``head_dim=128, expand_v=0.5, num_heads=2D/64``); ``conv_size`` is ``d_conv``;
``use_short_conv=False`` keeps the SiLU but drops the convolution; ``norm_eps`` is
the gated norm's epsilon.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops.fused import swiglu
from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvolution
from .init import init_mamba2_gate_
from .norms import RMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs


@register_mixer("mamba2")
class Mamba2(MemoryMixer):
    """Mamba-2 / SSD: scalar decay per token and head, write ``B_t^T (dt_t x_t)``, read ``C_t``.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees q = C, k = B ``[B, T, H, N]``
    (expanded from one group), v = dt * x ``[B, T, H, P]``, log_decay ``[B, T, H]`` (fp32).
    A mixture of memories gives each memory its own fused input projection (z, x, B, C, dt).
    """

    memory_projections = ("in_proj",)

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, N, P = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.inner = H * P
        self.in_proj = nn.Linear(D, 2 * self.inner + 2 * N + H, bias=False)  # z, x, B, C, dt
        self.use_short_conv = True if args.use_short_conv is None else args.use_short_conv
        if self.use_short_conv:
            self.conv = ShortConvolution(self.inner + 2 * N, args.conv_size)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = RMSNorm(self.inner, eps=args.norm_eps)
        self.out_proj = nn.Linear(self.inner, D, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init_mamba2_gate_(self.A_log, self.dt_bias)
        nn.init.ones_(self.D)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        H, N = self.A_log.shape[0], self.args.key_dim  # heads: all, or a tensor-parallel share
        inner = H * self.args.value_dim
        z, xBC, dt = self.project("in_proj", hidden, projected).split([inner, inner + 2 * N, H], dim=-1)
        if self.use_short_conv:
            xBC = self.conv(xBC, cache=cache, key="conv_xBC", cu_seqlens=cu_seqlens)
        else:
            xBC = F.silu(xBC)
        x, B, C = xBC.split([inner, N, N], dim=-1)
        x = rearrange(x, "b t (h p) -> b t h p", h=H)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # gates in fp32 (fp64 for fp64 inputs)
        dt = F.softplus(dt.to(acc) + self.dt_bias.to(acc))  # [B, T, H]
        log_decay = -torch.exp(self.A_log.to(acc)) * dt  # [B, T, H]
        heads = lambda m: m[:, :, None, :].expand(-1, -1, H, -1)  # noqa: E731  one group -> H heads
        return RecurrenceArgs(
            q=heads(C), k=heads(B), v=(x * dt[..., None]).to(x.dtype), log_decay=log_decay, scale=1.0,
            extras={"x": x, "z": z},
        )

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        x, z = args.extras["x"], args.extras["z"]
        y = o + self.D.to(o.dtype)[:, None] * x  # [B, T, H, P]
        y = self.norm(swiglu(z, y.flatten(-2).to(z.dtype)))  # RMSNorm(y * silu(z)): the gate before the norm
        return self.out_proj(y)
