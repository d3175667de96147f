"""Pieces shared by the flash kernels of forgetting attention.

Layout of every kernel: activations are contiguous ``[B, T, heads, D]``, read by token row
(``tokens = B * T`` or the packed varlen axis). The per-head vectors (the cumulative forget
values ``c``, the log-sum-exp, delta, dc) are head-major ``[B, H, T]`` fp32, so that a tile's
values are contiguous. A sequence owns query rows ``[qbos, qbos + Lq)`` and key rows
``[kbos, kbos + Lk)``; within it a token has a *position* ``p``: keys ``0 <= p < Lk``, queries
``Lk - Lq <= p < Lk`` (the queries are the newest keys, ``Lq == Lk`` in training). Masks and tile
ranges are written in positions (int32). A tile is addressed by one 64-bit scalar pointer to its
first row and 32-bit offsets within it. A tile spans the head dim rounded up to a power of two (the
kernels' BD and BDV: 96 -> 128, 192 -> 256); its loads read the padded columns as zeros, which add
nothing to any product, and its stores skip them, so no tensor is padded in memory. Query blocks of a
varlen batch take the slots of the recurrence kernels (``first_slot(n) = bos // BM + n``): no host
synchronisation.

Scores live in log2 units, ``s = log2(e) (scale q.k + c_i - c_j)``, so every softmax exponential
is one ``exp2``. The forget bias is a difference of two large numbers (``|c|`` grows with the
position), so it is never formed from rounded scaled values: a tile that a mask crosses takes
``(c_i - c_j) log2(e)`` per pair, and a tile that every query of a block sees whole splits the bias
at a reference ``R`` that lies between its keys' and its queries' values (``c_i <= R <= c_j``)::

    s_ij = scale log2(e) q_i.k_j - fma(c_j, log2(e), -R2) + fma(c_i, log2(e), -R2),   R2 = R log2(e)

Each part is one fused multiply-add, rounded once, to a value no larger than the bias itself: its
rounding error is a fixed fraction of the pair's bias, ``|bias| 2^-24``, which the pair's weight
``e^-|bias|`` makes negligible; the rounding of R2 cancels between the two parts. The per-key part
enters each element (one FMA with the scale); the per-query part is a row constant added to the
row's running maximum (forward) or to its log-sum-exp (backward).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.layout import locate_chunk, sequence_bounds
from ...recurrence.triton.numerics import _INTERP, LOG2E, rounded

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
    """tl.max spelled with Triton builtins (see ``recurrence.triton.numerics.total``); its combine function is the
    one the interpreter reduces with numpy."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def last_first(axis: tl.constexpr):
    """The program's block index along ``axis``, counted from the last: causal query blocks see the most keys at
    the end of a sequence, so the longest programs start first and the short ones fill the tail of the grid."""
    return tl.num_programs(axis) - 1 - tl.program_id(axis)


