"""Causal depthwise short convolution: forward, backward and the decoding step, activation fused.

    z_t = b + sum_i w[:, i] x_(t - lag_i),  lag_i = W - 1 - i,   y_t = act(z_t)

x is read as ``[B, T, C]`` (a stride per batch row and per token, channels contiguous); with ``cu_seqlens``
(B == 1) every token finds its sequence by a binary search of the boundaries, and a tap that reaches before
the sequence's first token reads the sequence's history ``h0`` ([N, W-1, C], oldest first) or zero. Nothing
is saved for the backward but the inputs: it recomputes z where it needs act'(z).

Backward, per source token s of sequence n (tokens u = s + lag read x_s through the weight column W-1-lag)::

    dz_u = dy_u act'(z_u)
    dx_s = sum_lag w[:, W-1-lag] dz_(s+lag)   (u inside the sequence)  + dfinal[n, W-1-(eos-s)] (last W-1 tokens)
    dw[:, i] = sum_t dz_t x_(t-lag_i),  db = sum_t dz_t   (per token block, summed after)
    dh0[n, j] = sum_(u <= j) w[:, j-u] dz_(bos+u)   + dfinal[n, j - L] (sequences shorter than W-1)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import activate, activation_grad, next_power_of_2, rounded, total

#: at most this many tokens per program of the forward and the backward
BLOCK_T = 32
#: at most this many channels per program
BLOCK_C = 128


def _blocks(T: int, C: int) -> tuple[int, int]:
    return min(BLOCK_T, next_power_of_2(max(T, 1))), min(BLOCK_C, next_power_of_2(C))


@triton.jit
def locate(t, cu_seqlens, b, T, N, STEPS, IS_VARLEN: tl.constexpr):
    """(sequence, its first token, its end) of every token t of batch row b; varlen: the last n with
    cu_seqlens[n] <= t, by STEPS = ceil(log2(N)) halvings."""
    if IS_VARLEN:
        lo = tl.zeros_like(t)
        hi = lo + N
        for _ in range(STEPS):
            mid = (lo + hi) // 2
            right = tl.load(cu_seqlens + mid).to(tl.int32) <= t
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        bos = tl.load(cu_seqlens + lo).to(tl.int32)
        eos = tl.load(cu_seqlens + lo + 1).to(tl.int32)
        n = lo
    else:
        n = tl.zeros_like(t) + b
        bos = tl.zeros_like(t)
        eos = bos + T
    return n, bos, eos


@triton.jit
def tap(x, h0, b, u, pos, n, c, mask, lag, sxb, sxt, C, W: tl.constexpr, HAS_H0: tl.constexpr):
    """The input lag tokens before token u (at position pos of its sequence n): [rows, BC] fp32, from x when it
    lies in the sequence, else from the history h0 [N, W-1, C] (or 0)."""
    inside = (pos >= lag)[:, None]
    v = tl.load(x + b.to(tl.int64) * sxb + (u - lag).to(tl.int64)[:, None] * sxt + c[None, :],
                mask=mask & inside, other=0.0).to(tl.float32)
    if HAS_H0:
        slot = (n * (W - 1) + W - 1 + pos - lag).to(tl.int64)
        v += tl.load(h0 + slot[:, None] * C + c[None, :], mask=mask & ~inside, other=0.0).to(tl.float32)
    return v


@triton.jit
def conv_at(x, w, bias, h0, b, u, pos, n, c, mask, sxb, sxt, C, W: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_H0: tl.constexpr):
    """z at tokens u (positions pos in their sequences n): [rows, BC] fp32. (:func:`tap`, written out: a nested
    call costs the interpreter a few milliseconds.)"""
    mc = c < C
    z = tl.zeros((u.shape[0], c.shape[0]), tl.float32)
    xs = x + b.to(tl.int64) * sxb + u.to(tl.int64)[:, None] * sxt + c[None, :]  # x_u
    if HAS_H0:
        hs = h0 + (n * (W - 1) + W - 1 + pos).to(tl.int64)[:, None] * C + c[None, :]  # h0 slot of position pos
    ws = w + c * W
    for i in tl.static_range(W):
        lag = W - 1 - i
        inside = (pos >= lag)[:, None]
        v = tl.load(xs - lag * sxt, mask=mask & inside, other=0.0).to(tl.float32)
        if HAS_H0:
            v += tl.load(hs - lag * C, mask=mask & ~inside, other=0.0).to(tl.float32)
        z += tl.load(ws + i, mask=mc, other=0.0).to(tl.float32)[None, :] * v
    if HAS_BIAS:
        z += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def dz_at(x, w, bias, h0, dy, b, u, pos, n, c, mask, T, sxb, sxt, C, W: tl.constexpr, ACT: tl.constexpr,
          HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr):
    """dL/dz at tokens u (0 outside mask): dy [B, T, C] (contiguous) times act'(z), z recomputed."""
    dz = tl.load(dy + (b.to(tl.int64) * T + u.to(tl.int64))[:, None] * C + c[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    if ACT != 0:
        dz *= activation_grad(conv_at(x, w, bias, h0, b, u, pos, n, c, mask, sxb, sxt, C, W, HAS_BIAS, HAS_H0), ACT)
    return dz


@triton.jit
def conv_fwd_kernel(x, w, bias, h0, y, cu_seqlens, T, C, N, STEPS, sxb, sxt, W: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr):
    """y [B, T, C] (contiguous) = act(z) for a [BT, BC] tile. Grid (T blocks, C blocks, B)."""
    b = tl.program_id(2)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (t < T)[:, None] & (c < C)[None, :]
    n, bos, _ = locate(t, cu_seqlens, b, T, N, STEPS, IS_VARLEN)
    z = conv_at(x, w, bias, h0, b, t, t - bos, n, c, mask, sxb, sxt, C, W, HAS_BIAS, HAS_H0)
    out = activate(z, ACT)
    tl.store(y + (b.to(tl.int64) * T + t)[:, None] * C + c[None, :], rounded(out, y.dtype.element_ty), mask=mask)


@triton.jit
def conv_bwd_kernel(x, w, bias, h0, dy, dfinal, dx, dw, db, cu_seqlens, T, C, N, STEPS, sxb, sxt,
                    W: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
                    HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dx [B, T, C] for a [BT, BC] tile of source tokens, and this tile's share of dw [P, C, W], db [P, C] (fp32,
    P = B * T blocks). Grid (T blocks, C blocks, B)."""
    b = tl.program_id(2)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    mask = (t < T)[:, None] & mc[None, :]
    n, bos, eos = locate(t, cu_seqlens, b, T, N, STEPS, IS_VARLEN)
    pos = t - bos
    dz0 = dz_at(x, w, bias, h0, dy, b, t, pos, n, c, mask, T, sxb, sxt, C, W, ACT, HAS_BIAS, HAS_H0)
    dxt = tl.load(w + c * W + W - 1, mask=mc, other=0.0).to(tl.float32)[None, :] * dz0
    for lag in tl.static_range(1, W):  # token t + lag reads x_t through weight column W - 1 - lag
        later = mask & (t + lag < eos)[:, None]
        dz = dz_at(x, w, bias, h0, dy, b, t + lag, pos + lag, n, c, later, T, sxb, sxt, C, W, ACT, HAS_BIAS, HAS_H0)
        dxt += tl.load(w + c * W + W - 1 - lag, mask=mc, other=0.0).to(tl.float32)[None, :] * dz
    if HAS_DFINAL:  # the last W - 1 tokens of a sequence are its final state
        j = W - 1 - (eos - t)
        dxt += tl.load(dfinal + (n * (W - 1) + j).to(tl.int64)[:, None] * C + c[None, :],
                       mask=mask & (j >= 0)[:, None], other=0.0).to(tl.float32)
    tl.store(dx + (b.to(tl.int64) * T + t)[:, None] * C + c[None, :], rounded(dxt, dx.dtype.element_ty), mask=mask)
    p = b * tl.num_programs(0) + tl.program_id(0)
    for i in tl.static_range(W):
        xi = tap(x, h0, b, t, pos, n, c, mask, W - 1 - i, sxb, sxt, C, W, HAS_H0)
        tl.store(dw + (p.to(tl.int64) * C + c) * W + i, total(dz0 * xi, 0), mask=mc)
    if HAS_BIAS:
        tl.store(db + p.to(tl.int64) * C + c, total(dz0, 0), mask=mc)


@triton.jit
def conv_state_bwd_kernel(x, w, bias, h0, dy, dfinal, dh0, cu_seqlens, T, C, sxb, sxt, W: tl.constexpr,
                          ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DFINAL: tl.constexpr,
                          IS_VARLEN: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr):
    """dh0 [N, W-1, C] (fp32): the history's slot j is read by the sequence's tokens u <= j through weight column
    j - u. Grid (N, C blocks)."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, BJ)
    mc = c < C
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int32)
        L = tl.load(cu_seqlens + n + 1).to(tl.int32) - bos
        b = n * 0
    else:
        bos = 0
        L = T
        b = n
    seq = tl.zeros_like(j) + n
    acc = tl.zeros((BJ, BC), tl.float32)
    for k in tl.static_range(W - 1):  # token u = j - k reads slot j through weight column k
        u = j - k
        m = ((u >= 0) & (u < L) & (j < W - 1))[:, None] & mc[None, :]
        dz = dz_at(x, w, bias, h0, dy, b, bos + u, u, seq, c, m, T, sxb, sxt, C, W, ACT, HAS_BIAS, True)
        acc += tl.load(w + c * W + k, mask=mc, other=0.0).to(tl.float32)[None, :] * dz
    if HAS_DFINAL:  # a sequence shorter than W - 1 passes slots L.. of its history on to its final state
        f = j - L
        m = ((f >= 0) & (j < W - 1))[:, None] & mc[None, :]
        acc += tl.load(dfinal + (n * (W - 1) + f).to(tl.int64)[:, None] * C + c[None, :], mask=m,
                       other=0.0).to(tl.float32)
    tl.store(dh0 + (n * (W - 1) + j).to(tl.int64)[:, None] * C + c[None, :], acc,
             mask=(j < W - 1)[:, None] & mc[None, :])


@triton.jit
def final_state_kernel(x, h0, final, cu_seqlens, T, C, sxb, sxt, W: tl.constexpr, HAS_H0: tl.constexpr,
                       IS_VARLEN: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr):
    """final [N, W-1, C]: the last W - 1 inputs of sequence n (its history where it is shorter). Grid (N, C
    blocks)."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, BJ)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int32)
        L = tl.load(cu_seqlens + n + 1).to(tl.int32) - bos
        b = n * 0
    else:
        bos = 0
        L = T
        b = n
    pos = L - (W - 1) + j
    mask = (j < W - 1)[:, None] & (c < C)[None, :]
    v = tap(x, h0, b, bos + pos, pos, tl.zeros_like(j) + n, c, mask, 0, sxb, sxt, C, W, HAS_H0)
    tl.store(final + (n * (W - 1) + j).to(tl.int64)[:, None] * C + c[None, :],
             rounded(v, final.dtype.element_ty), mask=mask)


@triton.jit
def conv_step_kernel(x, state, w, bias, y, C, sxb, W: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BJ: tl.constexpr, BC: tl.constexpr):
    """One token x [B, C] against state [B, W-1, C] (contiguous), shifted in place; y [B, C]. Grid (B, C blocks)."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, BJ)
    mc = c < C
    mj = (j < W - 1)[:, None] & mc[None, :]
    rows = state + (b.to(tl.int64) * (W - 1) + j)[:, None] * C + c[None, :]
    past = tl.load(rows, mask=mj, other=0.0).to(tl.float32)
    xt = tl.load(x + b.to(tl.int64) * sxb + c, mask=mc, other=0.0)
    wj = tl.load(w + c[None, :] * W + j[:, None], mask=mj, other=0.0).to(tl.float32)
    z = total(wj * past, 0) + tl.load(w + c * W + W - 1, mask=mc, other=0.0).to(tl.float32) * xt.to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)
    tl.store(y + b.to(tl.int64) * C + c, rounded(activate(z, ACT), y.dtype.element_ty), mask=mc)
    newer = tl.load(rows + C, mask=(j < W - 2)[:, None] & mc[None, :], other=0.0).to(tl.float32)
    newer = tl.where((j == W - 2)[:, None], xt.to(tl.float32)[None, :], newer)
    tl.debug_barrier()  # every thread has read the old history before any row is overwritten
    tl.store(rows, rounded(newer, state.dtype.element_ty), mask=mj)


