"""Causal depthwise short convolution: forward, backward and the decoding step, activation fused.

    z_t = b + sum_i w[:, i] x_(t - lag_i),  lag_i = W - 1 - i,   y_t = act(z_t)

x is read as ``[B, T, C]`` (a stride per batch row and per token, channels contiguous); with ``cu_seqlens``
(B == 1) every token finds its sequence by a binary search of the boundaries, and a tap that reaches before
the sequence's first token reads the sequence's history ``h0`` ([N, W-1, C], oldest first) or zero. Nothing
is saved for the backward but the inputs.

The token-tile kernels read the weight tap-major, ``[W, C]`` (the launchers transpose the ``[C, W]`` parameter):
each tap's channels are one contiguous load. Read from ``[C, W]``, a tap's loads lay W elements apart: at
8 x 4096 x 1024 on an H100 the forward took 147 µs with bf16 weights and 282 µs with fp32 ones (a model under
autocast), against 62 and 63 µs tap-major. The decoding step reads the ``[C, W]`` weight as it is (one small
load per token).

Backward in two passes: ``conv_dz_kernel`` recomputes z and writes ``dz_t = dy_t act'(z_t)`` (fp32; without an
activation dz is dy and this pass is skipped); ``conv_dx_kernel`` then reads dz, per source token s of sequence n
(token s + lag reads x_s through weight column W-1-lag)::

    dx_s = sum_lag w[:, W-1-lag] dz_(s+lag)   (s + lag inside the sequence)  + dfinal[n, W-1-(eos-s)] (last W-1)
    dw[:, i] = sum_t dz_t x_(t-lag_i),  db = sum_t dz_t   (per program of TOKENS_PER_PROGRAM tokens, summed after)
    dh0[n, j] = sum_(u <= j) w[:, j-u] dz_(bos+u)   + dfinal[n, j - L] (sequences shorter than W-1)

One pass that recomputed dz_(s+lag) for every lag held W + 1 tiles of taps at once and spilled registers. The dx
pass loops over TOKENS_PER_PROGRAM tokens and sums dw in registers: reducing dw over every 16-token tile (five
block-wide reductions, 24 barriers, per 16 x 128 tile) and writing a [C, W] partial per tile made it 6x slower
than the forward on an H100.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...checks import as_dtype
from ...triton_launch import cdiv, run_kernel
from .common import DEFAULT_WARPS, STAGES, activate, activation_grad, next_power_of_2, rounded, total

#: at most this many tokens per program (with BLOCK_C and WARPS: no register spills on sm_90, about 100 registers)
BLOCK_T = 16
#: at most this many channels per program
BLOCK_C = 128
#: warps per program of the token-tile kernels
WARPS = 8
#: source tokens per program of the backward's dx/dw pass (a multiple of BLOCK_T): its weight gradient is reduced
#: over the tokens once per this many, and P = B * T / this many partial sums are written and summed after
TOKENS_PER_PROGRAM = 64
#: the dx/dw pass holds (next_pow2(W) * its token tile) x BLOCK_C sums of dw: at most this many rows (32: 76
#: registers on sm_90 at W = 4, three programs per SM)
DW_ROWS = 32


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
def tap(x, h0, b, u, pos, n, c, mt, mc, lag, sxb, sxt, C, W: tl.constexpr, HAS_H0: tl.constexpr):
    """The input lag tokens before tokens u (at positions pos of their sequences n): [rows, BC] fp32, from x where
    it lies in the sequence, else from the history h0 [N, W-1, C] (or 0). mt, mc: the rows' and channels' masks."""
    inside = pos >= lag
    rows = x + b.to(tl.int64) * sxb + (u - lag).to(tl.int64) * sxt
    v = tl.load(rows[:, None] + c[None, :], mask=(mt & inside)[:, None] & mc[None, :], other=0.0).to(tl.float32)
    if HAS_H0:
        slots = h0 + (n * (W - 1) + W - 1 + pos - lag).to(tl.int64) * C
        v += tl.load(slots[:, None] + c[None, :], mask=(mt & ~inside)[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)
    return v


@triton.jit
def conv_fwd_kernel(x, w, bias, h0, y, cu_seqlens, T, C, N, STEPS, sxb, sxt, W: tl.constexpr, ACT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr):
    """y [B, T, C] (contiguous) = act(z) for a [BT, BC] tile. Grid (T blocks, C blocks, B)."""
    b = tl.program_id(2)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = t < T, c < C
    n, bos, _ = locate(t, cu_seqlens, b, T, N, STEPS, IS_VARLEN)
    z = tl.zeros((BT, BC), tl.float32)
    for i in tl.static_range(W):
        wi = tl.load(w + i * C + c, mask=mc, other=0.0).to(tl.float32)
        z += wi[None, :] * tap(x, h0, b, t, t - bos, n, c, mt, mc, W - 1 - i, sxb, sxt, C, W, HAS_H0)
    if HAS_BIAS:
        z += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    out = (y + (b.to(tl.int64) * T + t) * C)[:, None] + c[None, :]
    tl.store(out, rounded(activate(z, ACT), y.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit
def conv_dz_kernel(x, w, bias, h0, dy, dz, cu_seqlens, T, C, N, STEPS, sxb, sxt, W: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr):
    """dz [B, T, C] fp32 = dy act'(z) for a [BT, BC] tile, z recomputed (dy contiguous). Grid (T blocks, C blocks,
    B)."""
    b = tl.program_id(2)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = t < T, c < C
    n, bos, _ = locate(t, cu_seqlens, b, T, N, STEPS, IS_VARLEN)
    z = tl.zeros((BT, BC), tl.float32)
    for i in tl.static_range(W):
        wi = tl.load(w + i * C + c, mask=mc, other=0.0).to(tl.float32)
        z += wi[None, :] * tap(x, h0, b, t, t - bos, n, c, mt, mc, W - 1 - i, sxb, sxt, C, W, HAS_H0)
    if HAS_BIAS:
        z += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)[None, :]
    at = ((b.to(tl.int64) * T + t) * C)[:, None] + c[None, :]
    mask = mt[:, None] & mc[None, :]
    tl.store(dz + at, tl.load(dy + at, mask=mask, other=0.0).to(tl.float32) * activation_grad(z, ACT), mask=mask)


@triton.jit
def conv_dx_kernel(x, w, h0, dz, dfinal, dx, dw, db, cu_seqlens, T, C, N, STEPS, CHUNK, sxb, sxt, W: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr):
    """dx [B, T, C] from dz (fp32, contiguous) for the CHUNK source tokens of a program, a [BT, BC] tile at a time,
    and the chunk's shares of dw [P, W, C] and db [P, C] (fp32, P = B * T chunks). Grid (T chunks, C blocks, B).

    dw is summed elementwise over the tiles in BW * BT rows r = i BT + u (tap i < BW = next_pow2(W), token u of the
    tile) and reduced over the tokens once per chunk: a reduction per tile crosses the warps through shared
    memory and barriers."""
    b = tl.program_id(2)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    r = tl.arange(0, BW * BT)
    i, u = r // BT, r % BT
    start = tl.program_id(0) * CHUNK
    dw_rows = tl.zeros((BW * BT, BC), tl.float32)
    db_tile = tl.zeros((BT, BC), tl.float32)
    for t0 in range(start, tl.minimum(start + CHUNK, T), BT):
        t = t0 + tl.arange(0, BT)
        mt = t < T
        n, _, eos = locate(t, cu_seqlens, b, T, N, STEPS, IS_VARLEN)
        rows = dz + (b.to(tl.int64) * T + t) * C
        dz_t = tl.load(rows[:, None] + c[None, :], mask=mt[:, None] & mc[None, :], other=0.0).to(tl.float32)
        g = tl.load(w + (W - 1) * C + c, mask=mc, other=0.0).to(tl.float32)[None, :] * dz_t
        for lag in tl.static_range(1, W):  # token t + lag reads x_t through weight column W - 1 - lag
            wl = tl.load(w + (W - 1 - lag) * C + c, mask=mc, other=0.0).to(tl.float32)
            later = (mt & (t + lag < eos))[:, None] & mc[None, :]
            g += wl[None, :] * tl.load((rows + lag * C)[:, None] + c[None, :], mask=later, other=0.0).to(tl.float32)
        if HAS_DFINAL:  # the last W - 1 tokens of a sequence are its final state
            j = W - 1 - (eos - t)
            slots = dfinal + (n * (W - 1) + j).to(tl.int64) * C
            g += tl.load(slots[:, None] + c[None, :], mask=(mt & (j >= 0))[:, None] & mc[None, :],
                         other=0.0).to(tl.float32)
        out = (dx + (b.to(tl.int64) * T + t) * C)[:, None] + c[None, :]
        tl.store(out, rounded(g, dx.dtype.element_ty), mask=mt[:, None] & mc[None, :])
        db_tile += dz_t
        tr = t0 + u  # row r: dz of token tr times its tap i, x lag_i = W - 1 - i tokens before
        mr = (tr < T) & (i < W)
        nr, bosr, _ = locate(tr, cu_seqlens, b, T, N, STEPS, IS_VARLEN)
        dz_r = tl.load((dz + (b.to(tl.int64) * T + tr) * C)[:, None] + c[None, :], mask=mr[:, None] & mc[None, :],
                       other=0.0).to(tl.float32)
        dw_rows += dz_r * tap(x, h0, b, tr, tr - bosr, nr, c, mr, mc, W - 1 - i, sxb, sxt, C, W, HAS_H0)
    p = (b * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    taps = tl.arange(0, BW)
    tl.store(dw + (p * W + taps)[:, None] * C + c[None, :], total(tl.reshape(dw_rows, (BW, BT, BC)), 1),
             mask=(taps < W)[:, None] & mc[None, :])
    if HAS_BIAS:
        tl.store(db + p * C + c, total(db_tile, 0), mask=mc)


@triton.jit
def sequence_span(cu_seqlens, n, T, IS_VARLEN: tl.constexpr):
    """(batch row, first token, length) of sequence n."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int32)
        L = tl.load(cu_seqlens + n + 1).to(tl.int32) - bos
        b = n * 0
    else:
        bos = n * 0
        L = T
        b = n
    return b, bos, L


