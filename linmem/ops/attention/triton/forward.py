"""The flash forward of forgetting attention: one program per block of BM queries of one head.

Per key tile of BN keys (in SRAM) the program forms ``s = log2(e) (scale q k^T + c_i - c_j)``
in fp32 and folds the tile into the online softmax ``m = max(m, max_j s)``,
``l = 2^(m_old - m) l + sum_j 2^(s - m)``, ``acc = 2^(m_old - m) acc + P V``. It stores
``o = acc / l`` and the log-sum-exp ``m + log2 l`` (log2 units) for the backward. Memory is O(T):
nothing of size T x T exists.

The key tiles come in two loops without a branch inside (so each is software-pipelined as
one straight body): the tiles that every query of the block sees whole (no mask, no bounds, the
bias split at the block's first query, :mod:`.common`), then the few that the window edge, a
sequence start, pruning or the diagonal cross (masked, the bias formed per pair). Tiles wholly
before the window or (with pruning) below the threshold are never visited.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.numerics import LOG2E, exp2, rounded, total
from .common import (
    NO_MAX,
    dot,
    first_key_tile,
    head_offsets,
    key_c,
    whole_key_c,
    key_tiles,
    last_first,
    prune_delta,
    row_max,
    sequence_rows,
    split_bias,
    tile,
    tile_mask,
    tile_t,
    visible,
    whole_tile,
    whole_tile_t,
)


@triton.jit
def softmax_step(sc, shift, m, l, acc, v, DT: tl.constexpr):
    """Fold one tile into the online softmax: the tile's scores are ``sc + shift[:, None]`` ([BM, BN] and [BM],
    log2 units), v its values [BN, DV]. Returns the new (m, l, acc)."""
    m_new = tl.maximum(m, row_max(sc, 1) + shift)
    alpha = exp2(m - m_new)
    p = exp2(sc - (m_new - shift)[:, None])
    l = l * alpha + total(p, 1)
    acc = acc * alpha[:, None] + dot(p, v, DT)
    return m_new, l, acc


@triton.jit
def forward_kernel(Q, K, V, C, KM, O, LSE, BOUND, cu_seqlens, scale, log_tol, window, N, Tq, Tk, H,
                   G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_FORGET: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, PRUNE: tl.constexpr):
    """q: [tokens, H, D], k: [tokens, H / G, D], v: [tokens, H / G, DV], c: [B, H, Tk] fp32, key mask:
    [B, Tk] uint8 -> o: [tokens, H, DV], lse: [B, H, Tq] fp32. Grid (N * H, query blocks), the last block
    first. BD, BDV: the tiles' widths, D and DV rounded up to powers of two (the padded columns masked)."""
    n, h, qrow0, krow0, Lk, p0, active = sequence_rows(last_first(1), tl.program_id(0), cu_seqlens, N, Tq, Tk, H,
                                                       BM, IS_VARLEN)
    if active:
        cseq, lseq = head_offsets(n, qrow0, krow0, Tq, Tk, H, IS_VARLEN)
        kvh = h // G
        Hkv = H // G
        DT = Q.dtype.element_ty
        r = tl.arange(0, BM)
        c = tl.arange(0, BN)
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        pq = p0 + r
        qvalid = pq < Lk
        q = tile(Q + (qrow0 + p0) * (H * D) + h * D, r, qvalid, H * D, d, D)
        K_h = K + kvh * D  # the head's keys (row r at K_h + r Hkv D)
        V_h = V + kvh * DV
        c_row = C  # the head's c at key position 0
        if HAS_FORGET:
            c_row = C + cseq + h * Tk
        KM_row = KM  # the sequence's key mask at position 0
        if HAS_KEY_MASK:
            KM_row = KM + krow0
        qk_scale = scale * LOG2E
        no_shift = tl.zeros([BM], tl.float32)
        shift = no_shift  # the queries' part of the bias split at the reference (row constants)
        ref = 0.0
        ref2 = 0.0
        if HAS_FORGET:
            cq = tl.load(c_row + pq, mask=qvalid, other=0.0)
            ref = tl.load(c_row + p0)
            ref2 = ref * LOG2E
            shift = split_bias(cq, ref2)
        lo, full, hi = key_tiles(p0, Lk, window, BM, BN, HAS_WINDOW)
        if PRUNE:
            delta = prune_delta(BOUND, log_tol, h, Lk, window, HAS_WINDOW)
            lo = first_key_tile(c_row, ref, lo, p0, delta, BN - 1, BN)
            c_last = tl.load(c_row + tl.minimum(p0 + BM, Lk) - 1)
            full = tl.maximum(full, first_key_tile(c_row, c_last, lo, p0, delta, 0, BN))
        m = tl.full([BM], NO_MAX, tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BDV], tl.float32)
        for s in range(full, p0, BN):  # seen whole by every query of the block
            kT = whole_tile_t(K_h + (krow0 + s) * (Hkv * D), c, Hkv * D, d, D)
            v = whole_tile(V_h + (krow0 + s) * (Hkv * DV), c, Hkv * DV, dv, DV)
            sc = dot(q, kT, DT) * qk_scale
            if HAS_FORGET or HAS_KEY_MASK:
                sc -= whole_key_c(c_row, KM_row, s + c, ref2, HAS_FORGET, HAS_KEY_MASK)[None, :]
            m, l, acc = softmax_step(sc, shift, m, l, acc, v, DT)
        edge = (full - lo) // BN  # masked: the tiles before `full`, then the diagonal from p0
        for i in range(0, edge + (hi - p0 + BN - 1) // BN):
            s = tl.where(i < edge, lo + i * BN, p0 + (i - edge) * BN)
            pk = s + c
            kvalid = (pk >= 0) & (pk < Lk)
            kT = tile_t(K_h + (krow0 + s) * (Hkv * D), c, kvalid, Hkv * D, d, D)
            v = tile(V_h + (krow0 + s) * (Hkv * DV), c, kvalid, Hkv * DV, dv, DV)
            ck = key_c(c_row, KM_row, pk, kvalid, HAS_FORGET, HAS_KEY_MASK)  # +inf where no key
            sc = dot(q, kT, DT) * qk_scale
            ok = visible(pq[:, None], pk[None, :], window, HAS_WINDOW)
            if HAS_FORGET:
                bias = cq[:, None] - ck[None, :]
                sc += bias * LOG2E
                if PRUNE:
                    ok = ok & (bias >= delta)
            else:
                sc -= ck[None, :]
            sc = tl.where(ok, sc, float("-inf"))
            m, l, acc = softmax_step(sc, no_shift, m, l, acc, v, DT)
        l = tl.where(l > 0, l, 1.0)  # rows that see no key (a key mask), or past the sequence end (not stored)
        o = acc / l[:, None]
        tl.store(O + (qrow0 + p0) * (H * DV) + h * DV + r[:, None] * (H * DV) + dv[None, :],
                 rounded(o, O.dtype.element_ty), mask=tile_mask(qvalid, dv, DV))
        tl.store(LSE + lseq + h * Tq + pq, m + tl.log2(l), mask=qvalid)