@triton.jit
def sequence_rows(pid, nh, cu_seqlens, N, Tq, Tk, HEADS, BM: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The block of BM tokens of program (pid, nh) (grid: N * HEADS x blocks, or HEADS x varlen slots).

    Returns (n, head, qrow0, krow0, Lk, p0, active): sequence n; the head; the memory rows of position 0 of the
    queries and of the keys (int64; the query at position p is row ``qrow0 + p``); the key count Lk and the
    position p0 of the block's first token (int32); whether the block holds any token (idle varlen slots do not).
    """
    head = nh % HEADS
    if IS_VARLEN:
        n, t0, nrows = locate_chunk(pid, cu_seqlens, N, Tq, BM, True)
        bos, eos = sequence_bounds(n, cu_seqlens, Tq, True)
        qrow0 = bos
        krow0 = bos
        Lk = (eos - bos).to(tl.int32)
        p0 = (t0 - bos).to(tl.int32)
        active = nrows > 0
    else:
        n = nh // HEADS
        Lk = n * 0 + Tk
        off = Lk - Tq  # the queries are the last Tq keys
        qrow0 = n.to(tl.int64) * Tq - off
        krow0 = n.to(tl.int64) * Tk
        p0 = off + pid * BM
        active = p0 < Lk
    return n, head, qrow0, krow0, Lk, p0, active


@triton.jit
def head_offsets(n, qrow0, krow0, Tq, Tk, H, IS_VARLEN: tl.constexpr):
    """Where sequence n's per-head vectors start ([B, H, T] head-major): c of head h at key position p is element
    ``cseq + h Tk + p``; the log-sum-exp and delta of head h at query position p are element ``lseq + h Tq + p``."""
    if IS_VARLEN:
        cseq = krow0
        lseq = qrow0
    else:
        cseq = n.to(tl.int64) * H * Tk
        lseq = n.to(tl.int64) * H * Tq - (Tk - Tq)
    return cseq, lseq


@triton.jit
def cols_mask(cols, NC: tl.constexpr):
    """[C] whether each of ``cols`` (``arange(0, C)``, C the next power of two of the head dim NC) is a real
    column; None when C == NC (nothing padded, nothing to mask)."""
    if NC < cols.shape[0]:
        ok = cols < NC
    else:
        ok = None
    return ok


@triton.jit
def tile_mask(valid, cols, NC: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """[R, C] mask of a tile's rows ``valid`` and its real columns (:func:`cols_mask`); [C, R] if TRANSPOSED."""
    if TRANSPOSED:
        ok = valid[None, :]
        if NC < cols.shape[0]:
            ok = ok & (cols < NC)[:, None]
    else:
        ok = valid[:, None]
        if NC < cols.shape[0]:
            ok = ok & (cols < NC)[None, :]
    return ok


@triton.jit
def tile(base, r, valid, stride, cols, NC: tl.constexpr):
    """[R, C] ``base[r * stride + cols]`` of a scalar pointer base: 32-bit offsets within the tile (one 64-bit
    address per tile, not per element), 0 where not valid and in the padded columns ``cols >= NC``."""
    return tl.load(base + r[:, None] * stride + cols[None, :], mask=tile_mask(valid, cols, NC), other=0.0)


@triton.jit
def tile_t(base, r, valid, stride, cols, NC: tl.constexpr):
    """The transposed tile: [C, R] ``base[r * stride + cols]``."""
    return tl.load(base + r[None, :] * stride + cols[:, None], mask=tile_mask(valid, cols, NC, True), other=0.0)


@triton.jit
def whole_tile(base, r, stride, cols, NC: tl.constexpr):
    """:func:`tile` of rows that all exist: no mask but the padded columns'."""
    ptrs = base + r[:, None] * stride + cols[None, :]
    if NC < cols.shape[0]:
        x = tl.load(ptrs, mask=(cols < NC)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def whole_tile_t(base, r, stride, cols, NC: tl.constexpr):
    """:func:`tile_t` of rows that all exist: no mask but the padded columns'."""
    ptrs = base + r[None, :] * stride + cols[:, None]
    if NC < cols.shape[0]:
        x = tl.load(ptrs, mask=(cols < NC)[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def key_c(c_row, KM, p, valid, HAS_FORGET: tl.constexpr, HAS_KEY_MASK: tl.constexpr):
    """The keys' side of the bias at positions p: c (natural units; 0 without a forget gate), and +inf where no
    key is (not ``valid``, or absent from the key mask ``KM[p]``), whose bias ``c_i - c_j`` is then -inf.
    ``c_row``, ``KM``: the head's c and the sequence's key mask at position 0."""
    if HAS_FORGET:
        ck = tl.load(c_row + p, mask=valid, other=float("inf"))
    else:
        ck = tl.where(valid, 0.0, float("inf"))
    if HAS_KEY_MASK:
        ck = tl.where(tl.load(KM + p, mask=valid, other=0) != 0, ck, float("inf"))
    return ck


@triton.jit
def split_bias(c, ref2):
    """One part of the bias split at a reference (module docstring): ``c log2(e) - ref2`` rounded once."""
    return tl.fma(c, LOG2E, -ref2)


@triton.jit
def whole_key_c(c_row, KM, p, ref2, HAS_FORGET: tl.constexpr, HAS_KEY_MASK: tl.constexpr):
    """The keys' part of the bias split at the reference ``ref2`` (log2 units) at positions p that all exist
    (:func:`split_bias`; 0 without a forget gate), +inf where the key mask marks a key absent."""
    if HAS_FORGET:
        kb = split_bias(tl.load(c_row + p), ref2)
    else:
        kb = tl.zeros(p.shape, tl.float32)
    if HAS_KEY_MASK:
        kb = tl.where(tl.load(KM + p) != 0, kb, float("inf"))
    return kb


@triton.jit
def visible(pq, pk, window, HAS_WINDOW: tl.constexpr):
    """Whether query position pq sees key position pk of the same sequence (operands broadcast to a tile, either
    orientation): pk <= pq and pk > pq - window."""
    ok = pk <= pq
    if HAS_WINDOW:
        ok = ok & (pk > pq - window)
    return ok


@triton.jit
def prune_delta(BOUND, log_tol, h, Lk, window, HAS_WINDOW: tl.constexpr):
    """The pruning threshold of head h in one sequence (natural units): log tol - U_h - log n,
    n = min(window, Lk) (``reference.prune_threshold``)."""
    n = Lk
    if HAS_WINDOW:
        n = tl.minimum(n, window)
    return log_tol - tl.load(BOUND + h) - tl.log(n.to(tl.float32))


@triton.jit
def key_tiles(p0, Lk, window, BM: tl.constexpr, BN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles of the queries [p0, p0 + BM): starts ``lo, lo + BN, ...`` below ``hi``, on the grid
    ``p0 - m BN``. Every query of the block sees the tiles in ``[full, p0)`` whole; tiles in ``[lo, full)``
    (window edge, sequence start) and from p0 on (the diagonal) need masks; tiles wholly outside the window are
    not visited."""
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
def first_key_tile(c_row, c_query, lo, p0, delta, OFFSET: tl.constexpr, BN: tl.constexpr):
    """The first key tile start ``s = lo + m BN`` before p0 with ``c_query - c(s + OFFSET) >= delta``, or p0 (c
    falls with the position, so the tiles that hold it are a suffix; a binary search). With OFFSET = BN - 1 and
    the block's first query: the first tile that pruning keeps any pair of; with OFFSET = 0 and its last query: the
    first tile that pruning keeps whole."""
    a = (p0 - lo) * 0
    b = (p0 - lo) // BN
    while a < b:
        mid = (a + b) // 2
        hold = c_query - tl.load(c_row + lo + mid * BN + OFFSET) >= delta
        b = tl.where(hold, mid, b)
        a = tl.where(hold, a, mid + 1)
    return lo + a * BN


@triton.jit
def first_query_tile(c_row, c_key, start, stop, Lk, delta, OFFSET: tl.constexpr, BM: tl.constexpr):
    """For a key block: the first query tile start ``t = start + m BM`` below ``stop`` with
    ``c(min(t + OFFSET, Lk - 1)) - c_key < delta`` (a suffix), or ``stop``. With OFFSET = 0 and the block's newest
    key: the first tile that pruning drops whole; with OFFSET = BM - 1 and its oldest key: the first tile that
    pruning does not keep whole."""
    a = (stop - start) * 0
    b = (stop - start + BM - 1) // BM
    while a < b:
        mid = (a + b) // 2
        pruned = tl.load(c_row + tl.minimum(start + mid * BM + OFFSET, Lk - 1)) - c_key < delta
        b = tl.where(pruned, mid, b)
        a = tl.where(pruned, a, mid + 1)
    return tl.minimum(start + a * BM, stop)
