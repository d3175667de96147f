"""Stage 6 of the backward: what loops over key channels, for one chunk each: dq, dk, the gate gradient and the
bonus's gradient.

``dq = scale (e^Gq dO h^T + dA (k e^-G) e^Gq)``, ``dk = e^(Gamma - G) (d dH^T) + dA^T (q e^Gq) e^-G`` (plus the
bonus terms and the delta rule's WY part), and the gate gradient ``dG_t = q_t dq_t - k_t dk_t`` plus the chunk-end
term ``e^Gamma sum_v h dH + sum_t k_t dk_t(end state)``, summed in reverse inside the chunk.

``grads_kernel`` takes what every gradient of a key channel reads, by role: the inputs (q, k, G, the bonus u, the
writes d), what the forward and the earlier stages saved (the chunk-start states hs, the chunk-end state
gradients dHs, the score gradient dA, the bonus's dov, the intra-chunk parts dqi and dki of a per-channel decay),
the cotangent do, the outputs (dq, dk, the gate gradient's parts dg, the bonus's du), and the layout (cu_seqlens,
scale, T, H, N, K, V). A configuration that lacks one of them passes None, a compile-time constant. Its
constexprs are the switches of the rule (DECAY, DELTA, BONUS), of the launch's share of the work (SIDE, KGRID)
and the tile sizes (C, BK, BV, KP, CSPAN). Splitting it further would cost loads that its gradients share: dq, dk
and the gate gradient read the same q, k and dA tiles.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs
from .configs import CHUNK, Shapes, cdiv, key_grid
from .gates import chunk_span
from .launch import launch_kernel
from .layout import load_gate_rows, load_rows, load_state, locate_chunk, store_rows
from .numerics import exp2, masked_exp2, mm, mm_wide, remaining_total, running_total, total
from .switches import BOTH_SIDES, CHANNEL_DECAY, KEY_SIDE, NO_DECAY, QUERY_SIDE, SCALAR_DECAY, Decay, Side


@triton.jit
def grads_kernel(q, k, G, u, d, hs, dHs, do, dA_in, dov_in, dqi, dki, dq, dk, dg, du,
                 cu_seqlens, scale, T, H, N, K, V,
                 DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr,
                 SIDE: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CSPAN: tl.constexpr,
                 KP: tl.constexpr, KGRID: tl.constexpr):
    """The gradients of one chunk per key channel: dq, dk, dg, du.

    Inputs as in the forward plus hs/dHs (chunk-start states / chunk-end state gradients, [slots, H, K, V]), do:
    [tokens, H, V] and what ``score_grads_kernel`` stored: dA_in ([tokens, H, C], read once as [t, s] and once
    transposed) and dov_in ([tokens, H]). Per-channel decays (CHANNEL_DECAY): a chunk whose gates fall by at most
    2^-CSPAN over the chunk (``gates.chunk_span``) takes the intra-chunk parts of dq and dk from two products, its
    decays split at the chunk's start as a scalar decay's (``dA (k e^-G)`` and ``dA^T (q e^Gq)``, the right factor
    at most 2^CSPAN; on a bf16 dA as two bf16 products, ``numerics.mm_wide``, else and for RWKV-6 in tf32); any
    other reads them from dqi and dki (``intra_grads_kernel``). For the delta rule (DELTA), dk and dg already hold
    what the WY stage stored, and get the rest added. Outputs: dq, dk [tokens, H, K] (input dtype); dg [tokens,
    H(, K)] fp32 (reverse cumulative inside the chunk); du: per-chunk bonus gradients [slots, H, K] fp32. Grid
    (slots * KGRID, H).

    The per-channel decays but RWKV-6's take the chunk-end term ``sum_v h dH`` from h and dH tiles loaded for it
    alone, apart from the tiles that feed ``dO h^T`` and ``d dH^T`` (see the WORKAROUND in the V loop).

    KGRID 1: one program per chunk and head loops over the key blocks of BK channels. KGRID = K / BK (rounded up):
    one program per key block (``configs.key_grid``), the blocks of a chunk next to each other on the grid. A scalar
    decay's gate gradient then arrives as KGRID parts, each program storing its block's part in its own [tokens, H]
    slice of dg (the first slice holds the delta rule's WY part, which its block adds); the launcher sums them.

    BOTH_SIDES computes both sides of the chunk. But without a per-channel decay they can run as two launches of
    about half the registers each (they share only their reads of q, k and dA): QUERY_SIDE the query side (dq: dO
    h^T, dA k), KEY_SIDE the key side (dk: d dH^T, dA^T q; du). A scalar decay's gate gradient joins them through
    dg: the query side stores its row sums q dq there (on the delta rule's part), the key side loads them,
    subtracts its own (k dk) and takes the reverse cumulative sum; it also loads the chunk-start states for the
    chunk-end term sum(h dH). The launcher splits the rules without a decay, and the scalar decays with fp32
    inputs.
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    tl.static_assert(SIDE == BOTH_SIDES or DECAY != CHANNEL_DECAY)
    tl.static_assert(DELTA == 0 or BONUS == 0)  # dg holds the query side's sums alone where a bonus needs them
    QS: tl.constexpr = SIDE != KEY_SIDE  # the query side: dq
    KS: tl.constexpr = SIDE != QUERY_SIDE  # the key side: dk, du
    ST: tl.constexpr = hs.dtype.element_ty  # chunk states and their gradients
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    # a scalar decay's fp32 q and k tiles for its row sums, loaded after the V loop rather than held through it (60
    # registers fewer): by its sides, and on the key grid (the fp16 loop is faster loading them first)
    LATE: tl.constexpr = DECAY == SCALAR_DECAY and (SIDE != BOTH_SIDES or KGRID > 1)
    # a scalar decay's sides join through one dg
    tl.static_assert(KGRID == 1 or SIDE == BOTH_SIDES or DECAY != SCALAR_DECAY)
    slot, h = tl.program_id(0) // KGRID, tl.program_id(1)
    kb = tl.program_id(0) % KGRID  # the key block (0 in the loop)
    k_end = K if KGRID == 1 else (kb + 1) * BK
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    if DECAY == SCALAR_DECAY and KGRID > 1:  # this key block's part of the gate gradient
        dg += kb.to(tl.int64) * (T if IS_VARLEN else N * T) * H
    rows = tl.arange(0, C)
    valid = rows < nrows
    Klive = tl.where(nrows > 0, K, 0)  # key columns to read (none in an idle slot)
    last_row = tl.maximum(t0 + nrows - 1, 0)
    if BONUS:
        dov = load_gate_rows(dov_in, t0, nrows, h, H, rows)
    if DECAY == SCALAR_DECAY:
        Gr = load_gate_rows(G, t0, nrows, h, H, rows)
        Gqr = load_gate_rows(G, t0, nrows, h, H, rows - BONUS)
        last = tl.where(nrows > 0, tl.load(G + last_row * H + h), 0.0)
        dGs = tl.full([C], 0.0, tl.float32)  # both sides' channel sums (a side's own in its launch)
        if DELTA and QS:  # the WY part, in the first key block's slice
            dGs += load_gate_rows(dg, t0, tl.where(kb == 0, nrows, 0), h, H, rows)
        if BONUS:
            dGq = tl.full([C], 0.0, tl.float32)
        gam = total(tl.full([C], 0.0, tl.float32), 0)
    if DECAY == CHANNEL_DECAY:
        one_ref = chunk_span(G, t0, nrows, h, H, K, KP) <= CSPAN
    for k0 in range(kb * BK, k_end, BK):
        cols = k0 + tl.arange(0, BK)
        if not LATE:
            qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
            kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
        if DECAY == CHANNEL_DECAY:  # before the V loop, which hides these loads (after it, on its accumulators, the
            # kernel spills three times as much)
            Gk = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
            Gq = load_rows(G, t0, nrows, h, H, K, rows - BONUS, cols, False)
            lastk = tl.load(G + (last_row * H + h) * K + cols, mask=cols < Klive, other=0.0)
            if BONUS:  # RWKV-6 holds the decay factors through the V loop: taken after it (as the others do, two
                # [C, BK] tiles fewer held) its loop spills more
                eq = exp2(Gq)
                ek = masked_exp2(valid[:, None], lastk[None, :] - Gk)
            if one_ref:  # the intra-chunk parts through the chunk's start (dq's e^Gq after the V loop but RWKV-6's)
                rk = masked_exp2(valid[:, None], -Gk)  # in [1, 2^CSPAN]
                if BONUS:  # in tf32 (numerics.mm_wide is slower here)
                    dqt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, False), kt * rk, tl.float32, X) * eq
                    dkt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, True), qt * eq, tl.float32, X) * rk
                else:  # e^Gq taken here apart from the eq after the V loop: one eq for both would keep it live
                    # through the loop (more stack)
                    dqt = mm_wide(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, False), kt * rk, X)
                    dkt = mm_wide(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, True), qt * exp2(Gq), X) * rk
            else:  # from intra_grads_kernel
                dqt = load_rows(dqi, t0, nrows, h, H, K, rows, cols, False)
                dkt = load_rows(dki, t0, nrows, h, H, K, rows, cols, False)
        dqh = tl.full([C, BK], 0.0, tl.float32)  # dO h^T
        dkh = tl.full([C, BK], 0.0, tl.float32)  # d dH^T
        gH = tl.full([BK], 0.0, tl.float32)  # sum_v h dH
        for v0 in range(0, V, BV):
            vr = v0 + tl.arange(0, BV)
            if QS or DECAY != NO_DECAY:
                hT = load_state(hs, slot, h, H, K, V, cols, vr, Klive, True)
            if KS:
                dHT = load_state(dHs, slot, h, H, K, V, cols, vr, Klive, True)
            if QS:
                dqh += mm(load_rows(do, t0, nrows, h, H, V, rows, vr, False), hT, ST, X)
            if KS:
                dkh += mm(load_rows(d, t0, nrows, h, H, V, rows, vr, False), dHT, ST, X)
            # WORKAROUND(triton 3.6, sm_90): tiles feeding both the products and sum h dH compile to a race (2-3 stages)
            if DECAY == CHANNEL_DECAY and not BONUS and KS:  # sum_v h dH from tiles of its own
                hE = load_state(hs, slot, h, H, K, V, cols, vr, Klive, False)
                dHE = load_state(dHs, slot, h, H, K, V, cols, vr, Klive, False)
                gH += total(hE.to(tl.float32) * dHE, 1)
            elif DECAY != NO_DECAY and KS:
                gH += total(hT.to(tl.float32) * dHT, 0)
        if DECAY == SCALAR_DECAY:
            eq = exp2(Gqr)[:, None]
            ek = masked_exp2(valid, last - Gr)[:, None]
        if DECAY == CHANNEL_DECAY and not BONUS:  # the decay factors after the V loop
            eq = exp2(Gq)
            ek = masked_exp2(valid[:, None], lastk[None, :] - Gk)
            if one_ref:
                dqt = dqt * eq
        if DECAY != CHANNEL_DECAY:  # dA carries the decays: dA k and dA^T q
            if QS:
                dqt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, False),
                         load_rows(k, t0, nrows, h, H, K, rows, cols, False), ST, X)
            if KS:
                qc = load_rows(q, t0, nrows, h, H, K, rows, cols, False)
                dkt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, True), qc, ST, X)
            if LATE:
                qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
                kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
        if DECAY == NO_DECAY:
            if QS:
                dqt += scale * dqh
            if KS:
                dkt += dkh
        else:
            if QS:
                dqt += scale * dqh * eq
            if KS:
                kend = dkh * ek
            if DECAY == CHANNEL_DECAY:
                dkt += kend
                gq = qt * dqt
                gk = -kt * dkt
                gam_k = exp2(lastk) * gH + total(kt * kend, 0)
                if DELTA:
                    gk += load_rows(dg, t0, nrows, h, H, K, rows, cols, False)
            else:  # two row sums: q dq - k dk before the chunk-end part, and that part (k kend), which gam sums
                if KS:
                    kendr = total(kt * kend, 1)
                if SIDE == BOTH_SIDES:
                    dGs += total(qt * dqt - kt * dkt, 1) - kendr
                elif SIDE == QUERY_SIDE:
                    dGs += total(qt * dqt, 1)
                else:
                    dGs -= total(kt * dkt, 1) + kendr
                if BONUS and SIDE == BOTH_SIDES:
                    dGq += total(qt * dqt, 1)
                if KS:
                    gam += exp2(last) * total(gH, 0) + total(kendr, 0)
                    dkt += kend
        if DELTA and KS:
            dkt += load_rows(dk, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
        if BONUS:
            uu = tl.load(u + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)
            if QS:
                dqt += scale * dov[:, None] * uu[None, :] * kt
            if KS:
                dkt += scale * dov[:, None] * uu[None, :] * qt
                tl.store(du + (slot.to(tl.int64) * H + h) * K + cols, scale * total(dov[:, None] * qt * kt, 0),
                         mask=cols < K)
        if QS:
            store_rows(dq, dqt, t0, nrows, h, H, K, rows, cols)
        if KS:
            store_rows(dk, dkt, t0, nrows, h, H, K, rows, cols)
        if DECAY == CHANNEL_DECAY:  # one reverse cumulative sum of both sides (the query side's is exclusive with the
            # bonus) as a column sum and a forward scan: one reverse scan (remaining_total) is slower on these [C, BK]
            # tiles, unlike the [C] sums of a scalar decay below
            gs = gk + gq
            rev = total(gs, 0)[None, :] - running_total(gs, 0)
            if BONUS:
                rev += gk
            else:
                rev += gs
            store_rows(dg, rev + gam_k[None, :], t0, nrows, h, H, K, rows, cols)
    if DECAY == SCALAR_DECAY:
        if SIDE == QUERY_SIDE:  # for the key side
            tl.store(dg + (t0 * H + h) + rows * H, dGs, mask=valid)
        else:  # one reverse cumulative sum of both sides' channel sums, as one reverse scan
            if SIDE == KEY_SIDE:  # the query side's (no bonus with the delta rule: without its part)
                dGq = load_gate_rows(dg, t0, nrows, h, H, rows)
                dGs += dGq
            rev = remaining_total(dGs, 0)
            if BONUS:
                rev -= dGq
            tl.store(dg + (t0 * H + h) + rows * H, rev + gam, mask=valid)


def key_blocks(s: Shapes, decay: int, bonus: bool, dtype: torch.dtype) -> tuple[int, int]:
    """(BK, KGRID) of ``grads_kernel``: its key block and its programs per chunk and head (the key blocks on the
    grid, ``configs.key_grid``, or 1: one program loops over them)."""
    on_grid = key_grid(decay, bonus, dtype)
    bk = s.grads_BK(decay, on_grid)
    return bk, (cdiv(s.K, bk) if on_grid else 1)


def gate_grad_parts(s: Shapes, G: torch.Tensor, decay: int, bonus: bool, dtype: torch.dtype) -> torch.Tensor:
    """An empty fp32 [parts, *G.shape] for the gate gradient (G: the cumulative gates, of the log decay's shape): a
    scalar decay's arrives as one part per key block on the grid (their sum is the gradient), a per-channel decay's
    as one. The WY stages write into the first part."""
    kgrid = key_blocks(s, decay, bonus, dtype)[1]
    return torch.empty(kgrid if decay == Decay.SCALAR else 1, *G.shape, device=G.device, dtype=torch.float32)


def key_channel_grads(plan: dict, s: Shapes, *, q: torch.Tensor, k: torch.Tensor, G: Optional[torch.Tensor],
                      u: Optional[torch.Tensor], d: torch.Tensor, hs: torch.Tensor, dHs: torch.Tensor,
                      do: torch.Tensor, dA: torch.Tensor, dov: Optional[torch.Tensor], dqi: Optional[torch.Tensor],
                      dki: Optional[torch.Tensor], dq: torch.Tensor, dk: torch.Tensor, dg: Optional[torch.Tensor],
                      du: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float, decay: Decay,
                      delta: bool, bonus: bool) -> None:
    """dq, dk [B, T, H, K] (the delta rule's dk holds its WY part, which this adds to), dg (the gate gradient's
    parts, :func:`gate_grad_parts`), du [slots, H, K] fp32 (the bonus's, per chunk). q, k: [B, T, H, K]; G:
    [B, T, H(, K)] fp32; u: the bonus [H, K]; d: the writes [B, T, H, V]; hs, dHs: the chunk-start states and the
    chunk-end state gradients [slots, H, K, V]; do: [B, T, H, V]; dA: [B, T, H, C]; dov: the bonus's [B, T, H];
    dqi, dki: the intra-chunk stage's [B, T, H, K] fp32 (per-channel decays)."""
    bk, kgrid = key_blocks(s, decay, bonus, q.dtype)
    args = (q, k, G, u, d, hs, dHs, do, dA, dov, dqi, dki, dq, dk, dg, du, cu_seqlens, scale, s.T, s.H, s.N, s.K, s.V)
    flags = dict(DECAY=decay, DELTA=int(delta), BONUS=int(bonus), C=CHUNK,
                 BK=bk, BV=s.BV, CSPAN=configs.CHUNK_SPAN, KP=s.BKF, KGRID=kgrid)
    grid = (s.slots * kgrid, s.H)
    if decay == Decay.NONE or (decay == Decay.SCALAR and q.dtype == torch.float32):  # query side, then key side
        tag = "_scalar" if decay != Decay.NONE else ""
        launch_kernel(plan, "grads" + tag + "_query", grads_kernel, grid, *args, **flags, SIDE=Side.QUERY)
        launch_kernel(plan, "grads" + tag + "_key", grads_kernel, grid, *args, **flags, SIDE=Side.KEY)
    else:
        on_grid = key_grid(decay, bonus, q.dtype)
        name = ("grads_vector" if on_grid else "grads_vector_loop") if decay == Decay.CHANNEL else (
            "grads_scalar" if on_grid else "grads_pipelined")
        launch_kernel(plan, name, grads_kernel, grid, *args, **flags, SIDE=Side.BOTH)