@triton.jit
def conv_state_bwd_kernel(w, dz, dfinal, dh0, cu_seqlens, T, C, W: tl.constexpr, HAS_DFINAL: tl.constexpr,
                          IS_VARLEN: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr):
    """dh0 [N, W-1, C] (fp32): the history's slot j is read by the sequence's tokens u <= j through weight column
    j - u. Grid (N, C blocks)."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, BJ)
    mc, mj = c < C, j < W - 1
    b, bos, L = sequence_span(cu_seqlens, n, T, IS_VARLEN)
    g = tl.zeros((BJ, BC), tl.float32)
    for k in tl.static_range(W - 1):  # token u = j - k reads slot j through weight column k
        u = j - k
        rows = dz + (b.to(tl.int64) * T + bos + u) * C
        wk = tl.load(w + k * C + c, mask=mc, other=0.0).to(tl.float32)
        g += wk[None, :] * tl.load(rows[:, None] + c[None, :], mask=(mj & (u >= 0) & (u < L))[:, None] & mc[None, :],
                                   other=0.0).to(tl.float32)
    if HAS_DFINAL:  # a sequence shorter than W - 1 passes slots L.. of its history on to its final state
        slots = dfinal + (n * (W - 1) + j - L).to(tl.int64) * C
        g += tl.load(slots[:, None] + c[None, :], mask=(mj & (j >= L))[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)
    tl.store((dh0 + (n * (W - 1) + j).to(tl.int64) * C)[:, None] + c[None, :], g, mask=mj[:, None] & mc[None, :])


@triton.jit
def final_state_kernel(x, h0, final, cu_seqlens, T, C, sxb, sxt, W: tl.constexpr, HAS_H0: tl.constexpr,
                       IS_VARLEN: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr):
    """final [N, W-1, C]: the last W - 1 inputs of sequence n (its history where it is shorter). Grid (N, C
    blocks)."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, BJ)
    mc, mj = c < C, j < W - 1
    b, bos, L = sequence_span(cu_seqlens, n, T, IS_VARLEN)
    pos = L - (W - 1) + j
    v = tap(x, h0, b, bos + pos, pos, tl.zeros_like(j) + n, c, mj, mc, 0, sxb, sxt, C, W, HAS_H0)
    tl.store((final + (n * (W - 1) + j).to(tl.int64) * C)[:, None] + c[None, :],
             rounded(v, final.dtype.element_ty), mask=mj[:, None] & mc[None, :])


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
    """-> (y [B, T, C] in x's dtype, final state [N, W-1, C] or None). weight [C, W] (read tap-major: a view of
    contiguous [W, C] memory is read in place, any other is copied); bias, h0 contiguous; x's channels contiguous."""
    B, T, C = x.shape
    W = weight.shape[1]
    N, steps, varlen = _geometry(x, cu_seqlens)
    BT, BC = _blocks(T, C)
    y = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    run_kernel(conv_fwd_kernel, (cdiv(T, BT), cdiv(C, BC), B),
               (x, weight.t().contiguous(), bias, h0, y, cu_seqlens, T, C, N, steps, x.stride(0), x.stride(1)),
               {"W": W, "ACT": act, "HAS_BIAS": bias is not None, "HAS_H0": h0 is not None, "IS_VARLEN": varlen,
                "BT": BT, "BC": BC}, WARPS, STAGES)
    if not output_final:
        return y, None
    final = torch.empty(N, W - 1, C, device=x.device, dtype=x.dtype)
    run_kernel(final_state_kernel, (N, cdiv(C, BC)), (x, h0, final, cu_seqlens, T, C, x.stride(0), x.stride(1)),
               {"W": W, "HAS_H0": h0 is not None, "IS_VARLEN": varlen, "BJ": next_power_of_2(W - 1), "BC": BC},
               DEFAULT_WARPS, STAGES)
    return y, final


