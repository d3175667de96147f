"""Pieces shared by the flash kernels of forgetting attention.

Layout of every kernel: activations are contiguous ``[B, T, heads, D]``, read by token row
(``tokens = B * T`` or the packed varlen axis). A sequence owns query rows ``[qbos, qbos + Lq)``
and key rows ``[kbos, kbos + Lk)``; within it a token has a *position* ``p``: keys
``0 <= p < Lk``, queries ``Lk - Lq <= p < Lk`` (the queries are the newest keys, ``Lq == Lk``
in training). Masks and tile ranges are written in positions (int32). A tile is addressed by
one 64-bit scalar pointer to its first row and 32-bit offsets within it, so no tile holds a
64-bit address per element. Query blocks of a varlen batch take the slots of the recurrence
kernels (``first_slot(n) = bos // BM + n``): no host synchronisation.

Scores live in log2 units: ``s = log2(e) (scale q.k + c_i - c_j)``, so every softmax
exponential is one ``exp2``; the saved log-sum-exp is in the same units.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.common import _INTERP, LOG2E, locate_chunk, rounded, sequence_bounds

#: the running maximum before any key: finite, so a row whose first tiles are all masked keeps exp2(m - m) = 1
NO_MAX: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def dot(a, b, DT: tl.constexpr):
    """a @ b with both operands in the inputs' dtype DT, fp32 accumulation: bf16/fp16 tensor-core products, and
    for fp32 inputs three tf32 products (``tf32x3``, about fp32's accuracy). The interpreter multiplies bf16 bit
    patterns as integers, so there the rounded operands are widened to fp32 first."""
    if DT == tl.float32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    elif _INTERP:
        acc = tl.dot(rounded(a, DT).to(tl.float32), rounded(b, DT).to(tl.float32))
    else:
        acc = tl.dot(a.to(DT), b.to(DT))
    return acc


@triton.jit
def row_max(x, axis: tl.constexpr):
    """tl.max spelled with Triton builtins (see ``recurrence.triton.common.total``); its combine function is the
    one the interpreter reduces with numpy."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def sequence_rows(pid, nh, cu_seqlens, N, Tq, Tk, H, BM: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The block of queries of program (pid, nh) (grid: query blocks x N * H, or varlen slots x H).

    Returns (h, qrow0, krow0, Lk, p0, active): head h; the memory rows of position 0 of the queries and
    of the keys (int64; the query at position p is row ``qrow0 + p``); the key count Lk and the position
    p0 of the block's first query (int32); whether the block holds any query (idle varlen slots do not).
    """
    h = nh % H
    if IS_VARLEN:
        n, t0, nrows = locate_chunk(pid, cu_seqlens, N, Tq, BM, True)
        bos, eos = sequence_bounds(n, cu_seqlens, Tq, True)
        qrow0 = bos
        krow0 = bos
        Lk = (eos - bos).to(tl.int32)
        p0 = (t0 - bos).to(tl.int32)
        active = nrows > 0
    else:
        n = nh // H
        Lk = n * 0 + Tk
        off = Lk - Tq  # the queries are the last Tq keys
        qrow0 = n.to(tl.int64) * Tq - off
        krow0 = n.to(tl.int64) * Tk
        p0 = off + pid * BM
        active = p0 < Lk
    return h, qrow0, krow0, Lk, p0, active


@triton.jit
def tile(base, r, valid, stride, cols):
    """[R, C] ``base[r * stride + cols]`` of a scalar pointer base: 32-bit offsets within the tile (one 64-bit
    address per tile, not per element), 0 where not valid."""
    return tl.load(base + r[:, None] * stride + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def tile_t(base, r, valid, stride, cols):
    """The transposed tile: [C, R] ``base[r * stride + cols]``."""
    return tl.load(base + r[None, :] * stride + cols[:, None], mask=valid[None, :], other=0.0)


@triton.jit
def forget2(base, r, valid, H):
    """Cumulative log forget values ``base[r * H]`` in log2 units: [R] fp32 (0 where not valid)."""
    return tl.load(base + r * H, mask=valid, other=0.0) * LOG2E


@triton.jit
def visible(pq, pk, Lk, window, HAS_WINDOW: tl.constexpr):
    """Whether query position pq sees key position pk (operands broadcast to a tile, either orientation):
    0 <= pk <= pq < Lk and pk > pq - window."""
    ok = (pk <= pq) & (pk >= 0) & (pq < Lk)
    if HAS_WINDOW:
        ok = ok & (pk > pq - window)
    return ok


@triton.jit
def present(base, r, kvalid):
    """The key mask ``base[r]`` (uint8 per key, r shaped to broadcast over the tile): whether a key is there."""
    return tl.load(base + r, mask=kvalid, other=0) != 0


@triton.jit
def prune_delta2(BOUND, log_tol, h, Lk, window, HAS_WINDOW: tl.constexpr):
    """The pruning threshold of head h in one sequence, log2 units: log2(e) (log tol - U_h - log n),
    n = min(window, Lk) (``reference.prune_threshold``)."""
    n = Lk
    if HAS_WINDOW:
        n = tl.minimum(n, window)
    return (log_tol - tl.load(BOUND + h) - tl.log(n.to(tl.float32))) * LOG2E


@triton.jit
def key_tiles(p0, Lk, window, BM: tl.constexpr, BN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles of the queries [p0, p0 + BM): starts ``lo, lo + BN, ...`` below ``hi``, on the grid
    ``p0 - m BN``. Tiles before ``full`` or from p0 on need masks (window edge, sequence start,
    diagonal); tiles wholly outside the window are not visited."""
    hi = tl.minimum(p0 + BM, Lk)
    if HAS_WINDOW:
        first_any = tl.maximum(p0 - window + 1, 0)  # the first query's oldest key
        first_all = tl.maximum(p0 + BM - window, 0)  # the last query's oldest key
    else:
        first_any = p0 * 0
        first_all = p0 * 0
    lo = p0 - ((p0 - first_any + BN - 1) // BN) * BN  # operands of // stay >= 0
    full = p0 - (tl.maximum(p0 - first_all, 0) // BN) * BN
    return lo, full, hi


@triton.jit
def first_kept_tile(c_key, H, c0, lo, p0, delta2, BN: tl.constexpr):
    """The first key tile before p0 that pruning keeps. ``c_key``: pointer to the cumulative forget value of the
    key at position 0 (stride H); c0: that of the first query (log2 units). A binary search for the first start
    ``s = lo + m BN`` with ``c0 - c(s + BN - 1) >= delta`` (c falls with the position: the kept tiles are a
    suffix)."""
    a = (p0 - lo) * 0
    b = (p0 - lo) // BN
    while a < b:
        mid = (a + b) // 2
        keep = c0 - tl.load(c_key + (lo + mid * BN + BN - 1) * H) * LOG2E >= delta2
        b = tl.where(keep, mid, b)
        a = tl.where(keep, a, mid + 1)
    return lo + a * BN


@triton.jit
def first_pruned_tile(c_key, H, c_last, lo, hi, delta2, BM: tl.constexpr):
    """For a key block whose newest key has c = c_last (log2 units): the start of the first query tile
    ``t = lo + m BM`` below ``hi`` with ``c(t) - c_last < delta`` (a suffix), or ``hi``. ``c_key`` as in
    :func:`first_kept_tile`."""
    a = (hi - lo) * 0
    b = (hi - lo + BM - 1) // BM
    while a < b:
        mid = (a + b) // 2
        pruned = tl.load(c_key + (lo + mid * BM) * H) * LOG2E - c_last < delta2
        b = tl.where(pruned, mid, b)
        a = tl.where(pruned, a, mid + 1)
    return tl.minimum(lo + a * BM, hi)
