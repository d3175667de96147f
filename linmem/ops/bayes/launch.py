"""Launchers of the Bayesian filter's Triton kernels and the autograd function that joins them.

Shapes only, no host synchronisation. The kernels and their maths: :mod:`linmem.ops.bayes.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..triton_launch import run_kernel
from . import kernels

#: the largest key head dim: P [K, K] lives in registers
MAX_KEY_DIM = 128
#: the V block of a program, unless the caller names one
DEFAULT_BLOCK_V = 64
#: software-pipelining stages of every launch (Triton's default)
STAGES = 3


def _pow2(n: int) -> int:
    """The smallest power of two >= n, at least 16."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def default_warps(K: int, BV: int) -> int:
    """Warps of a program holding P [K, K] and a [K, BV] block of M."""
    return 4 if _pow2(K) * (_pow2(K) + BV) <= 64 * 128 else 8


@dataclass(frozen=True)
class Launch:
    """How the kernels run: V block and warps per program."""

    block_v: int  # value columns per program (a power of two >= 16)
    num_warps: int  # warps per program

    @staticmethod
    def default(K: int, V: int) -> "Launch":
        BV = min(_pow2(V), DEFAULT_BLOCK_V)
        return Launch(BV, default_warps(K, BV))


@dataclass
class Saved:
    """What the forward keeps for the backward (fp32): u [B, T, H, K], s [B, T, H], e [B, T, H, V], and
    q^T P q [B, T, H] when the variance was asked for (else empty)."""

    U: Tensor
    S: Tensor
    E: Tensor
    QPQ: Tensor


