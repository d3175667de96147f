"""Decoding: a few new queries against a KV cache with its cumulative forget values (flash-decoding).

One program reads one split of the cache's keys for one (batch row, KV head) and serves all
``G * Tq`` queries of that KV head at once (the G query heads of the group, the Tq newest
tokens), so the cache is read once per step. A long cache is cut into ``S`` splits that run
in parallel; each stores its partial softmax (running max m, sum l, unnormalised output acc,
log2 units) and ``combine_kernel`` merges them::

    M = max_s m_s        o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s

With one split the program writes the output itself. Nothing of the cache's size is
materialised: the mask (causal among the new tokens, window, key mask) is formed per tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.numerics import LOG2E, exp2, rounded, total
from .common import NO_MAX, cols_mask, dot, row_max, tile_mask

#: the most splits (the combine kernel's block)
MAX_SPLITS = 64


@triton.jit
def decode_kernel(Q, K, V, C, KM, O, PM, PL, PACC, scale, window, chunk, Tq, Tk, H,
                  G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                  BR: tl.constexpr, BN: tl.constexpr, HAS_FORGET: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_KEY_MASK: tl.constexpr, SPLIT: tl.constexpr):
    """q: [B, Tq, H, D], k: [B, Tk, H / G, D], v: [B, Tk, H / G, DV], c: [B, Tk, H] fp32, key mask:
    [B, Tk] uint8 -> o: [B, Tq, H, DV], or with SPLIT the partials m, l: [S, B * H / G, BR] and
    acc: [S, B * H / G, BR, DV] fp32. Grid (S, B * H / G); split i reads keys [first + i chunk, + chunk).
    Row r of a program is query token r % Tq of head (kv head) G + r // Tq. BD, BDV: the tiles' widths, D and DV
    rounded up to powers of two (the padded columns masked)."""
    split, bk = tl.program_id(0), tl.program_id(1)
    Hkv = H // G
    b = bk // Hkv
    kvh = bk % Hkv
    DT = Q.dtype.element_ty
    r = tl.arange(0, BR)
    c = tl.arange(0, BN)
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    rvalid = r < G * Tq
    t = r % Tq
    h = kvh * G + r // Tq
    pq = Tk - Tq + t  # key position of each query
    qrow0 = b.to(tl.int64) * Tq
    krow0 = b.to(tl.int64) * Tk
    q = tl.load(Q + qrow0 * (H * D) + (t * H + h)[:, None] * D + d[None, :], mask=tile_mask(rvalid, d, D), other=0.0)
    if HAS_FORGET:
        cq = tl.load(C + krow0 * H + pq * H + h, mask=rvalid, other=0.0)
    lo = split * chunk
    if HAS_WINDOW:
        lo += tl.maximum(Tk - Tq - window + 1, 0)  # the oldest key any query sees
    hi = tl.minimum(lo + chunk, Tk)
    qk_scale = scale * LOG2E
    m = tl.full([BR], NO_MAX, tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, BDV], tl.float32)
    for s in range(lo, hi, BN):
        pk = s + c
        kvalid = pk < hi
        krow = krow0 + s
        kT = tl.load(K + krow * (Hkv * D) + kvh * D + c[None, :] * (Hkv * D) + d[:, None],
                     mask=tile_mask(kvalid, d, D, True), other=0.0)
        v = tl.load(V + krow * (Hkv * DV) + kvh * DV + c[:, None] * (Hkv * DV) + dv[None, :],
                    mask=tile_mask(kvalid, dv, DV), other=0.0)
        sc = dot(q, kT, DT) * qk_scale
        if HAS_FORGET:
            ck = tl.load(C + krow * H + c[None, :] * H + h[:, None], mask=kvalid[None, :] & rvalid[:, None],
                         other=0.0)
            sc += (cq[:, None] - ck) * LOG2E  # the difference first: |c| grows with the cache, the bias does not
        ok = kvalid[None, :] & (pk[None, :] <= pq[:, None])
        if HAS_WINDOW:
            ok = ok & (pk[None, :] > pq[:, None] - window)
        if HAS_KEY_MASK:
            km = tl.load(KM + krow + c, mask=kvalid, other=0)
            ok = ok & (km[None, :] != 0)
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m, row_max(sc, 1))
        alpha = exp2(m - m_new)
        p = exp2(sc - m_new[:, None])
        l = l * alpha + total(p, 1)
        acc = acc * alpha[:, None] + dot(p, v, DT)
        m = m_new
    if SPLIT:
        part = (split * tl.num_programs(1) + bk).to(tl.int64) * BR
        tl.store(PM + part + r, m)
        tl.store(PL + part + r, l)
        tl.store(PACC + part * DV + r[:, None] * DV + dv[None, :], acc, mask=cols_mask(dv, DV))
    else:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(O + qrow0 * (H * DV) + (t * H + h)[:, None] * DV + dv[None, :], rounded(o, O.dtype.element_ty),
                 mask=tile_mask(rvalid, dv, DV))


@triton.jit
def combine_kernel(PM, PL, PACC, O, splits, Tq, H, G: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                   BR: tl.constexpr, BS: tl.constexpr):
    """Merge the partials of ``decode_kernel``: grid (B * H / G, G * Tq), one program per query row."""
    bk, r = tl.program_id(0), tl.program_id(1)
    Hkv = H // G
    i = tl.arange(0, BS)
    dv = tl.arange(0, BDV)
    ok = i < splits
    part = (i * tl.num_programs(0) + bk).to(tl.int64) * BR + r
    m = tl.load(PM + part, mask=ok, other=NO_MAX)
    w = exp2(m - row_max(m, 0))
    w = tl.where(ok, w, 0.0)
    l = total(w * tl.load(PL + part, mask=ok, other=0.0), 0)
    acc = total(w[:, None] * tl.load(PACC + part[:, None] * DV + dv[None, :], mask=tile_mask(ok, dv, DV), other=0.0),
                0)
    b = bk // Hkv
    h = (bk % Hkv) * G + r // Tq
    row = (b.to(tl.int64) * Tq + r % Tq) * H + h
    tl.store(O + row * DV + dv, rounded(acc / tl.where(l > 0, l, 1.0), O.dtype.element_ty), mask=cols_mask(dv, DV))
