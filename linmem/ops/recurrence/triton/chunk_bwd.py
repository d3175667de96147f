"""Backward kernels of the chunked recurrence (the forward is in ``chunk_fwd``).

With ``dH`` the gradient of a chunk's end state, the chunk's gradients are::

    dd    = A_qk^T dO + (k e^(Gamma - G)) dH                 gradient of the writes d
    dH'   = e^Gamma dH + scale (q e^Gq)^T dO  (- W^T dd)     gradient of the chunk-start state
    dq    = scale (e^Gq dO h^T + A-side of dO d^T) (+ bonus)
    dk    = e^(Gamma - G) (d dH^T) + A-side of (dO d^T)^T (+ bonus)
    delta rule, with Y = T^T dd:
          dv = beta Y,   d(beta k e^G) = -Y h^T,   dL = -Y d^T   (L = I + diag(beta) strict(A_kk))

(``dL = -Y d^T`` because U - W h = d, so the U and W parts of the inverse's gradient
combine.) The gate gradient follows from G entering only as exp(+-G) factors:
``dG_t = q_t dq_t - k_t dk_t(e^-G parts) + k_t dk_t(e^+G parts)``, plus the chunk-end term
``e^Gamma sum_v h dH + sum_t k_t dk_t(end state)``; dg is the reverse cumulative sum of dG
inside the chunk (exclusive on the query side with the bonus, whose reads use G_{t-1}).

``state_bwd_kernel`` is the sequential pass (dH of every chunk, the delta rule's dd, the initial
state's gradient); then, chunk by chunk in parallel, the additive rule's ``dv_kernel`` computes its
dd (= dv) from the stored dH, ``score_grads_kernel`` what loops over
value channels (the score gradients dA and dL, the delta rule's Y = T^T dd and dv) and stores
it; the delta rule's ``wy_grads_kernel`` takes the key gradients through W and L (for bf16 inputs
without a per-channel decay, at the end of ``score_grads_kernel``), and
``grads_kernel`` every other gradient per key channel, each reading its score gradient once as
stored and once transposed. Transposed products are computed as products of transposed loads,
never by transposing a product (a Hopper miscompilation in the Triton 3.4-3.7.0 range hits
that pattern); the operands the backward needs transposed (the delta rule's T, fp32, and W, in
the states' dtype) are stored transposed by the forward instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (FAST_BLOCK, bf16_parts, block_span, bonus_scores, chunk_span, end_decay, end_gates, exp2,
                     first_state_tiles, intra_cols, intra_rows, largest, load_gate_rows, load_rows, load_state,
                     locate_chunk, masked_exp2, mm, mm_parts, mm_wide, remaining_total, running_total, scalar_gates,
                     sequence_state, store_rows, store_state_tiles, total)


@triton.jit
def _writes_grad_part(k, dS, t0, nrows, h, H, K, rows, kb, SD: tl.constexpr, X: tl.constexpr):
    """(k e^(Gamma - G))[:, kb] dS: the part of the delta rule's dd that key rows kb carry, [C, BV] fp32.
    A scalar decay's e^(Gamma - G) is left out: the caller puts it on the rows of the parts' sum; a
    per-channel decay's k arrives with it (kg of ``delta_prep_kernel``)."""
    return mm(load_rows(k, t0, nrows, h, H, K, rows, kb, False), dS, SD, X)


@triton.jit
def _writes_grad_parts(dd, k, dS0, dS1, dS2, dS3, t0, nrows, h, H, K, rows, kb0, NKB: tl.constexpr,
                       SD: tl.constexpr, X: tl.constexpr):
    """dd plus :func:`_writes_grad_part` of each of the NKB state tiles (of len(kb0) key rows each)."""
    KB: tl.constexpr = kb0.shape[0]
    dd += _writes_grad_part(k, dS0, t0, nrows, h, H, K, rows, kb0, SD, X)
    if NKB > 1:
        dd += _writes_grad_part(k, dS1, t0, nrows, h, H, K, rows, kb0 + KB, SD, X)
    if NKB > 2:
        dd += _writes_grad_part(k, dS2, t0, nrows, h, H, K, rows, kb0 + 2 * KB, SD, X)
        dd += _writes_grad_part(k, dS3, t0, nrows, h, H, K, rows, kb0 + 3 * KB, SD, X)
    return dd


@triton.jit
def _state_grad_step(dS, q, Wt, G, dO, dd, eg, slot, t0, nrows, h, H, K, rows, kb, scale,
                     DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr, C: tl.constexpr,
                     X: tl.constexpr, GATES_AHEAD: tl.constexpr):
    """Key rows kb of the gradient of the chunk's start state: e^Gamma dS + scale (q e^Gq)^T dO (- W^T dd).
    With a scalar decay the delta rule's dO arrives as e^Gq dO (the decay on its rows), with eg = e^Gamma;
    with a per-channel decay the delta rule's q arrives decayed (qg of ``output_kernel``), and with GATES_AHEAD
    its chunk-end gates as eg (log2 units, [KB])."""
    qT = load_rows(q, t0, nrows, h, H, K, rows, kb, True)
    if DECAY == 1:
        if not DELTA:  # on q^T: on the additive rule's bf16 dO rows it broke the bf16 bound of dlog_decay
            qT = qT * exp2(load_gate_rows(G, t0, nrows, h, H, rows - BONUS))[None, :]
            eg = exp2(end_decay(G, t0, nrows, h, H, K, kb, DECAY))
        dS = dS * eg
    elif DECAY == 2:
        if not DELTA:
            qT = qT * exp2(load_rows(G, t0, nrows, h, H, K, rows - BONUS, kb, True))
        if GATES_AHEAD:
            dS = dS * exp2(eg)[:, None]
        else:
            dS = dS * exp2(end_decay(G, t0, nrows, h, H, K, kb, DECAY))[:, None]
    dS += scale * mm(qT, dO, q.dtype.element_ty, X)
    if DELTA:
        dS -= mm(load_state(Wt, slot, h, H, K, C, kb, rows, K, False), dd, Wt.dtype.element_ty, X)
    return dS


