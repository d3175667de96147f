"""The flash backward of forgetting attention: two kernels, each two plain loops over tiles.

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

``dq_kernel`` runs one program per query block and head, the forward's tiles in the forward's two
loops (whole tiles, then masked ones; the bias split at the block's first query). ``dkdv_kernel``
runs one per key block and KV head, looping over the query heads of its group, so dk and dv are
summed over the group without atomics; its query tiles are the diagonal (masked), the tiles that see
every key of the block whole (no mask), then the masked ones at the window's end or pruning's edge.
A whole query tile splits the bias at its first query t (:mod:`.common`), so its queries' part less
their log-sum-exp, ``u_i = fma(c_i, log2(e), -c_t log2(e)) - lse_i``, depends on the query alone:
``dq_kernel`` stores it once, and per tile ``dkdv_kernel`` loads u and delta and forms
``P^T = 2^(scale log2(e) k q^T - fma(c_j, log2(e), -c_t log2(e)) + u)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.numerics import LOG2E, exp2, rounded, total
from .common import (
    dot,
    first_key_tile,
    first_query_tile,
    head_offsets,
    key_c,
    key_tiles,
    last_first,
    prune_delta,
    sequence_rows,
    split_bias,
    tile,
    tile_mask,
    tile_t,
    visible,
    whole_key_c,
    whole_tile,
    whole_tile_t,
)


@triton.jit
def dq_step(p, do, vT, k, delta, dq, drift, DT: tl.constexpr, HAS_FORGET: tl.constexpr):
    """One key tile of dq: p [BM, BN] the probabilities, do [BM, BDV], vT [BDV, BN], k [BN, BD]. Returns the new
    (dq, drift): dq += dS K, drift += the row sums of dS."""
    ds = p * (dot(do, vT, DT) - delta[:, None])
    dq += dot(ds, k, DT)
    if HAS_FORGET:
        drift += total(ds, 1)
    return dq, drift


@triton.jit
def dq_kernel(Q, K, V, C, KM, O, DO, LSE, DELTA, U, DQ, BOUND, cu_seqlens, scale, log_tol, window, N, T, H,
              G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, QT: tl.constexpr, IS_VARLEN: tl.constexpr,
              HAS_FORGET: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, PRUNE: tl.constexpr):
    """-> dq: [tokens, H, D], the corrected delta and u (for ``dkdv_kernel``'s query tiles of QT): [B, H, T] fp32
    (the forward's tiles, masks and skips). Grid (N * H, query blocks), the last block first. BD, BDV: the tiles'
    widths, D and DV rounded up to powers of two (the padded columns masked)."""
    n, h, row0, _, Lk, p0, active = sequence_rows(last_first(1), tl.program_id(0), cu_seqlens, N, T, T, H, BM,
                                                  IS_VARLEN)
    if active:
        cseq, lseq = head_offsets(n, row0, row0, T, T, H, IS_VARLEN)
        kvh = h // G
        Hkv = H // G
        DT = Q.dtype.element_ty
        r = tl.arange(0, BM)
        c = tl.arange(0, BN)
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        pq = p0 + r
        valid = pq < Lk
        qrow = row0 + p0
        q = tile(Q + qrow * (H * D) + h * D, r, valid, H * D, d, D)
        do = tile(DO + qrow * (H * DV) + h * DV, r, valid, H * DV, dv, DV)
        o = tile(O + qrow * (H * DV) + h * DV, r, valid, H * DV, dv, DV)
        delta = total(do.to(tl.float32) * o.to(tl.float32), 1)
        lse = tl.load(LSE + lseq + h * T + pq, mask=valid, other=float("inf"))  # P = 0 past the end
        K_h = K + kvh * D  # the head's keys (row r at K_h + r Hkv D)
        V_h = V + kvh * DV
        c_row = C  # the head's c at key position 0
        if HAS_FORGET:
            c_row = C + cseq + h * T
        KM_row = KM  # the sequence's key mask at position 0
        if HAS_KEY_MASK:
            KM_row = KM + row0
        qk_scale = scale * LOG2E
        ref = 0.0
        ref2 = 0.0
        lse_ref = lse  # the log-sum-exp less the queries' part of the bias split at the reference
        if HAS_FORGET:
            cq = tl.load(c_row + pq, mask=valid, other=0.0)
            ref = tl.load(c_row + p0)
            ref2 = ref * LOG2E
            lse_ref = lse - split_bias(cq, ref2)
        lo, full, hi = key_tiles(p0, Lk, window, BM, BN, HAS_WINDOW)
        if PRUNE:
            delta_p = prune_delta(BOUND, log_tol, h, Lk, window, HAS_WINDOW)
            lo = first_key_tile(c_row, ref, lo, p0, delta_p, BN - 1, BN)
            c_last = tl.load(c_row + tl.minimum(p0 + BM, Lk) - 1)
            full = tl.maximum(full, first_key_tile(c_row, c_last, lo, p0, delta_p, 0, BN))
        dq = tl.zeros([BM, BD], tl.float32)
        drift = tl.zeros([BM], tl.float32)  # row sums of dS: the exact delta minus the rounded one
        for s in range(full, p0, BN):  # seen whole by every query of the block
            k = whole_tile(K_h + (row0 + s) * (Hkv * D), c, Hkv * D, d, D)
            vT = whole_tile_t(V_h + (row0 + s) * (Hkv * DV), c, Hkv * DV, dv, DV)
            sc = dot(q, tl.trans(k), DT) * qk_scale
            if HAS_FORGET or HAS_KEY_MASK:
                sc -= whole_key_c(c_row, KM_row, s + c, ref2, HAS_FORGET, HAS_KEY_MASK)[None, :]
            p = exp2(sc - lse_ref[:, None])
            dq, drift = dq_step(p, do, vT, k, delta, dq, drift, DT, HAS_FORGET)
        edge = (full - lo) // BN  # masked: the tiles before `full`, then the diagonal from p0
        for i in range(0, edge + (hi - p0 + BN - 1) // BN):
            s = tl.where(i < edge, lo + i * BN, p0 + (i - edge) * BN)
            pk = s + c
            kvalid = (pk >= 0) & (pk < Lk)
            k = tile(K_h + (row0 + s) * (Hkv * D), c, kvalid, Hkv * D, d, D)
            vT = tile_t(V_h + (row0 + s) * (Hkv * DV), c, kvalid, Hkv * DV, dv, DV)
            ck = key_c(c_row, KM_row, pk, kvalid, HAS_FORGET, HAS_KEY_MASK)
            sc = dot(q, tl.trans(k), DT) * qk_scale
            ok = visible(pq[:, None], pk[None, :], window, HAS_WINDOW)
            if HAS_FORGET:
                bias = cq[:, None] - ck[None, :]
                sc += bias * LOG2E
                if PRUNE:
                    ok = ok & (bias >= delta_p)
            else:
                sc -= ck[None, :]
            p = exp2(tl.where(ok, sc, float("-inf")) - lse[:, None])
            dq, drift = dq_step(p, do, vT, k, delta, dq, drift, DT, HAS_FORGET)
        tl.store(DQ + qrow * (H * D) + h * D + r[:, None] * (H * D) + d[None, :],
                 rounded(dq * scale, DQ.dtype.element_ty), mask=tile_mask(valid, d, D))
        tl.store(DELTA + lseq + h * T + pq, delta + drift, mask=valid)
        if HAS_FORGET:  # the bias split at the first query of dkdv_kernel's query tile (on the grid of QT)
            u = split_bias(cq, tl.load(c_row + (pq // QT) * QT, mask=valid, other=0.0) * LOG2E) - lse
        else:
            u = -lse
        tl.store(U + lseq + h * T + pq, u, mask=valid)


@triton.jit
def dkdv_step(pT, qT, doT, v, delta, dk, dval, dc, DT: tl.constexpr, HAS_FORGET: tl.constexpr,
              WITH_DK: tl.constexpr, WITH_DV: tl.constexpr):
    """One query tile of dk and dv: pT [BN, BM] the probabilities, qT [BD, BM], doT [BDV, BM], v [BN, BDV], delta
    [BM]. Returns the new (dk, dv, dc): with WITH_DV dv += P^T dO; with WITH_DK dk += dS^T Q and dc -= the column
    sums of dS."""
    if WITH_DV:
        dval += dot(pT, tl.trans(doT), DT)
    if WITH_DK:
        dsT = pT * (dot(v, doT, DT) - delta[None, :])
        dk += dot(dsT, tl.trans(qT), DT)
        if HAS_FORGET:
            dc -= total(dsT, 1)
    return dk, dval, dc


@triton.jit
def dkdv_kernel(Q, K, V, C, KM, DO, LSE, DELTA, U, DK, DVAL, DC, BOUND, cu_seqlens, scale, log_tol, window, N, T, H,
                G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_FORGET: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_KEY_MASK: tl.constexpr, PRUNE: tl.constexpr, WITH_DK: tl.constexpr,
                WITH_DV: tl.constexpr):
    """-> dk: [tokens, H / G, D] and dc: [B, H, T] fp32 (minus the column sums of dS) with WITH_DK, dv: [tokens,
    H / G, DV] with WITH_DV (both in one program, or each in its own launch: at wide heads the two [BN, BD]
    accumulators of one program leave too few registers). Grid (N * H / G, key blocks of BN), the first block (the
    most queries) first; BN a multiple of BM. BD, BDV: as in ``dq_kernel``."""
    Hkv = H // G
    n, kvh, row0, _, Lk, s0, active = sequence_rows(tl.program_id(1), tl.program_id(0), cu_seqlens, N, T, T, Hkv,
                                                    BN, IS_VARLEN)
    if active:
        cseq, lseq = head_offsets(n, row0, row0, T, T, H, IS_VARLEN)
        DT = Q.dtype.element_ty
        c = tl.arange(0, BN)
        r = tl.arange(0, BM)
        d = tl.arange(0, BD)
        dv = tl.arange(0, BDV)
        pk = s0 + c
        kvalid = pk < Lk
        krow = row0 + s0
        k = tile(K + krow * (Hkv * D) + kvh * D, c, kvalid, Hkv * D, d, D)
        v = None  # the values enter dS only
        if WITH_DK:
            v = tile(V + krow * (Hkv * DV) + kvh * DV, c, kvalid, Hkv * DV, dv, DV)
        KM_row = KM  # the sequence's key mask at position 0
        if HAS_KEY_MASK:
            KM_row = KM + row0
        qk_scale = scale * LOG2E
        newest = tl.minimum(s0 + BN, Lk) - 1  # the block's newest key
        diag = (newest - s0) // BM + 1  # query tiles on the diagonal (masked)
        # query tiles that see every key of the block whole: from the end of the block (whole blocks only) on
        # the grid s0 + m BM, up to the window's end
        if HAS_WINDOW:
            hi = tl.minimum(s0 + BN - 1 + window, Lk)
            seen = tl.minimum(s0 + window, Lk)
        else:
            hi = Lk
            seen = Lk
        whole_end = s0 + BN + (tl.maximum(seen - s0 - BN, 0) // BM) * BM
        whole_end = tl.where(s0 + BN <= Lk, whole_end, s0 + BN)
        dk = tl.zeros([BN, BD], tl.float32)
        dval = tl.zeros([BN, BDV], tl.float32)
        for g in range(G):
            h = kvh * G + g
            c_row = C
            if HAS_FORGET:
                c_row = C + cseq + h * T
            l_row = LSE + lseq + h * T
            d_row = DELTA + lseq + h * T
            u_row = U + lseq + h * T
            stop = hi
            end = whole_end
            ck = key_c(c_row, KM_row, pk, kvalid, HAS_FORGET, HAS_KEY_MASK)  # +inf where no key
            if PRUNE:
                delta_p = prune_delta(BOUND, log_tol, h, Lk, window, HAS_WINDOW)
                stop = first_query_tile(c_row, tl.load(c_row + newest), s0, hi, Lk, delta_p, 0, BM)
                end = tl.minimum(end, first_query_tile(c_row, tl.load(c_row + s0), s0 + BN, end, Lk, delta_p, BM - 1,
                                                       BM))
            dc = tl.zeros([BN], tl.float32)
            for t in range(s0 + BN, end, BM):  # every key of the block seen whole by every query of the tile
                pq = t + r
                qT = whole_tile_t(Q + (row0 + t) * (H * D) + h * D, r, H * D, d, D)
                doT = whole_tile_t(DO + (row0 + t) * (H * DV) + h * DV, r, H * DV, dv, DV)
                delta = tl.load(d_row + pq)
                sT = dot(k, qT, DT) * qk_scale + tl.load(u_row + pq)[None, :]
                if HAS_FORGET:  # the keys' part of the bias split at the tile's first query
                    sT -= split_bias(ck, tl.load(c_row + t) * LOG2E)[:, None]
                elif HAS_KEY_MASK:
                    sT -= ck[:, None]
                pT = exp2(sT)
                dk, dval, dc = dkdv_step(pT, qT, doT, v, delta, dk, dval, dc, DT, HAS_FORGET, WITH_DK, WITH_DV)
            edge = (tl.maximum(stop - end, 0) + BM - 1) // BM  # masked: the diagonal, then from `end` on
            for i in range(0, diag + edge):
                t = tl.where(i < diag, s0 + i * BM, end + (i - diag) * BM)
                pq = t + r
                valid = pq < Lk
                qT = tile_t(Q + (row0 + t) * (H * D) + h * D, r, valid, H * D, d, D)
                doT = tile_t(DO + (row0 + t) * (H * DV) + h * DV, r, valid, H * DV, dv, DV)
                lse = tl.load(l_row + pq, mask=valid, other=float("inf"))  # P = 0 past the end
                delta = tl.load(d_row + pq, mask=valid, other=0.0)
                sT = dot(k, qT, DT) * qk_scale
                ok = visible(pq[None, :], pk[:, None], window, HAS_WINDOW)
                if HAS_FORGET:
                    biasT = tl.load(c_row + pq, mask=valid, other=0.0)[None, :] - ck[:, None]
                    sT += biasT * LOG2E
                    if PRUNE:
                        ok = ok & (biasT >= delta_p)
                else:
                    sT -= ck[:, None]
                pT = exp2(tl.where(ok, sT, float("-inf")) - lse[None, :])
                dk, dval, dc = dkdv_step(pT, qT, doT, v, delta, dk, dval, dc, DT, HAS_FORGET, WITH_DK, WITH_DV)
            if HAS_FORGET and WITH_DK:
                tl.store(DC + cseq + h * T + pk, dc, mask=kvalid)
        if WITH_DK:
            tl.store(DK + krow * (Hkv * D) + kvh * D + c[:, None] * (Hkv * D) + d[None, :],
                     rounded(dk * scale, DK.dtype.element_ty), mask=tile_mask(kvalid, d, D))
        if WITH_DV:
            tl.store(DVAL + krow * (Hkv * DV) + kvh * DV + c[:, None] * (Hkv * DV) + dv[None, :],
                     rounded(dval, DVAL.dtype.element_ty), mask=tile_mask(kvalid, dv, DV))
