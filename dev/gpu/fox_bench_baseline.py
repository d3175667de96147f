"""The forgetting-attention flash kernels as they were before the two-loop restructuring (commit 7b84377), frozen for
the same-machine A/B timings of ``fox_bench.py`` (``--only variants``): one loop over key/query tiles with a
branch for the masked tiles, masked loads on every tile, the bias formed from ``c log2(e)`` rounded per key, 2
stages in the backward, dkdv at 32 queries x 64 keys x 8 warps. Kernels only (no torch: ``fox_compile.py
--baseline`` compiles them too); ``fox_bench.py`` launches them on fixed-length batches. Nothing in the library
imports this file.
"""

from __future__ import annotations

import triton
import triton.language as tl

from linmem.ops.recurrence.triton.common import _INTERP, LOG2E, exp2, locate_chunk, rounded, sequence_bounds, total

#: (block_m, block_n, warps, stages) of each kernel at head dim 128, bf16/fp16
TILES = {"forward": (128, 64, 8, 3), "dq": (128, 32, 8, 2), "dkdv": (32, 64, 8, 2)}

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


@triton.jit
def forward_kernel(Q, K, V, C, KM, O, LSE, BOUND, cu_seqlens, scale, log_tol, window, N, Tq, Tk, H,
                   G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   IS_VARLEN: tl.constexpr, HAS_FORGET: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_KEY_MASK: tl.constexpr, PRUNE: tl.constexpr):
    """q: [tokens, H, D], k: [tokens, H / G, D], v: [tokens, H / G, DV], c: [tokens, H] fp32,
    key mask: [tokens] uint8 -> o: [tokens, H, DV], lse: [tokens, H] fp32. Grid (query blocks, N * H)."""
    h, qrow0, krow0, Lk, p0, active = sequence_rows(tl.program_id(0), tl.program_id(1), cu_seqlens, N, Tq, Tk, H,
                                                    BM, IS_VARLEN)
    if active:
        kvh = h // G
        Hkv = H // G
        DT = Q.dtype.element_ty
        r = tl.arange(0, BM)
        c = tl.arange(0, BN)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        pq = p0 + r
        qvalid = pq < Lk
        qrow = qrow0 + p0  # the block's first query row
        q = tile(Q + qrow * (H * D) + h * D, r, qvalid, H * D, d)
        qk_scale = scale * LOG2E
        if HAS_FORGET:
            c_key = C + krow0 * H + h  # the keys' c at position 0
            cq = forget2(c_key + p0 * H, r, qvalid, H)
        lo, full, hi = key_tiles(p0, Lk, window, BM, BN, HAS_WINDOW)
        if PRUNE:
            delta2 = prune_delta2(BOUND, log_tol, h, Lk, window, HAS_WINDOW)
            lo = first_kept_tile(c_key, H, tl.load(c_key + p0 * H) * LOG2E, lo, p0, delta2, BN)
        m = tl.full([BM], NO_MAX, tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DV], tl.float32)
        for s in range(lo, hi, BN):
            pk = s + c
            kvalid = (pk >= 0) & (pk < Lk)
            krow = krow0 + s
            kT = tile_t(K + krow * (Hkv * D) + kvh * D, c, kvalid, Hkv * D, d)
            v = tile(V + krow * (Hkv * DV) + kvh * DV, c, kvalid, Hkv * DV, dv)
            sc = dot(q, kT, DT) * qk_scale
            if HAS_FORGET:
                bias = cq[:, None] - forget2(c_key + s * H, c, kvalid, H)[None, :]
                sc += bias
                if PRUNE:
                    sc = tl.where(bias >= delta2, sc, float("-inf"))
            if (s < full) | (s >= p0):  # the window edge, a sequence start or the diagonal crosses the tile
                sc = tl.where(visible(pq[:, None], pk[None, :], Lk, window, HAS_WINDOW), sc, float("-inf"))
            if HAS_KEY_MASK:
                sc = tl.where(present(KM + krow, c[None, :], kvalid[None, :]), sc, float("-inf"))
            m_new = tl.maximum(m, row_max(sc, 1))
            alpha = exp2(m - m_new)
            p = exp2(sc - m_new[:, None])
            l = l * alpha + total(p, 1)
            acc = acc * alpha[:, None] + dot(p, v, DT)
            m = m_new
        l = tl.where(l > 0, l, 1.0)  # rows past the sequence end (not stored)
        o = acc / l[:, None]
        tl.store(O + qrow * (H * DV) + h * DV + r[:, None] * (H * DV) + dv[None, :],
                 rounded(o, O.dtype.element_ty), mask=qvalid[:, None])
        tl.store(LSE + qrow * H + h + r * H, m + tl.log2(l), mask=qvalid)