def conv_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], h0: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], dy: Tensor, dfinal: Optional[Tensor], act: int
                  ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """-> (dx, dweight, dbias, dh0) in the dtypes of x, weight, bias, h0 (None where absent); weight as in
    :func:`conv_forward`, dweight contiguous [C, W]."""
    B, T, C = x.shape
    W = weight.shape[1]
    N, steps, varlen = _geometry(x, cu_seqlens)
    BT, BC = _blocks(T, C)
    dy = dy.contiguous()
    dfinal = None if dfinal is None else dfinal.contiguous()
    blocks = cdiv(T, BT)
    grid = (blocks, cdiv(C, BC), B)
    weight_t = weight.t().contiguous()
    dz = dy  # without an activation dz = dy
    if act != 0:
        dz = torch.empty(B, T, C, device=x.device, dtype=torch.float32)
        run_kernel(conv_dz_kernel, grid,
                   (x, weight_t, bias, h0, dy, dz, cu_seqlens, T, C, N, steps, x.stride(0), x.stride(1)),
                   {"W": W, "ACT": act, "HAS_BIAS": bias is not None, "HAS_H0": h0 is not None, "IS_VARLEN": varlen,
                    "BT": BT, "BC": BC}, WARPS, STAGES)
    dx = torch.empty(B, T, C, device=x.device, dtype=x.dtype)
    BW = next_power_of_2(W)
    chunks = cdiv(T, TOKENS_PER_PROGRAM)
    dw = torch.empty(B * chunks, W, C, device=x.device, dtype=torch.float32)
    db = torch.empty(B * chunks, C, device=x.device, dtype=torch.float32) if bias is not None else None
    run_kernel(conv_dx_kernel, (chunks, cdiv(C, BC), B),
               (x, weight_t, h0, dz, dfinal, dx, dw, db, cu_seqlens, T, C, N, steps, TOKENS_PER_PROGRAM, x.stride(0),
                x.stride(1)),
               {"W": W, "HAS_BIAS": bias is not None, "HAS_H0": h0 is not None, "HAS_DFINAL": dfinal is not None,
                "IS_VARLEN": varlen, "BT": max(1, min(BT, DW_ROWS // BW)), "BC": BC, "BW": BW}, WARPS, STAGES)
    dh0 = None
    if h0 is not None:
        dh0 = torch.empty(N, W - 1, C, device=x.device, dtype=torch.float32)
        run_kernel(conv_state_bwd_kernel, (N, cdiv(C, BC)), (weight_t, dz, dfinal, dh0, cu_seqlens, T, C),
                   {"W": W, "HAS_DFINAL": dfinal is not None, "IS_VARLEN": varlen, "BJ": next_power_of_2(W - 1),
                    "BC": BC}, DEFAULT_WARPS, STAGES)
        dh0 = as_dtype(dh0, h0.dtype)
    dbias = None if bias is None else as_dtype(db.sum(0), bias.dtype)
    return dx, as_dtype(dw.sum(0).t().contiguous(), weight.dtype), dbias, dh0


def conv_step(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], act: int) -> Tensor:
    """y [B, C]; state [B, W-1, C] (contiguous) shifted in place by x [B, C] (channels contiguous)."""
    B, C = x.shape
    W = weight.shape[1]
    BC = min(BLOCK_C, next_power_of_2(C))
    y = torch.empty(B, C, device=x.device, dtype=x.dtype)
    run_kernel(conv_step_kernel, (B, cdiv(C, BC)), (x, state, weight, bias, y, C, x.stride(0)),
               {"W": W, "ACT": act, "HAS_BIAS": bias is not None, "BJ": next_power_of_2(W - 1), "BC": BC},
               DEFAULT_WARPS, STAGES)
    return y