def _geometry(x: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[int, int, int]:
    """(N sequences, binary-search steps, 1 if varlen else 0)."""
    if cu_seqlens is None:
        return x.shape[0], 0, 0
    N = cu_seqlens.shape[0] - 1
    return N, max(N - 1, 0).bit_length(), 1


def conv_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], h0: Optional[Tensor],
                 cu_seqlens: Optional[Tensor], act: int, output_final: bool) -> tuple[Tensor, Optional[Tensor]]:
    """-> (y [B, T, C] in x's dtype, final state [N, W-1, C] or None). weight, bias, h0 contiguous; x's channels
    contiguous."""
    B, T, C = x.shape
    W = weight.shape[1]
    N, steps, varlen = _geometry(x, cu_seqlens)
    BT, BC = _blocks(T, C)
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    conv_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC), B)](
        x, weight, bias, h0, y, cu_seqlens, T, C, N, steps, x.stride(0), x.stride(1), W=W, ACT=act,
        HAS_BIAS=bias is not None, HAS_H0=h0 is not None, IS_VARLEN=varlen, BT=BT, BC=BC)
    if not output_final:
        return y, None
    final = torch.empty(N, W - 1, C, device=x.device, dtype=x.dtype)
    final_state_kernel[(N, triton.cdiv(C, BC))](x, h0, final, cu_seqlens, T, C, x.stride(0), x.stride(1), W=W,
                                                HAS_H0=h0 is not None, IS_VARLEN=varlen, BJ=next_power_of_2(W - 1),
                                                BC=BC)
    return y, final