@triton.jit
def state_bwd_kernel(q, k, Wt, G, A, do, dd_out, dHs, dhN, dh0, cu_seqlens, scale, T, H, N, K, V,
                     DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr, IS_VARLEN: tl.constexpr,
                     HAS_DFINAL: tl.constexpr, STORE_DINIT: tl.constexpr,
                     C: tl.constexpr, BKF: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr):
    """The reverse sequential pass: the gradients of the chunk-end states (and of the delta rule's writes).

    Per chunk, last to first: dHs[slot] = dH; dH = e^Gamma dH + scale (q e^Gq)^T dO. The delta rule's
    dH also takes - W^T dd, with dd = A^T dO + (k e^(Gamma-G)) dH (stored to dd_out, in d's dtype). The
    additive rule's dd, its dv, is off this path: ``dv_kernel`` computes it chunk by chunk in parallel
    (k, A and dd_out are then unused). With a per-channel decay the delta rule's q and k arrive decayed
    (q e^G and k e^(Gamma - G): qg of ``output_kernel``, kg of ``delta_prep_kernel``), and this pass loads
    only the chunk-end gates. A: [tokens, H, C] (scaled scores of the forward); Wt: [slots, H,
    K, C] (the delta rule's W, transposed per chunk); dHs: [slots, H, K, V]; dhN, dh0: [N, H, K, V]
    fp32. Grid (V blocks, N * H).
    The state is held as BKF // KB tiles (1, 2 or 4) of KB key rows, each with its own loads: at
    K = 128 the delta rule's pass then needs fewer registers than with one [K, BV] tile.
    A scalar decay (gated delta rule) enters the delta rule's pass on [C, BV] rows, off the chain of
    dependent products: e^(Gamma - G) on the rows of the sum of the key tiles' products, e^Gq on dO's
    rows for the q^T product; its gates are loaded a chunk ahead. Measured on an H200 (H = 16, K = V =
    128, bf16), kernel ms against the decay on the k and q tiles: 1 x 16384 0.524 -> 0.370, 8 x 2048
    0.247 -> 0.236 (at 3 stages; 0.281 at 2). Either change alone gained little at 1 x 16384 (0.493 on
    the rows, 0.530 loaded ahead). The additive rule keeps its decay on the q tiles (see
    ``_state_grad_step``), and both rules' gates loaded ahead lost there (Mamba-2 0.189 -> 0.207).
    The per-channel delta rule (KDA) loads its chunk-end gates a chunk ahead too (``common.end_gates``, one [KB]
    vector per state tile), except for fp32 inputs: at 4 x 4096 0.249 -> 0.217 ms, at 1 x 16384 0.422 -> 0.369, fp16
    (2 x 4096) 0.134 -> 0.124; fp32 inputs, whose pass spills, lost (0.639 -> 0.710) and load them in place (H200,
    session 33). The forward pass's did not gain: state_fwd 0.198 -> 0.243 ms at 4 x 4096.
    """
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    SD: tl.constexpr = dHs.dtype.element_ty
    NKB: tl.constexpr = BKF // KB
    GATES_AHEAD: tl.constexpr = DECAY == 2 and DELTA and not X  # KDA's chunk-end gates loaded a chunk ahead
    n, h, bos, eos, s0, kb0, vr, rows = sequence_state(cu_seqlens, T, H, C, IS_VARLEN, KB, BV)
    kb1, kb2, kb3 = kb0 + KB, kb0 + 2 * KB, kb0 + 3 * KB
    dS0, dS1, dS2, dS3 = first_state_tiles(dhN, HAS_DFINAL, n, h, H, K, V, kb0, vr, NKB)
    nchunks = (eos - bos + C - 1) // C
    if DECAY == 1 and DELTA:  # the gates of the first chunk this pass takes (the last; no bonus with the delta rule)
        tn = bos + (nchunks - 1) * C
        Gn, lastn = scalar_gates(G, tn, tl.where(nchunks > 0, eos - tn, 0), h, H, rows)
    if GATES_AHEAD:  # likewise a per-channel decay's chunk-end gates, one [KB] per state tile
        tn = bos + (nchunks - 1) * C
        gn0, gn1, gn2, gn3 = end_gates(G, tn, tl.where(nchunks > 0, eos - tn, 0), h, H, K, kb0, NKB)
    for i in range(nchunks):
        slot = s0 + nchunks - 1 - i
        t0 = bos + (nchunks - 1 - i) * C
        nrows = tl.minimum(eos - t0, C)
        eg = nrows  # the delta rule's e^Gamma for a scalar decay (unused otherwise)
        if DECAY == 1 and DELTA:  # this chunk's gates, loaded by the step before; load the next chunk's
            ek = masked_exp2(rows < nrows, lastn - Gn)
            eq = exp2(Gn)
            eg = exp2(lastn)
            Gn, lastn = scalar_gates(G, t0 - C, tl.where(t0 > bos, C, 0), h, H, rows)
        eg0, eg1, eg2, eg3 = eg, eg, eg, eg  # per state tile: a per-channel decay's chunk-end gates instead
        if GATES_AHEAD:
            eg0, eg1, eg2, eg3 = gn0, gn1, gn2, gn3
            gn0, gn1, gn2, gn3 = end_gates(G, t0 - C, tl.where(t0 > bos, C, 0), h, H, K, kb0, NKB)
        store_state_tiles(dHs, dS0, dS1, dS2, dS3, slot, h, H, K, V, kb0, vr, NKB)
        dO = load_rows(do, t0, nrows, h, H, V, rows, vr, False)
        dd = dO  # the additive rule's pass does not read it
        if DELTA:
            dd = mm(load_rows(A, t0, nrows, h, H, C, rows, rows, True), dO, A.dtype.element_ty, X)
            if DECAY == 1:  # the key tiles' products first, their rows decayed once
                kdS = tl.full([C, BV], 0.0, tl.float32)  # (tl.zeros is a jit helper: see common.total)
                kdS = _writes_grad_parts(kdS, k, dS0, dS1, dS2, dS3, t0, nrows, h, H, K, rows, kb0, NKB, SD, X)
                dd += kdS * ek[:, None]
                dO = dO * eq[:, None]
            else:
                dd = _writes_grad_parts(dd, k, dS0, dS1, dS2, dS3, t0, nrows, h, H, K, rows, kb0, NKB, SD, X)
            store_rows(dd_out, dd, t0, nrows, h, H, V, rows, vr)
        dS0 = _state_grad_step(dS0, q, Wt, G, dO, dd, eg0, slot, t0, nrows, h, H, K, rows, kb0, scale, DECAY, DELTA,
                               BONUS, C, X, GATES_AHEAD)
        if NKB > 1:
            dS1 = _state_grad_step(dS1, q, Wt, G, dO, dd, eg1, slot, t0, nrows, h, H, K, rows, kb1, scale, DECAY, DELTA,
                                   BONUS, C, X, GATES_AHEAD)
        if NKB > 2:
            dS2 = _state_grad_step(dS2, q, Wt, G, dO, dd, eg2, slot, t0, nrows, h, H, K, rows, kb2, scale, DECAY, DELTA,
                                   BONUS, C, X, GATES_AHEAD)
            dS3 = _state_grad_step(dS3, q, Wt, G, dO, dd, eg3, slot, t0, nrows, h, H, K, rows, kb3, scale, DECAY, DELTA,
                                   BONUS, C, X, GATES_AHEAD)
    if STORE_DINIT:
        store_state_tiles(dh0, dS0, dS1, dS2, dS3, n, h, H, K, V, kb0, vr, NKB)