def _dims(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[int, int, int, int, int, int]:
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return B, T, H, K, v.shape[-1], N


def filter_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, r: Tensor, w: Optional[Tensor], M0: Optional[Tensor],
                   P0: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, prior: float, variance: bool,
                   save: bool, launch: Launch, MT: Optional[Tensor] = None, PT: Optional[Tensor] = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Saved]]:
    """-> (o [B, T, H, V], var [B, T, H] fp32 (empty without ``variance``), M_T, P_T, saved or None).

    q, k [B, T, H, K], v [B, T, H, V] contiguous; g, r, w [B, T, H] fp32 contiguous; M0 [N, H, K, V], P0
    [N, H, K, K] fp32 or None (the prior). ``MT``, ``PT``: where the final state goes (may be M0, P0 when V
    fits one block: the decoding step), else new tensors.
    """
    B, T, H, K, V, N = _dims(q, v, cu_seqlens)
    BK, BV = _pow2(K), launch.block_v
    NV = -(-V // BV)
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty_like(v)
    var = torch.empty(B, T, H, **f32) if variance else q.new_empty(0, dtype=torch.float32)
    MT = torch.empty(N, H, K, V, **f32) if MT is None else MT
    PT = torch.empty(N, H, K, K, **f32) if PT is None else PT
    saved = None
    if save:
        saved = Saved(torch.empty(B, T, H, K, **f32), torch.empty(B, T, H, **f32), torch.empty(B, T, H, V, **f32),
                      torch.empty(B, T, H, **f32) if variance else var)  # QPQ: empty without the variance
    unused = g  # the pointer of a buffer that a constexpr switches off
    run_kernel(
        kernels.filter_fwd_kernel, (NV, N * H),
        (q, k, v, g, r, w if w is not None else unused, M0 if M0 is not None else MT, P0 if P0 is not None else PT,
         o, var if variance else unused, MT, PT, *((saved.U, saved.S, saved.E, saved.QPQ) if save else (unused,) * 4),
         cu_seqlens if cu_seqlens is not None else unused, scale, prior, T, H, K, V),
        {"HAS_W": w is not None, "HAS_INIT": M0 is not None, "VAR": variance, "SAVE": save,
         "IS_VARLEN": cu_seqlens is not None, "BK": BK, "BV": BV}, launch.num_warps, STAGES)
    return o, var, MT, PT, saved


def filter_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, r: Tensor, w: Optional[Tensor], M0: Optional[Tensor],
                    P0: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, prior: float, saved: Saved,
                    PT: Tensor, do: Tensor, dvar: Optional[Tensor], dMT: Optional[Tensor], dPT: Optional[Tensor],
                    launch: Launch) -> tuple[Tensor, ...]:
    """-> (dq, dk [B, T, H, K], dv [B, T, H, V], dg, dr, dw (None without w) [B, T, H], dM0, dP0): the gradients
    of q, k, v in their dtype, the rest fp32 (dM0, dP0 also without an initial state: those of the prior)."""
    B, T, H, K, V, N = _dims(q, v, cu_seqlens)
    BK, BV = _pow2(K), launch.block_v
    NV = -(-V // BV)
    tokens = B * T
    f32 = dict(dtype=torch.float32, device=q.device)
    varlen = cu_seqlens if cu_seqlens is not None else g
    is_varlen, warps = cu_seqlens is not None, launch.num_warps
    dE = torch.empty(B, T, H, V, **f32)
    De = torch.empty(NV, B, T, H, K, **f32)
    dM0 = torch.empty(N, H, K, V, **f32)
    run_kernel(
        kernels.mean_bwd_kernel, (NV, N * H),
        (q, k, g, saved.U, saved.S, saved.E, do, dMT if dMT is not None else dM0, dM0, dE, De, varlen, scale,
         T, H, K, V, tokens), {"HAS_DFINAL": dMT is not None, "IS_VARLEN": is_varlen, "BK": BK, "BV": BV},
        warps, STAGES)
    dU = torch.empty(B, T, H, K, **f32)
    dS, dr, dgP = (torch.empty(B, T, H, **f32) for _ in range(3))
    dw = torch.empty(B, T, H, **f32) if w is not None else None
    dP0 = torch.empty(N, H, K, K, **f32)
    variance = dvar is not None
    run_kernel(
        kernels.covariance_bwd_kernel, (N * H,),
        (q, k, g, w if w is not None else g, saved.U, saved.S, saved.QPQ if variance else g, De,
         dvar if variance else g, PT, dPT if dPT is not None else PT, dP0, dU, dS, dr, dw if dw is not None else dr,
         dgP, varlen, T, H, K, tokens, NV),
        {"HAS_W": w is not None, "VAR": variance, "HAS_DFINAL": dPT is not None, "IS_VARLEN": is_varlen, "BK": BK},
        warps, STAGES)
    dQ, dK = (torch.empty(NV, B, T, H, K, **f32) for _ in range(2))
    dG = torch.empty(NV, B, T, H, **f32)
    run_kernel(
        kernels.filter_grads_kernel, (NV, N * H),
        (q, k, v, g, r, w if w is not None else g, M0 if M0 is not None else dM0, P0 if P0 is not None else dP0,
         do, dvar if variance else g, dE, dU, dS, dM0, dQ, dK, dG, varlen, scale, prior, T, H, K, V, tokens),
        {"HAS_W": w is not None, "HAS_INIT": M0 is not None, "VAR": variance, "IS_VARLEN": is_varlen, "BK": BK,
         "BV": BV}, warps, STAGES)
    dq, dk, dg = (x[0] if NV == 1 else x.sum(0) for x in (dQ, dK, dG))
    return dq.to(q.dtype), dk.to(k.dtype), dE.to(v.dtype), dg + dgP, dr, dw, dM0, dP0


class BayesFilterFunction(torch.autograd.Function):
    """The kernels under autograd: (q, k, v, g, r, w, M0, P0) -> (o, var, M_T, P_T)."""

    @staticmethod
    def forward(ctx, q, k, v, g, r, w, M0, P0, cu_seqlens, scale, prior, variance, launch):
        o, var, MT, PT, saved = filter_forward(q, k, v, g, r, w, M0, P0, cu_seqlens, scale, prior, variance, True,
                                               launch)
        ctx.save_for_backward(q, k, v, g, r, w, M0, P0, cu_seqlens, PT, saved.U, saved.S, saved.E, saved.QPQ)
        ctx.scale, ctx.prior, ctx.variance, ctx.launch = scale, prior, variance, launch
        ctx.set_materialize_grads(False)  # an unused output (the final state, say) has no gradient
        ctx.mark_non_differentiable(*([] if variance else [var]))
        return o, var, MT, PT

    @staticmethod
    def backward(ctx, do, dvar, dMT, dPT):
        q, k, v, g, r, w, M0, P0, cu_seqlens, PT, U, S, E, QPQ = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        if ctx.variance and dvar is None:
            dvar = torch.zeros_like(S)
        grads = filter_backward(q, k, v, g, r, w, M0, P0, cu_seqlens, ctx.scale, ctx.prior, Saved(U, S, E, QPQ), PT,
                                do.contiguous(), dvar.contiguous() if ctx.variance else None,
                                None if dMT is None else dMT.contiguous(), None if dPT is None else dPT.contiguous(),
                                ctx.launch)
        dq, dk, dv, dg, dr, dw, dM0, dP0 = grads
        return (dq, dk, dv, dg, dr, dw, dM0 if M0 is not None else None, dP0 if P0 is not None else None,
                None, None, None, None, None)