@triton.jit
def dq_kernel(Q, K, V, C, KM, O, DO, LSE, DELTA, DQ, BOUND, cu_seqlens, scale, log_tol, window, N, T, H,
              G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              IS_VARLEN: tl.constexpr, HAS_FORGET: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_KEY_MASK: tl.constexpr, PRUNE: tl.constexpr):
    """-> dq: [tokens, H, D] and the corrected delta: [tokens, H] fp32 (the forward's tiles, masks and skips).
    Grid (query blocks, N * H)."""
    h, row0, _, Lk, p0, active = sequence_rows(tl.program_id(0), tl.program_id(1), cu_seqlens, N, T, T, H, BM,
                                               IS_VARLEN)
    if active:
        kvh = h // G
        Hkv = H // G
        DT = Q.dtype.element_ty
        r = tl.arange(0, BM)
        c = tl.arange(0, BN)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        pq = p0 + r
        valid = pq < Lk
        qrow = row0 + p0
        q = tile(Q + qrow * (H * D) + h * D, r, valid, H * D, d)
        do = tile(DO + qrow * (H * DV) + h * DV, r, valid, H * DV, dv)
        o = tile(O + qrow * (H * DV) + h * DV, r, valid, H * DV, dv)
        delta = total(do.to(tl.float32) * o.to(tl.float32), 1)
        lse = tl.load(LSE + qrow * H + h + r * H, mask=valid, other=float("inf"))  # P = 0 past the end
        qk_scale = scale * LOG2E
        if HAS_FORGET:
            c_key = C + row0 * H + h
            cq = forget2(c_key + p0 * H, r, valid, H)
        lo, full, hi = key_tiles(p0, Lk, window, BM, BN, HAS_WINDOW)
        if PRUNE:
            delta2 = prune_delta2(BOUND, log_tol, h, Lk, window, HAS_WINDOW)
            lo = first_kept_tile(c_key, H, tl.load(c_key + p0 * H) * LOG2E, lo, p0, delta2, BN)
        dq = tl.zeros([BM, D], tl.float32)
        drift = tl.zeros([BM], tl.float32)  # row sums of dS: the exact delta minus the rounded one
        for s in range(lo, hi, BN):
            pk = s + c
            kvalid = (pk >= 0) & (pk < Lk)
            krow = row0 + s
            k = tile(K + krow * (Hkv * D) + kvh * D, c, kvalid, Hkv * D, d)
            vT = tile_t(V + krow * (Hkv * DV) + kvh * DV, c, kvalid, Hkv * DV, dv)
            sc = dot(q, tl.trans(k), DT) * qk_scale
            if HAS_FORGET:
                bias = cq[:, None] - forget2(c_key + s * H, c, kvalid, H)[None, :]
                sc += bias
                if PRUNE:
                    sc = tl.where(bias >= delta2, sc, float("-inf"))
            if (s < full) | (s >= p0):
                sc = tl.where(visible(pq[:, None], pk[None, :], Lk, window, HAS_WINDOW), sc, float("-inf"))
            if HAS_KEY_MASK:
                sc = tl.where(present(KM + krow, c[None, :], kvalid[None, :]), sc, float("-inf"))
            p = exp2(sc - lse[:, None])
            ds = p * (dot(do, vT, DT) - delta[:, None])
            dq += dot(ds, k, DT)
            drift += total(ds, 1)
        tl.store(DQ + qrow * (H * D) + h * D + r[:, None] * (H * D) + d[None, :],
                 rounded(dq * scale, DQ.dtype.element_ty), mask=valid[:, None])
        tl.store(DELTA + qrow * H + h + r * H, delta + drift, mask=valid)