@triton.jit
def dv_kernel(q, k, G, u, A, do, dHs, dv, cu_seqlens, scale, T, H, N, K, V,
              DECAY: tl.constexpr, BONUS: tl.constexpr, IS_VARLEN: tl.constexpr,
              C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The additive rule's value gradient for one chunk and V block: dv = A^T dO + (k e^(Gamma-G)) dH,
    plus the bonus's scale (q u k) dO.

    A: the forward's scaled scores [tokens, H, C]; dHs: the chunk-end state gradients [slots, H, K, V]
    from ``state_bwd_kernel``; dv: [tokens, H, V] in the input dtype. Inside the sequential pass,
    these products cost GLA's state_bwd two thirds of its time (H200, 8 x 2048, H = 16, K = V = 128:
    0.519 ms with them, 0.177 without; this kernel takes 0.141). Grid (V blocks, slots, H).
    """
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    vb, slot, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    vr = vb * BV + tl.arange(0, BV)
    valid = rows < nrows
    Klive = tl.where(nrows > 0, K, 0)  # key rows of dH to read (none in an idle slot)
    last_row = tl.maximum(t0 + nrows - 1, 0)
    dO = load_rows(do, t0, nrows, h, H, V, rows, vr, False)
    dvt = mm(load_rows(A, t0, nrows, h, H, C, rows, rows, True), dO, A.dtype.element_ty, X)
    if DECAY == 1:
        last = tl.where(nrows > 0, tl.load(G + last_row * H + h), 0.0)
        ek = masked_exp2(valid, last - load_gate_rows(G, t0, nrows, h, H, rows))[:, None]
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False)
        if DECAY == 1:
            kt = kt * ek
        elif DECAY == 2:
            lastk = tl.load(G + (last_row * H + h) * K + cols, mask=cols < Klive, other=0.0)
            kt = kt * masked_exp2(valid[:, None], lastk[None, :] - load_rows(G, t0, nrows, h, H, K, rows, cols, False))
        dvt += mm(kt, load_state(dHs, slot, h, H, K, V, cols, vr, Klive, False), dHs.dtype.element_ty, X)
    if BONUS:  # a loop of its own: with the k tile above also read here, Triton 3.6 miscompiles it at 3 stages
        dvt += scale * bonus_scores(q, k, u, t0, nrows, h, H, K, rows, BK)[:, None] * dO
    store_rows(dv, dvt, t0, nrows, h, H, V, rows, vr)


@triton.jit
def score_grads_kernel(q, v, beta, G, Tt, d, do, dd, dA_out, dL_out, Y_out, dv, dbeta, dov_out,
                       k, hs, dk, dg, cu_seqlens, scale, T, H, N, K, V,
                       DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr, IS_VARLEN: tl.constexpr,
                       WY: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       SPAN: tl.constexpr, CSPAN: tl.constexpr, KP: tl.constexpr):
    """The gradients of one chunk that loop over value channels, stored for ``wy_grads_kernel`` and
    ``grads_kernel``; with WY (the delta rule) it then runs ``wy_grads_kernel``'s part itself (:func:`_wy_grads`:
    k, hs, dk, dg and the constexprs after WY are that kernel's), reading Y and dL back as this program stored
    them.

    dA_out[t, s] = scale dO_t . d_s on the score pairs (times e^(Gq_t - G_s) for DECAY 1):
    [tokens, H, C] in the states' dtype, which grads_kernel's products round it to (DECAY 2's products run in
    tf32, on dA widened; fp16 inputs store it in fp32: see ``launch.chunk_backward``). Delta rule, with
    Tt = T^T stored by the prep kernel: Y = T^T dd (Y_out, [tokens, H, V]); dv = beta Y; dL_out[s, r] =
    -Y_s . d_r on the strict pairs (times e^(G_s - G_r) for DECAY 1); dbeta gets its value part sum_v v Y.
    Y_out takes the dtype of hs, dL_out that of dA_out; the products of ``wy_grads_kernel`` run in them (in tf32
    on dL for DECAY 2; the additive rule's dv is ``dv_kernel``'s). Bonus: dov_out[t] = dO_t . d_t
    ([tokens, H] fp32). Grid (slots, H).

    Precision of the delta rule's two products (SPLIT: bf16 inputs, whose d and dd are bf16): Y = T^T dd as two
    bf16 products on T split once into its bf16 part and remainder (:func:`common.mm_parts`, about 16 of T's
    mantissa bits), and -Y d^T on Y rounded to bf16, the Y that Y_out stores and the WY part reads; dd and d enter
    the tensor cores as loaded. fp16 and fp32 inputs: both in tf32 (tf32x3 for fp32). Measured on an H200 (session
    26, H = 16, K = V = 128, against both in tf32 on tiles widened after their loads, and v loaded after the
    products): deltanet 0.358 -> 0.290 ms at 8 x 2048, gated delta 0.391 -> 0.321.
    """
    WYT: tl.constexpr = Tt.dtype.element_ty  # the delta rule's WY factors
    WT: tl.constexpr = d.dtype.element_ty  # the writes: v, or the corrected writes
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    SPLIT: tl.constexpr = DELTA and WT == tl.bfloat16  # bf16 inputs' delta rule: bf16 products (see above)
    YT: tl.constexpr = tl.bfloat16 if SPLIT else WYT  # the dtype of -Y d^T
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    valid = rows < nrows
    if BONUS:
        causal = (rows[:, None] > rows[None, :]) & valid[:, None]
    else:
        causal = (rows[:, None] >= rows[None, :]) & valid[:, None]
    dA = tl.full([C, C], 0.0, tl.float32)  # [t, s]
    if DELTA:
        b = load_gate_rows(beta, t0, nrows, h, H, rows)
        dL = tl.full([C, C], 0.0, tl.float32)  # [s, r]
        db = tl.full([C], 0.0, tl.float32)
    if BONUS:
        dov = tl.full([C], 0.0, tl.float32)
    if DELTA:
        TtC = load_rows(Tt, t0, nrows, h, H, C, rows, rows, False)
        if SPLIT:  # T's bf16 part and the bf16 rounding of its remainder, once for every V block
            Th, Tl = bf16_parts(TtC)
    for v0 in range(0, V, BV):
        vr = v0 + tl.arange(0, BV)
        dO = load_rows(do, t0, nrows, h, H, V, rows, vr, False)
        dtT = load_rows(d, t0, nrows, h, H, V, rows, vr, True)
        if DELTA:  # loaded before the products, which its load then overlaps
            vt = load_rows(v, t0, nrows, h, H, V, rows, vr, False)
        dA += mm(dO, dtT, WT, X)
        if DELTA:
            ddt = load_rows(dd, t0, nrows, h, H, V, rows, vr, False)
            if SPLIT:
                Y = mm_parts(Th, Tl, ddt)  # T^T dd
            else:
                Y = mm(TtC, ddt, WYT, X)
            store_rows(Y_out, Y, t0, nrows, h, H, V, rows, vr)
            store_rows(dv, b[:, None] * Y, t0, nrows, h, H, V, rows, vr)
            db += total(vt * Y, 1)
            dL -= mm(Y, dtT, YT, X)
        if BONUS:
            dov += total(dO.to(tl.float32) * load_rows(d, t0, nrows, h, H, V, rows, vr, False), 1)
    dA = tl.where(causal, dA, 0.0) * scale
    if DECAY == 1:  # fold the pairwise decays into the score gradients
        Gr = load_gate_rows(G, t0, nrows, h, H, rows)
        dA = dA * masked_exp2(causal, load_gate_rows(G, t0, nrows, h, H, rows - BONUS)[:, None] - Gr[None, :])
    store_rows(dA_out, dA, t0, nrows, h, H, C, rows, rows)
    if DELTA:
        strict = (rows[:, None] > rows[None, :]) & valid[:, None]
        dL = tl.where(strict, dL, 0.0)
        if DECAY == 1:
            dL = dL * masked_exp2(strict, Gr[:, None] - Gr[None, :])
        store_rows(dL_out, dL, t0, nrows, h, H, C, rows, rows)
        if WY:
            tl.debug_barrier()  # Y and dL, stored by other threads, are read back below
            _wy_grads(k, beta, G, hs, Y_out, dL_out, dk, dbeta, dg, db, slot, h, t0, nrows, H, K, V, DECAY, C, SB, BK,
                      BV, SPAN, CSPAN, KP)
        else:
            tl.store(dbeta + (t0 * H + h) + rows * H, db, mask=valid)
    if BONUS:
        tl.store(dov_out + (t0 * H + h) + rows * H, dov, mask=valid)


@triton.jit
def wy_grads_kernel(k, beta, G, hs, Y, dL_in, dk, dbeta, dg, cu_seqlens, T, H, N, K, V,
                    DECAY: tl.constexpr, IS_VARLEN: tl.constexpr,
                    C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    SPAN: tl.constexpr, CSPAN: tl.constexpr, KP: tl.constexpr):
    """The delta rule's key gradients through its WY factors, for one chunk; ``grads_kernel`` adds the rest.

    W = T (beta k e^G) gives d(beta k e^G) = -Y h^T; L = I + diag(beta) strict(A_kk) gives, with
    dL as stored by ``score_grads_kernel``, the row part beta (dL k) (e^+G side) and the column part
    dL^T (beta k) (e^-G side). Stores that part of dk to ``dk`` (input dtype), its gate gradient
    k (dk parts, e^-G parts negated) to ``dg`` (DECAY 2: [tokens, H, K]; DECAY 1: summed over the
    channels, [tokens, H]; before the reverse cumulative sum) and adds the key part of dbeta,
    sum_k k (e^G (-Y h^T) + dL k), to ``dbeta``, which holds its value part. Per-channel decays take both
    parts by one product each where the chunk's gates fall by at most 2^-CSPAN over it (:func:`chunk_span`,
    KP: K padded to a power of 2; :func:`_wy_one_ref`), as ``grads_kernel`` does. Grid (slots, H).
    Split from ``grads_kernel``, whose registers it filled: together they took 0.755 ms for the delta
    rule at 8 x 2048, H = 16, K = V = 128 on an H200 (255 registers, one 8-warp program per SM); apart,
    0.319 + 0.285, and 0.173 + 0.285 with Y and dL stored in bf16 rather than fp32.
    """
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    db = load_gate_rows(dbeta, t0, nrows, h, H, tl.arange(0, C))
    _wy_grads(k, beta, G, hs, Y, dL_in, dk, dbeta, dg, db, slot, h, t0, nrows, H, K, V, DECAY, C, SB, BK, BV, SPAN,
              CSPAN, KP)


@triton.jit
def _wy_grads(k, beta, G, hs, Y, dL_in, dk, dbeta, dg, db, slot, h, t0, nrows, H, K, V, DECAY: tl.constexpr,
              C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPAN: tl.constexpr,
              CSPAN: tl.constexpr, KP: tl.constexpr):
    """The body of :func:`wy_grads_kernel` for one chunk, given dbeta's value part db [C] (which it completes and
    stores); also run by ``score_grads_kernel`` (WY) right after it stores Y and dL. A per-channel decay's chunk
    within :func:`chunk_span`'s bound takes :func:`_wy_one_ref`; the others ``common.intra_rows`` and
    ``intra_cols``: by blocks of ``common.FAST_BLOCK`` rows where no gate falls by more than 2^-SPAN inside one
    (:func:`common.block_span`), else pairwise inside sub-blocks of SB rows."""
    LT: tl.constexpr = dL_in.dtype.element_ty if DECAY != 2 else tl.float32  # the products that read dL (tf32
    # for per-channel decays, on a bf16 dL widened: see launch.chunk_backward)
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    rows = tl.arange(0, C)
    valid = rows < nrows
    Klive = tl.where(nrows > 0, K, 0)  # key columns to read (none in an idle slot)
    b = load_gate_rows(beta, t0, nrows, h, H, rows)
    one_ref = False
    if DECAY == 2:
        one_ref = chunk_span(G, t0, nrows, h, H, K, KP) <= CSPAN
    if one_ref:
        for k0 in range(0, K, BK):
            db = _wy_one_ref(k, G, hs, Y, dL_in, dk, dg, b, db, slot, h, t0, nrows, H, K, V, k0 + tl.arange(0, BK),
                             LT, C, BV, X)
    else:
        blocks = False
        if DECAY == 1:
            Gr = load_gate_rows(G, t0, nrows, h, H, rows)
            dGk = tl.full([C], 0.0, tl.float32)
        elif DECAY == 2:
            blocks = block_span(G, t0, nrows, h, H, K, C, FAST_BLOCK, BK) <= SPAN
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
            dkW = _less_y_h(tl.full([C, BK], 0.0, tl.float32), Y, hs, slot, h, t0, nrows, H, K, V, Klive, rows, cols,
                            BV, X)
            if DECAY == 2:
                Gk = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
                dkW = dkW * exp2(Gk)
            elif DECAY == 1:
                Gk = Gr
                dkW = dkW * exp2(Gr)[:, None]
            else:
                Gk = tl.full([C, BK], 0.0, tl.float32)
            R = intra_rows(dL_in, k, G, Gk, t0, nrows, h, H, K, cols, blocks, LT, DECAY, 1, C, SB, X)
            db += total(kt * (dkW + R), 1)
            rowpart = b[:, None] * (dkW + R)
            Ccol = intra_cols(dL_in, k, beta, G, Gk, t0, nrows, h, H, K, cols, blocks, LT, DECAY, 1, 0, 1, C, SB, X)
            store_rows(dk, rowpart + Ccol, t0, nrows, h, H, K, rows, cols)
            if DECAY == 2:
                store_rows(dg, kt * (rowpart - Ccol), t0, nrows, h, H, K, rows, cols)
            elif DECAY == 1:
                dGk += total(kt * (rowpart - Ccol), 1)
        if DECAY == 1:
            tl.store(dg + (t0 * H + h) + rows * H, dGk, mask=valid)
    tl.store(dbeta + (t0 * H + h) + rows * H, db, mask=valid)


@triton.jit
def _less_y_h(acc, Y, hs, slot, h, t0, nrows, H, K, V, Klive, rows, cols, BV: tl.constexpr, X: tl.constexpr):
    """acc - Y h^T for key columns ``cols`` of one chunk ([C, BK] fp32), over the value blocks of BV: the W part
    of the WY gradient, d(beta k e^G) = -Y h^T, with Y [tokens, H, V] as ``score_grads_kernel`` stored it and
    h the chunk-start state (hs, read transposed; its key rows below Klive), the product in Y's dtype."""
    for v0 in range(0, V, BV):
        vr = v0 + tl.arange(0, BV)
        acc -= mm(load_rows(Y, t0, nrows, h, H, V, rows, vr, False),
                  load_state(hs, slot, h, H, K, V, cols, vr, Klive, True), Y.dtype.element_ty, X)
    return acc


