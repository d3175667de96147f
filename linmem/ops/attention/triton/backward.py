"""The flash backward of forgetting attention: two kernels, each a plain loop over tiles.

With ``P = softmax(S)`` recomputed from the saved log-sum-exp, ``dP = dO V^T`` and
``delta_i = sum_j P_ij dP_ij = do_i . o_i``::

    dS = P * (dP - delta)      dQ = scale dS K      dK = scale dS^T Q      dV = P^T dO

The forget bias enters S as ``c_i - c_j``, so ``dc_i = sum_j dS_ij - sum_i' dS_i'i``: the row sum
of dS (query side) minus its column sum (key side); ``d log_forget`` is the reverse cumulative sum
of dc per sequence (autograd of the cumulative sum, outside the kernels).

With the exact delta every row sum of dS is zero (a softmax row sums to one). But delta taken
from the output rounded to bf16 is off by ``(o - o_rounded) . do``, and the reverse cumulative sum
would pile that error up over the sequence. So ``dq_kernel``, which walks each query row's tiles,
adds the row sum of its dS to delta (``delta + sum_j P_ij (dP_ij - delta) = sum_j P_ij dP_ij`` in
fp32) and hands that corrected delta to ``dkdv_kernel``, whose dS rows then sum to zero: dc is
minus its column sums. (dq itself keeps the rounded delta, as flash attention's backward does.)

``dq_kernel`` runs one program per query block and head; ``dkdv_kernel`` one per key block and
KV head, looping over the query heads of its group, so dk and dv are summed over the group
without atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.common import LOG2E, exp2, rounded, total
from .common import (
    dot,
    first_kept_tile,
    first_pruned_tile,
    forget2,
    key_tiles,
    present,
    prune_delta2,
    sequence_rows,
    tile,
    tile_t,
    visible,
)


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
