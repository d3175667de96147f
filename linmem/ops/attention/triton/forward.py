"""The flash forward of forgetting attention: one program per block of BM queries of one head.

Per key tile of BN keys (in SRAM) the program forms ``s = log2(e) (scale q k^T + c_i - c_j)``
in fp32, masks what the queries do not see, and folds the tile into the online softmax
``m = max(m, max_j s)``, ``l = 2^(m_old - m) l + sum_j 2^(s - m)``, ``acc = 2^(m_old - m) acc + P V``.
It stores ``o = acc / l`` and the log-sum-exp ``m + log2 l`` (log2 units) for the backward.
Memory is O(T): nothing of size T x T exists.

Tiles wholly before the window or (with pruning) below the threshold are never visited;
only the tiles that cross the diagonal, the window edge or a sequence start are masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.common import LOG2E, exp2, rounded, total
from .common import (
    NO_MAX,
    dot,
    first_kept_tile,
    forget2,
    key_tiles,
    present,
    prune_delta2,
    row_max,
    sequence_rows,
    tile,
    tile_t,
    visible,
)


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