@triton.jit
def _wy_one_ref(k, G, hs, Y, dL_in, dk, dg, b, db, slot, h, t0, nrows, H, K, V, cols, LT: tl.constexpr,
                C: tl.constexpr, BV: tl.constexpr, X: tl.constexpr):
    """:func:`_wy_grads` for key columns ``cols`` of a chunk whose per-channel gates fall by at most 2^-CSPAN over
    it: every decay splits at the chunk's start (``e^(G_t - G_s) = e^G_t e^-G_s``, the right factor at most
    2^CSPAN), so the row part is ``b e^G (dL (k e^-G) - Y h^T)``, one accumulator for both products, and the column
    part ``e^-G (dL^T (b k e^G))``. Stores dk's and dg's parts; returns db plus its key part.

    Against the pairwise path's functions (``common.intra_rows``, ``intra_cols``) on these chunks: one load of
    G and of k per block, two exponentials per element instead of five, one [C, BK] tile fewer; the G and k loads
    go ahead of the Y h^T loop, which hides them. On an H200 at 4 x 4096, H = 16, K = V = 128, bf16 (session 28):
    KDA's wy_grads 0.464 -> 0.394 ms, 0.382 with the loads ahead; fp16 at 8 x 2048 0.549 -> 0.432.
    """
    rows = tl.arange(0, C)
    valid = rows < nrows
    Klive = tl.where(nrows > 0, K, 0)  # key columns to read (none in an idle slot)
    Gk = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
    kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False)
    acc = _less_y_h(tl.full([C, cols.shape[0]], 0.0, tl.float32), Y, hs, slot, h, t0, nrows, H, K, V, Klive, rows,
                    cols, BV, X)
    acc += mm(load_rows(dL_in, t0, nrows, h, H, C, rows, rows, False), kt * masked_exp2(valid[:, None], -Gk), LT, X)
    P = exp2(Gk) * acc
    db += total(kt * P, 1)
    rowpart = b[:, None] * P
    Ccol = masked_exp2(valid[:, None], -Gk) * mm(load_rows(dL_in, t0, nrows, h, H, C, rows, rows, True),
                                                  (b[:, None] * kt) * exp2(Gk), LT, X)
    store_rows(dk, rowpart + Ccol, t0, nrows, h, H, K, rows, cols)
    store_rows(dg, kt * (rowpart - Ccol), t0, nrows, h, H, K, rows, cols)
    return db