@triton.jit
def dkdv_kernel(Q, K, V, C, KM, DO, LSE, DELTA, DK, DVAL, DC, BOUND, cu_seqlens, scale, log_tol, window, N, T, H,
                G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                IS_VARLEN: tl.constexpr, HAS_FORGET: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_KEY_MASK: tl.constexpr, PRUNE: tl.constexpr):
    """-> dk: [tokens, H / G, D], dv: [tokens, H / G, DV], dc: [tokens, H] fp32 (minus the column sums of dS).
    Grid (key blocks of BN, N * H / G); BN a multiple of BM. The queries of key block [s0, s0 + BN) are
    [s0, s0 + BN) (masked: the diagonal), then up to ``full`` unmasked, then masked to the window's end."""
    Hkv = H // G
    kvh, row0, _, Lk, s0, active = sequence_rows(tl.program_id(0), tl.program_id(1), cu_seqlens, N, T, T, Hkv, BN,
                                                 IS_VARLEN)
    if active:
        DT = Q.dtype.element_ty
        c = tl.arange(0, BN)
        r = tl.arange(0, BM)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        pk = s0 + c
        kvalid = pk < Lk
        krow = row0 + s0
        k = tile(K + krow * (Hkv * D) + kvh * D, c, kvalid, Hkv * D, d)
        v = tile(V + krow * (Hkv * DV) + kvh * DV, c, kvalid, Hkv * DV, dv)
        qk_scale = scale * LOG2E
        if HAS_WINDOW:
            full = tl.minimum(s0 + window, Lk)  # queries before it see every key of the block
            hi = tl.minimum(s0 + BN - 1 + window, Lk)
        else:
            full = Lk
            hi = Lk
        dk = tl.zeros([BN, D], tl.float32)
        dval = tl.zeros([BN, DV], tl.float32)
        for g in range(G):
            h = kvh * G + g
            stop = hi
            if HAS_FORGET:
                c_key = C + row0 * H + h
                ck = forget2(c_key + s0 * H, c, kvalid, H)
                if PRUNE:
                    delta2 = prune_delta2(BOUND, log_tol, h, Lk, window, HAS_WINDOW)
                    c_last = tl.load(c_key + (tl.minimum(s0 + BN, Lk) - 1) * H) * LOG2E
                    stop = first_pruned_tile(c_key, H, c_last, s0, hi, delta2, BM)
            dc = tl.zeros([BN], tl.float32)
            for t in range(s0, stop, BM):
                pq = t + r
                valid = pq < Lk
                qrow = row0 + t
                qT = tile_t(Q + qrow * (H * D) + h * D, r, valid, H * D, d)
                doT = tile_t(DO + qrow * (H * DV) + h * DV, r, valid, H * DV, dv)
                lse = tl.load(LSE + qrow * H + h + r * H, mask=valid, other=0.0)
                delta = tl.load(DELTA + qrow * H + h + r * H, mask=valid, other=0.0)
                sT = dot(k, qT, DT) * qk_scale  # [BN keys, BM queries]
                if HAS_FORGET:
                    biasT = forget2(c_key + t * H, r, valid, H)[None, :] - ck[:, None]
                    sT += biasT
                    if PRUNE:
                        sT = tl.where(biasT >= delta2, sT, float("-inf"))
                if (t < s0 + BN) | (t + BM > full):
                    sT = tl.where(visible(pq[None, :], pk[:, None], Lk, window, HAS_WINDOW), sT, float("-inf"))
                if HAS_KEY_MASK:
                    sT = tl.where(present(KM + krow, c[:, None], kvalid[:, None]), sT, float("-inf"))
                pT = exp2(sT - lse[None, :])
                dval += dot(pT, tl.trans(doT), DT)
                dsT = pT * (dot(v, doT, DT) - delta[None, :])
                dk += dot(dsT, tl.trans(qT), DT)
                if HAS_FORGET:
                    dc -= total(dsT, 1)
            if HAS_FORGET:
                tl.store(DC + krow * H + h + c * H, dc, mask=kvalid)
        tl.store(DK + krow * (Hkv * D) + kvh * D + c[:, None] * (Hkv * D) + d[None, :],
                 rounded(dk * scale, DK.dtype.element_ty), mask=kvalid[:, None])
        tl.store(DVAL + krow * (Hkv * DV) + kvh * DV + c[:, None] * (Hkv * DV) + dv[None, :],
                 rounded(dval, DVAL.dtype.element_ty), mask=kvalid[:, None])