def conv_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], h0: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], dy: Tensor, dfinal: Optional[Tensor], act: int
                  ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """-> (dx, dweight, dbias, dh0) in the dtypes of x, weight, bias, h0 (None where absent)."""
    B, T, C = x.shape
    W = weight.shape[1]
    N, steps, varlen = _geometry(x, cu_seqlens)
    BT, BC = _blocks(T, C)
    dy = dy.contiguous()
    dfinal = None if dfinal is None else dfinal.contiguous()
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    blocks = triton.cdiv(T, BT)
    dw = torch.empty(B * blocks, C, W, device=x.device, dtype=torch.float32)
    db = torch.empty(B * blocks, C, device=x.device, dtype=torch.float32) if bias is not None else None
    conv_bwd_kernel[(blocks, triton.cdiv(C, BC), B)](
        x, weight, bias, h0, dy, dfinal, dx, dw, db, cu_seqlens, T, C, N, steps, x.stride(0), x.stride(1), W=W,
        ACT=act, HAS_BIAS=bias is not None, HAS_H0=h0 is not None, HAS_DFINAL=dfinal is not None, IS_VARLEN=varlen,
        BT=BT, BC=BC)
    dh0 = None
    if h0 is not None:
        dh0 = torch.empty(N, W - 1, C, device=x.device, dtype=torch.float32)
        conv_state_bwd_kernel[(N, triton.cdiv(C, BC))](
            x, weight, bias, h0, dy, dfinal, dh0, cu_seqlens, T, C, x.stride(0), x.stride(1), W=W, ACT=act,
            HAS_BIAS=bias is not None, HAS_DFINAL=dfinal is not None, IS_VARLEN=varlen, BJ=next_power_of_2(W - 1),
            BC=BC)
        dh0 = dh0.to(h0.dtype)
    dbias = None if bias is None else db.sum(0).to(bias.dtype)
    return dx, dw.sum(0).to(weight.dtype), dbias, dh0


def conv_step(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], act: int) -> Tensor:
    """y [B, C]; state [B, W-1, C] (contiguous) shifted in place by x [B, C] (channels contiguous)."""
    B, C = x.shape
    W = weight.shape[1]
    BC = min(BLOCK_C, next_power_of_2(C))
    y = torch.empty(B, C, device=x.device, dtype=x.dtype)
    conv_step_kernel[(B, triton.cdiv(C, BC))](x, state, weight, bias, y, C, x.stride(0), W=W, ACT=act,
                                              HAS_BIAS=bias is not None, BJ=next_power_of_2(W - 1), BC=BC)
    return y