@triton.jit
def _half_pairs(dq, dk, dA_in, q, k, G, Gq, Gs, t0, nrows, h, H, K, C: tl.constexpr, rows, cols, src, off,
                HB: tl.constexpr, BONUS: tl.constexpr):
    """One step of the pairs inside the halves of HB rows: src holds, per row, the off-th row of its half.

    dq[t] += dA[t, src] k_src e^(Gq_t - G_src) for src <= t (src < t with the bonus), and
    dk[s] += dA[src, s] q_src e^(Gq_src - G_s) for src >= s (src > s); one exponential per pair and channel.
    """
    live = (rows < nrows) & (src < nrows)
    pos = rows % HB
    coef = tl.load(dA_in + (t0 * H + h) * C + rows * (H * C) + src, mask=live, other=0.0)  # dA[t, src]
    if BONUS:
        pair = live & (pos > off)
    else:
        pair = live & (pos >= off)
    ku = load_rows(k, t0, nrows, h, H, K, src, cols, False).to(tl.float32)
    Gu = load_rows(G, t0, nrows, h, H, K, src, cols, False)
    dq += coef[:, None] * ku * masked_exp2(pair[:, None], Gq - Gu)
    coefT = tl.load(dA_in + (t0 * H + h) * C + src * (H * C) + rows, mask=live, other=0.0)  # dA[src, s]
    if BONUS:
        pairT = live & (off > pos)
    else:
        pairT = live & (off >= pos)
    qu = load_rows(q, t0, nrows, h, H, K, src, cols, False).to(tl.float32)
    Gqu = load_rows(G, t0, nrows, h, H, K, src - BONUS, cols, False)
    dk += coefT[:, None] * qu * masked_exp2(pairT[:, None], Gqu - Gs)
    return dq, dk


