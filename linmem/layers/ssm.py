"""Diagonal state-space models as memories of the unified recurrence: Mamba-1's selective scan and S4D.

``mamba`` (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
arXiv 2312.00752). Per channel c of the inner width E and state n < N::

    x, z = W_in x_t;  x = silu(conv(x));  (δ, B_t, C_t) = W_x x;  Δ_t = softplus(W_Δ δ + b_Δ)   [E]
    h_t[n, c] = exp(Δ_t[c] A[c, n]) h_{t-1}[n, c] + B_t[n] Δ_t[c] x_t[c]       A = -exp(A_log) [E, N]
    y_t[c] = C_t · h_t[:, c] + D_c x_t[c];    out_t = W_out(y_t ⊙ silu(z_t))

The state of a channel group is the recurrence's ``S: [K = N, V]`` with q = C, k = B (shared by every
channel), v = Δ ⊙ x and the full log decay ``Δ_t[c] A[c, n]: [B, T, H, N, V]``. Mamba-1 has no heads:
its E channels are split into ``num_heads`` groups of ``value_dim`` only to fit the recurrence's layout,
which changes nothing computed. Initialisation as in the paper: S4D-Real ``A = -(1..N)`` per channel,
``D = 1``, ``Δ`` log-uniform in [1e-3, 0.1] through the bias of ``W_Δ`` (rank ``ceil(D_model / 16)``).

``s4`` (S4D, Gu et al. 2022, "On the Parameterization and Initialization of Diagonal State Space Models",
arXiv 2206.11893): a time-invariant single-input single-output SSM per channel c of the layer input, the
zero-order hold of ``h' = A h + B u, y = C h + D u``::

    h_t[n] = exp(Δ_c A[c, n]) h_{t-1}[n] + (exp(Δ_c A[c, n]) - 1) / A[c, n] · u_t[c]
    y_t[c] = C[c] · h_t + D_c u_t[c];     out_t = GLU(W_out GELU(y_t))

with S4D-Real's initialisation ``A = -(1..N)`` (real, so the state stays real; S4D-Lin's complex
``-1/2 + iπn`` is left out), ``B = 1`` (folded into the discretisation, as S4D does), ``C ~ N(0, 1)``,
``D ~ N(0, 1)``, ``log Δ`` uniform in [log 1e-3, log 0.1]. Every channel is its own head of the recurrence
(``H = D_model``, ``K = N``, ``V = 1``) with a log decay ``Δ_c A[c, n]`` constant in time.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvolution
from .init import mamba2_dt_bias
from .recurrent import MemoryMixer, RecurrenceArgs

#: the range of the initial step sizes Δ of both SSMs
DT_RANGE = (1e-3, 1e-1)


def s4d_real_a_log(channels: int, state: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """log of -A for S4D-Real's ``A[c, n] = -(n + 1)``: ``[channels, state]``.

    Example:
        >>> -s4d_real_a_log(2, 3).exp()
        tensor([[-1., -2., -3.],
                [-1., -2., -3.]])
    """
    return torch.arange(1, state + 1, dtype=torch.float32, device=device).log().expand(channels, state).clone()


def _acc(x: torch.Tensor) -> torch.dtype:
    """fp32 (fp64 for fp64 inputs): the dtype gates are computed in."""
    return torch.promote_types(x.dtype, torch.float32)


@register_mixer("mamba")
class Mamba(MemoryMixer):
    """Mamba-1's selective SSM: per-channel, per-state decay ``exp(Δ_t[c] A[c, n])``, input-dependent Δ, B, C.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees q = C, k = B ``[B, T, H, N]`` (one B, C for
    all channels), v = Δ ⊙ x ``[B, T, H, V]`` and a full log decay ``[B, T, H, N, V]`` (fp32). State size
    N = ``head_dim``, inner width E = ``num_heads * value_dim`` (Mamba's ``d_state = 16, expand = 2``:
    ``head_dim=16, num_heads=1, expand_v=2 * D / 16``); ``conv_size`` is ``d_conv``, ``use_short_conv=False``
    keeps the SiLU and drops the convolution.

    Example:
        >>> layer = Mamba(MixerArgs(hidden_size=16, num_heads=2, head_dim=4, expand_v=4.0))
        >>> layer(torch.randn(1, 5, 16)).shape
        torch.Size([1, 5, 16])
    """

    memory_projections = ("in_proj",)

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, N, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.inner = E = H * V
        self.dt_rank = math.ceil(D / 16)
        self.in_proj = nn.Linear(D, 2 * E, bias=False)  # x, z
        self.use_short_conv = True if args.use_short_conv is None else args.use_short_conv
        if self.use_short_conv:
            self.conv = ShortConvolution(E, args.conv_size)
        self.x_proj = nn.Linear(E, self.dt_rank + 2 * N, bias=False)  # δ, B, C
        self.dt_proj = nn.Linear(self.dt_rank, E, bias=False)  # torch's init: U(±rank^-1/2), Mamba's dt_init "random"
        self.dt_bias = nn.Parameter(torch.empty(E))
        self.A_log = nn.Parameter(torch.empty(E, N))
        self.D = nn.Parameter(torch.empty(E))
        self.out_proj = nn.Linear(E, D, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        E, N = self.A_log.shape
        self.A_log.copy_(s4d_real_a_log(E, N, device=self.A_log.device))
        nn.init.ones_(self.D)
        self.dt_bias.copy_(mamba2_dt_bias(E, *DT_RANGE, device=self.dt_bias.device))

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        N = self.args.key_dim
        H = self.A_log.shape[0] // self.args.value_dim  # all heads, or a tensor-parallel share
        x, z = self.project("in_proj", hidden, projected).chunk(2, dim=-1)
        x = self.conv(x, cache=cache, key="conv_x", cu_seqlens=cu_seqlens) if self.use_short_conv else F.silu(x)
        delta, B, C = self.x_proj(x).split([self.dt_rank, N, N], dim=-1)
        acc = _acc(hidden)
        dt = F.softplus(self.dt_proj(delta).to(acc) + self.dt_bias.to(acc))  # [B, T, E]
        A = -torch.exp(self.A_log.to(acc))  # [E, N]
        dt = rearrange(dt, "b t (h v) -> b t h v", h=H)
        log_decay = dt[..., None, :] * rearrange(A, "(h v) n -> h n v", h=H)  # [B, T, H, N, V]
        x = rearrange(x, "b t (h v) -> b t h v", h=H)
        heads = lambda m: m[:, :, None, :].expand(-1, -1, H, -1)  # noqa: E731  one B, C for every channel
        return RecurrenceArgs(q=heads(C), k=heads(B), v=(dt * x).to(x.dtype), log_decay=log_decay, scale=1.0,
                              extras={"x": x, "z": z})

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        x, z = args.extras["x"], args.extras["z"]
        y = (o + self.D.to(o.dtype).view(x.shape[2], x.shape[3]) * x).flatten(-2)  # [B, T, E]
        return self.out_proj(y.to(z.dtype) * F.silu(z))


@register_mixer("s4")
class S4D(MemoryMixer):
    """S4D-Real: one time-invariant diagonal SSM of N states per channel of the layer input (ZOH discretised).

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence runs D heads of ``K = N`` (``head_dim``), ``V = 1``
    with q = C, k = (exp(ΔA) - 1) / A and v = u, and the log decay ``ΔA`` (fp32) the same at every token.
    ``num_heads`` only sets the default N = D / H. It has no input projection, so no mixture of memories.

    Example:
        >>> layer = S4D(MixerArgs(hidden_size=16, num_heads=2))
        >>> layer(torch.randn(1, 5, 16)).shape
        torch.Size([1, 5, 16])
    """

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, N = args.hidden_size, args.key_dim
        self.log_dt = nn.Parameter(torch.empty(D))
        self.A_log = nn.Parameter(torch.empty(D, N))
        self.C = nn.Parameter(torch.empty(D, N))
        self.D = nn.Parameter(torch.empty(D))
        self.out_proj = nn.Linear(D, 2 * D)  # S4D's position-wise output map, then a GLU
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        D, N = self.A_log.shape
        lo, hi = (math.log(t) for t in DT_RANGE)
        self.log_dt.uniform_(lo, hi)
        self.A_log.copy_(s4d_real_a_log(D, N, device=self.A_log.device))
        nn.init.normal_(self.C)
        nn.init.normal_(self.D)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        Bsz, T = hidden.shape[:2]
        u = hidden[..., self.heads]  # [B, T, D']: every channel, or under tensor parallelism the rank's share
        acc = _acc(hidden)
        A = -torch.exp(self.A_log.to(acc))  # [D, N]
        dA = torch.exp(self.log_dt.to(acc))[:, None] * A  # log decay per channel and state, constant in time
        B_bar = torch.expm1(dA) / A  # zero-order hold of B = 1
        every = lambda m: m.expand(Bsz, T, -1, -1)  # noqa: E731  [D, N] -> [B, T, D, N]
        return RecurrenceArgs(q=every(self.C.to(hidden.dtype)), k=every(B_bar.to(hidden.dtype)), v=u[..., None],
                              log_decay=every(dA), scale=1.0, extras={"u": u})

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        y = o[..., 0] + self.D.to(o.dtype) * args.extras["u"].to(o.dtype)  # [B, T, D]
        return F.glu(self.out_proj(F.gelu(y.to(hidden.dtype))), dim=-1)