@triton.jit
def intra_grads_kernel(q, k, G, dA_in, dqi, dki, cu_seqlens, T, H, N, K,
                       BONUS: tl.constexpr, IS_VARLEN: tl.constexpr,
                       C: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
                       CSPAN: tl.constexpr, KP: tl.constexpr):
    """Per-channel decays: the intra-chunk parts of dq and dk for one block of RB rows of a chunk and
    BK key channels, which ``grads_kernel`` completes; only in chunks whose gates fall by more than
    2^-CSPAN over the chunk (:func:`chunk_span`, KP: K padded to a power of 2): ``grads_kernel`` takes the
    others' from two products of its own. Those chunks' programs stop after that check, one load of the last
    row's gates: 0.058 ms for gla at 8 x 2048, H = 16, K = 128 on an H200 (0.086 with two loads; one program
    per chunk, looping over its blocks, took 0.024, but 240 registers against 124, and the other chunks' work
    0.41 -> 0.60 ms).

    dqi[t] = sum_s dA[t, s] k_s e^(Gq_t - G_s),  dki[s] = sum_t dA[t, s] q_t e^(Gq_t - G_s)
    over the score pairs (s <= t; s < t and Gq_t = G_(t-1) with the bonus): [tokens, H, K] fp32.
    Every decay splits at a reference point R between its two rows, so both factors are <= 1:
    - the blocks before this one, for dq: R0 = G at the row before the block, one product
      dA[block, j] (k_j e^(R0 - G_j)) per block j;
    - the blocks after it, for dk: R1 = G at the block's last row, one product per block;
    - pairs across the block's two halves of RB / 2 rows: Rm = G at the first half's last row, one
      masked product per side. The second half's rows then take Rm as their reference for dq (the
      earlier blocks' sum carried there by e^(Rm - R0)), the first half's for dk (by e^(R1 - Rm));
    - pairs inside a half: one exponential per pair and channel.
    The halves take half the pairwise exponentials of the whole block: on an H200 at 8 x 2048, H = 16,
    K = 128, bf16, 0.956 -> 0.681 ms for gla (rwkv6 0.973 -> 0.777, kda 0.954 -> 0.680).
    Where no gate of the block's channels falls by more than 2^-SPAN over the block (R0 - R1 <= SPAN),
    its own pairs go through R0 (dq) and R1 (dk) as well, in one more product per side, with factors up
    to 2^SPAN and no exponential per pair: 0.681 -> 0.41 ms (gla, rwkv6, kda alike; the pairwise path
    takes 0.73 beside it).
    Grid (K blocks, slots * C / RB, H).
    """
    MT: tl.constexpr = tl.float32  # tf32 products (tf32x3 for fp32 inputs), also from a bf16 dA (as grads_kernel)
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    NB: tl.constexpr = C // RB
    HB: tl.constexpr = RB // 2
    kb, sb, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = sb % NB
    n, t0, nrows = locate_chunk(sb // NB, cu_seqlens, N, T, C, IS_VARLEN)
    cols = kb * BK + tl.arange(0, BK)
    r = tl.arange(0, RB)
    rows = i * RB + r
    valid = rows < nrows
    first = i * RB  # this block's first row
    if first < nrows and chunk_span(G, t0, nrows, h, H, K, KP) > CSPAN:
        Gq = load_rows(G, t0, nrows, h, H, K, rows - BONUS, cols, False)
        Gs = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
        last = first + RB - 1  # this block's last row
        R0 = tl.load(G + ((t0 + first - 1) * H + h) * K + cols, mask=cols < tl.where(first > 0, K, 0), other=0.0)
        R1 = tl.load(G + ((t0 + tl.minimum(last, nrows - 1)) * H + h) * K + cols, mask=cols < K, other=0.0)
        dq = tl.full([RB, BK], 0.0, tl.float32)
        for j in range(0, i):
            cj = j * RB + r
            kj = load_rows(k, t0, nrows, h, H, K, cj, cols, False) * exp2(
                R0[None, :] - load_rows(G, t0, nrows, h, H, K, cj, cols, False))
            dq += mm(load_rows(dA_in, t0, nrows, h, H, C, rows, cj, False), kj, MT, X)
        dk = tl.full([RB, BK], 0.0, tl.float32)
        if last + 1 < nrows:
            for j in range(i + 1, NB):
                cj = j * RB + r
                qj = load_rows(q, t0, nrows, h, H, K, cj, cols, False) * masked_exp2(
                    (cj < nrows)[:, None], load_rows(G, t0, nrows, h, H, K, cj - BONUS, cols, False) - R1[None, :])
                dk += mm(load_rows(dA_in, t0, nrows, h, H, C, cj, rows, True), qj, MT, X)  # dA[cj, rows]^T
        if largest(R0 - R1, 0) <= SPAN:  # the block's own pairs through R0 and R1 too, in one more product per side
            kF = load_rows(k, t0, nrows, h, H, K, rows, cols, False) * masked_exp2(valid[:, None], R0[None, :] - Gs)
            if BONUS:
                pair, pairT = r[:, None] > r[None, :], r[:, None] < r[None, :]
            else:
                pair, pairT = r[:, None] >= r[None, :], r[:, None] <= r[None, :]
            dq += mm(tl.where(pair, load_rows(dA_in, t0, nrows, h, H, C, rows, rows, False), 0.0), kF, MT, X)
            dq = dq * masked_exp2(valid[:, None], Gq - R0[None, :])
            qb = load_rows(q, t0, nrows, h, H, K, rows, cols, False) * masked_exp2(valid[:, None], Gq - R1[None, :])
            dk += mm(tl.where(pairT, load_rows(dA_in, t0, nrows, h, H, C, rows, rows, True), 0.0), qb, MT, X)
            dk = dk * masked_exp2(valid[:, None], R1[None, :] - Gs)
        else:
            mid = tl.minimum(first + HB - 1, nrows - 1)
            Rm = tl.load(G + ((t0 + mid) * H + h) * K + cols, mask=cols < K, other=0.0)
            upper = (r >= HB)[:, None]  # rows of the second half
            kF = tl.where((r < HB)[:, None] & valid[:, None],
                          load_rows(k, t0, nrows, h, H, K, rows, cols, False) * exp2(Rm[None, :] - Gs), 0.0)
            across = upper & (r < HB)[None, :]  # [t, s]: t in the second half, s in the first
            dq = tl.where(upper, dq * exp2(Rm - R0)[None, :], dq) + mm(
                tl.where(across, load_rows(dA_in, t0, nrows, h, H, C, rows, rows, False), 0.0), kF, MT, X)
            dq = dq * masked_exp2(valid[:, None], Gq - tl.where(upper, Rm[None, :], R0[None, :]))
            qF = tl.where(upper & valid[:, None],
                          load_rows(q, t0, nrows, h, H, K, rows, cols, False) * exp2(Gq - Rm[None, :]), 0.0)
            acrossT = (r < HB)[:, None] & (r >= HB)[None, :]  # [s, t]
            dk = tl.where(upper, dk, dk * exp2(R1 - Rm)[None, :]) + mm(
                tl.where(acrossT, load_rows(dA_in, t0, nrows, h, H, C, rows, rows, True), 0.0), qF, MT, X)
            dk = dk * masked_exp2(valid[:, None], tl.where(upper, R1[None, :], Rm[None, :]) - Gs)
            half_first = first + (r // HB) * HB  # first row of each row's half
            for off in range(HB):
                dq, dk = _half_pairs(dq, dk, dA_in, q, k, G, Gq, Gs, t0, nrows, h, H, K, C, rows, cols,
                                     half_first + off, off, HB, BONUS)
        store_rows(dqi, dq, t0, nrows, h, H, K, rows, cols)
        store_rows(dki, dk, t0, nrows, h, H, K, rows, cols)


@triton.jit
def grads_kernel(q, k, G, u, d, hs, dHs, do, dA_in, dov_in, dqi, dki, dq, dk, dg, du,
                 cu_seqlens, scale, T, H, N, K, V,
                 DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr, IS_VARLEN: tl.constexpr,
                 SIDE: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CSPAN: tl.constexpr,
                 KP: tl.constexpr, KGRID: tl.constexpr):
    """The gradients of one chunk per key channel: dq, dk, dg, du.

    Inputs as in the forward plus hs/dHs (chunk-start states / chunk-end state gradients,
    [slots, H, K, V]), do: [tokens, H, V] and what ``score_grads_kernel`` stored: dA_in
    ([tokens, H, C], read once as [t, s] and once transposed) and dov_in ([tokens, H]). Per-channel
    decays (DECAY 2): a chunk whose gates fall by at most 2^-CSPAN over the chunk (:func:`chunk_span`) takes
    the intra-chunk parts of dq and dk from two products, its decays split at the chunk's start as a scalar
    decay's (``dA (k e^-G)`` and ``dA^T (q e^Gq)``, the right factor at most 2^CSPAN; on a bf16 dA as two bf16
    products, :func:`common.mm_wide`, else and for RWKV-6 in tf32); any other
    reads them from dqi and dki (``intra_grads_kernel``). For the
    delta rule (DELTA), dk and dg already hold what ``wy_grads_kernel`` stored, and get the rest
    added. Outputs: dq, dk [tokens, H, K] (input dtype); dg [tokens, H(, K)] fp32 (reverse
    cumulative inside the chunk); du: per-chunk bonus gradients [slots, H, K] fp32. Grid (slots * KGRID, H).

    The per-channel decays but RWKV-6's (their key blocks on the grid, ``launch.key_grid``; one block at K <= BK)
    take the chunk-end term ``sum_v h dH`` from h and dH tiles loaded for it alone: at 2 or 3 stages (4 warps),
    with the tiles that feed ``dO h^T`` and ``d dH^T`` also read for it, Triton 3.6 compiled a race on Hopper (dq
    and dg moved from run to run, session 28); with tiles of their own the reruns agree, and the kernel runs 2
    stages (session 29, ``launch.LAUNCH``).

    KGRID 1: one program per chunk and head loops over the key blocks of BK channels. KGRID = K / BK (rounded
    up): one program per key block (``launch.key_grid``), the blocks of a chunk next to each other on the grid.
    A scalar decay's gate gradient then arrives as KGRID parts, each program storing its block's part in its
    own [tokens, H] slice of dg (the first slice holds the delta rule's WY part, which its block adds); the
    launcher sums them.

    SIDE 0 computes both sides of the chunk. But without a per-channel decay they can run as two launches
    of about half the registers each (they share only their reads of q, k and dA): SIDE 1 the query side
    (dq: dO h^T, dA k), SIDE 2 the key side (dk: d dH^T, dA^T q; du). A scalar decay's gate gradient
    joins them through dg: the query side stores its row sums q dq there (on the delta rule's part), the
    key side loads them, subtracts its own (k dk) and takes the reverse cumulative sum; it also loads the
    chunk-start states for the chunk-end term sum(h dH). The launcher splits the rules without a decay,
    and the scalar decays with fp32 inputs (``launch.LAUNCH``).
    """
    tl.static_assert(SIDE == 0 or DECAY != 2)
    tl.static_assert(DELTA == 0 or BONUS == 0)  # dg holds the query side's sums alone where a bonus needs them
    QS: tl.constexpr = SIDE != 2  # the query side: dq
    KS: tl.constexpr = SIDE != 1  # the key side: dk, du
    ST: tl.constexpr = hs.dtype.element_ty  # chunk states and their gradients
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    # a scalar decay's fp32 q and k tiles for its row sums, loaded after the V loop, not held through it (+60
    # registers): by its sides, and on the key grid (at 4 x 4096 on an H200, grads 0.293 -> 0.276 ms gated delta,
    # 0.265 -> 0.249 mamba2; the fp16 loop's lost, mamba2 0.323 -> 0.333; session 29)
    LATE: tl.constexpr = DECAY == 1 and (SIDE != 0 or KGRID > 1)
    tl.static_assert(KGRID == 1 or SIDE == 0 or DECAY != 1)  # a scalar decay's sides join through one dg
    slot, h = tl.program_id(0) // KGRID, tl.program_id(1)
    kb = tl.program_id(0) % KGRID  # the key block (0 in the loop)
    k_end = K if KGRID == 1 else (kb + 1) * BK
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    if DECAY == 1 and KGRID > 1:  # this key block's part of the gate gradient
        dg += kb.to(tl.int64) * (T if IS_VARLEN else N * T) * H
    rows = tl.arange(0, C)
    valid = rows < nrows
    Klive = tl.where(nrows > 0, K, 0)  # key columns to read (none in an idle slot)
    last_row = tl.maximum(t0 + nrows - 1, 0)
    if BONUS:
        dov = load_gate_rows(dov_in, t0, nrows, h, H, rows)
    if DECAY == 1:
        Gr = load_gate_rows(G, t0, nrows, h, H, rows)
        Gqr = load_gate_rows(G, t0, nrows, h, H, rows - BONUS)
        last = tl.where(nrows > 0, tl.load(G + last_row * H + h), 0.0)
        dGs = tl.full([C], 0.0, tl.float32)  # both sides' channel sums (a side's own in its launch)
        if DELTA and QS:  # the WY part, in the first key block's slice
            dGs += load_gate_rows(dg, t0, tl.where(kb == 0, nrows, 0), h, H, rows)
        if BONUS:
            dGq = tl.full([C], 0.0, tl.float32)
        gam = total(tl.full([C], 0.0, tl.float32), 0)
    if DECAY == 2:
        one_ref = chunk_span(G, t0, nrows, h, H, K, KP) <= CSPAN
    for k0 in range(kb * BK, k_end, BK):
        cols = k0 + tl.arange(0, BK)
        if not LATE:
            qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
            kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
        if DECAY == 2:  # before the V loop, which hides these loads (gla grads 0.88 -> 0.77 ms at 8 x 2048, H200;
            # session 33: everything after the loop, on its accumulators, compiled to 480 bytes of stack against 168)
            Gk = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
            Gq = load_rows(G, t0, nrows, h, H, K, rows - BONUS, cols, False)
            lastk = tl.load(G + (last_row * H + h) * K + cols, mask=cols < Klive, other=0.0)
            if BONUS:  # RWKV-6 holds the decay factors through the V loop: taken after it (as the others do, two
                # [C, BK] tiles fewer held) its loop spilled more, grads 0.814 -> 0.829 ms at 4 x 4096 on an H200,
                # where gla's went 0.564 -> 0.540 and kda's 0.630 -> 0.625
                eq = exp2(Gq)
                ek = masked_exp2(valid[:, None], lastk[None, :] - Gk)
            if one_ref:  # the intra-chunk parts through the chunk's start (dq's e^Gq after the V loop but RWKV-6's)
                rk = masked_exp2(valid[:, None], -Gk)  # in [1, 2^CSPAN]
                if BONUS:  # in tf32 (with common.mm_wide, RWKV-6's grads 0.819 -> 0.887 ms at 4 x 4096, H200)
                    dqt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, False), kt * rk, tl.float32, X) * eq
                    dkt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, True), qt * eq, tl.float32, X) * rk
                else:  # e^Gq taken here apart from the eq after the V loop: one eq for both kept it live through
                    # the loop (sm_90 stack 128 -> 208 bytes for gla)
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
            if QS or DECAY != 0:
                hT = load_state(hs, slot, h, H, K, V, cols, vr, Klive, True)
            if KS:
                dHT = load_state(dHs, slot, h, H, K, V, cols, vr, Klive, True)
            if QS:
                dqh += mm(load_rows(do, t0, nrows, h, H, V, rows, vr, False), hT, ST, X)
            if KS:
                dkh += mm(load_rows(d, t0, nrows, h, H, V, rows, vr, False), dHT, ST, X)
            if DECAY == 2 and not BONUS and KS:  # apart from the products' tiles (a race otherwise: see the docstring)
                hE = load_state(hs, slot, h, H, K, V, cols, vr, Klive, False)
                dHE = load_state(dHs, slot, h, H, K, V, cols, vr, Klive, False)
                gH += total(hE.to(tl.float32) * dHE, 1)
            elif DECAY != 0 and KS:
                gH += total(hT.to(tl.float32) * dHT, 0)
        if DECAY == 1:
            eq = exp2(Gqr)[:, None]
            ek = masked_exp2(valid, last - Gr)[:, None]
        if DECAY == 2 and not BONUS:  # the decay factors after the V loop
            eq = exp2(Gq)
            ek = masked_exp2(valid[:, None], lastk[None, :] - Gk)
            if one_ref:
                dqt = dqt * eq
        if DECAY != 2:  # dA carries the decays: dA k and dA^T q
            if QS:
                dqt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, False),
                         load_rows(k, t0, nrows, h, H, K, rows, cols, False), ST, X)
            if KS:
                qc = load_rows(q, t0, nrows, h, H, K, rows, cols, False)
                dkt = mm(load_rows(dA_in, t0, nrows, h, H, C, rows, rows, True), qc, ST, X)
            if LATE:
                qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
                kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
        if DECAY == 0:
            if QS:
                dqt += scale * dqh
            if KS:
                dkt += dkh
        else:
            if QS:
                dqt += scale * dqh * eq
            if KS:
                kend = dkh * ek
            if DECAY == 2:
                dkt += kend
                gq = qt * dqt
                gk = -kt * dkt
                gam_k = exp2(lastk) * gH + total(kt * kend, 0)
                if DELTA:
                    gk += load_rows(dg, t0, nrows, h, H, K, rows, cols, False)
            else:  # two row sums: q dq - k dk before the chunk-end part, and that part (k kend), which gam sums
                if KS:
                    kendr = total(kt * kend, 1)
                if SIDE == 0:
                    dGs += total(qt * dqt - kt * dkt, 1) - kendr
                elif SIDE == 1:
                    dGs += total(qt * dqt, 1)
                else:
                    dGs -= total(kt * dkt, 1) + kendr
                if BONUS and SIDE == 0:
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
        if DECAY == 2:  # one reverse cumulative sum of both sides (the query side's is exclusive with the bonus);
            # a column sum and a forward scan: as one reverse scan (remaining_total) it took longer (gla 0.684 ->
            # 0.696 ms, rwkv6 0.751 -> 0.776 at 8 x 2048, H200), unlike the [C] sums of a scalar decay below
            gs = gk + gq
            rev = total(gs, 0)[None, :] - running_total(gs, 0)
            if BONUS:
                rev += gk
            else:
                rev += gs
            store_rows(dg, rev + gam_k[None, :], t0, nrows, h, H, K, rows, cols)
    if DECAY == 1:
        if SIDE == 1:  # for the key side
            tl.store(dg + (t0 * H + h) + rows * H, dGs, mask=valid)
        else:  # one reverse cumulative sum of both sides' channel sums, as one reverse scan
            if SIDE == 2:  # the query side's (no bonus with the delta rule: without its part)
                dGq = load_gate_rows(dg, t0, nrows, h, H, rows)
                dGs += dGq
            rev = remaining_total(dGs, 0)
            if BONUS:
                rev -= dGq
            tl.store(dg + (t0 * H + h) + rows * H, rev + gam, mask=valid)
