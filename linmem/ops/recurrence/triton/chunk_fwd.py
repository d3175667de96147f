"""Forward kernels of the chunked recurrence (DESIGN.md section 3), one family for every rule.

With ``G`` the chunk-local cumulative log decay, ``h`` the state at the chunk start and
``Gamma = G`` of the chunk's last token, one chunk of C tokens computes::

    delta rule only:  T = (I + diag(beta) strict(A_kk))^-1,  W = T (beta k e^G),  U = T (beta v)
                      d = U - W h                                  (the corrected writes)
    additive:         d = v
    o      = scale (q e^Gq) h + A_qk d  (+ scale (q . (u k)) v  with the RWKV-6 bonus)
    h_next = e^Gamma h + (k e^(Gamma - G))^T d

where ``A_xy[t, s] = sum_k x_tk y_sk exp(G_t - G_s)`` (``common.chunk_scores``) and
``Gq = G`` (``G`` of the previous token with the bonus). Kernels, in launch order:
``chunk_cumsum_kernel`` (G), ``delta_prep_kernel`` (T, W, U), ``state_fwd_kernel`` (the
only sequential pass: h of every chunk, d, the final state), ``output_kernel`` (A_qk, o).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (chunk_scores, first_slot, load_gate_rows, load_rows, load_state, locate_chunk, masked_exp, mm,
                     running_total, sequence_bounds, store_rows, store_state, total)


@triton.jit
def chunk_cumsum_kernel(g, G, cu_seqlens, T, H, N, K,
                        VECTOR: tl.constexpr, IS_VARLEN: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """G = cumulative sum of the log decay g inside each chunk, fp32.

    g, G: [tokens, H] (one gate per token) or [tokens, H, K] (VECTOR). Grid (slots, H, K blocks).
    """
    slot, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    if VECTOR:
        cols = kb * BK + tl.arange(0, BK)
        x = load_rows(g, t0, nrows, h, H, K, rows, cols, False)
        store_rows(G, running_total(x, 0), t0, nrows, h, H, K, rows, cols)
    else:
        x = load_gate_rows(g, t0, nrows, h, H, rows)
        tl.store(G + (t0 * H + h) + rows * H, running_total(x, 0), mask=rows < nrows)


@triton.jit
def delta_prep_kernel(k, v, beta, G, Tinv, W, U, cu_seqlens, T, H, N, K, V,
                      DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr):
    """Delta rule, per chunk: T = (I + diag(beta) strict(A_kk))^-1 [C, C], W = T (beta k e^G) [C, K],
    U = T (beta v) [C, V] (the WY/UT form). The inverse is a forward substitution, one row per step.

    k: [tokens, H, K], v: [tokens, H, V], beta: [tokens, H]; outputs Tinv: [tokens, H, C],
    W: [tokens, H, K], U: [tokens, H, V]. Grid (slots, H).
    """
    IT: tl.constexpr = W.dtype.element_ty
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    b = load_gate_rows(beta, t0, nrows, h, H, rows)
    L = b[:, None] * chunk_scores(k, k, G, t0, nrows, h, H, K, DECAY, True, 0, C, SB, BK, X)
    eye = rows[:, None] == rows[None, :]
    Ti = tl.where(eye, 1.0, 0.0)
    for i in range(1, C):
        # row i of (I + L)^-1 = e_i - sum_{j<i} L[i, j] (row j), rows j < i already final
        coef = -total(tl.where(rows[:, None] == i, L, 0.0), 0)
        row = total(coef[:, None] * Ti, 0) + tl.where(rows == i, 1.0, 0.0)
        Ti = tl.where(rows[:, None] == i, row[None, :], Ti)
    store_rows(Tinv, Ti, t0, nrows, h, H, C, rows, rows)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = load_rows(k, t0, nrows, h, H, K, rows, cols, False) * b[:, None]
        if DECAY == 1:
            x = x * tl.exp(load_gate_rows(G, t0, nrows, h, H, rows))[:, None]
        elif DECAY == 2:
            x = x * tl.exp(load_rows(G, t0, nrows, h, H, K, rows, cols, False))
        store_rows(W, mm(Ti, x, IT, X), t0, nrows, h, H, K, rows, cols)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        x = load_rows(v, t0, nrows, h, H, V, rows, cols, False) * b[:, None]
        store_rows(U, mm(Ti, x, IT, X), t0, nrows, h, H, V, rows, cols)


@triton.jit
def state_fwd_kernel(k, vu, W, G, hs, d_out, h0, hN, cu_seqlens, T, H, N, K, V,
                     DECAY: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                     HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
                     C: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr):
    """The sequential pass over chunks: stores the chunk-start states and carries the state.

    Per chunk: hs[slot] = h; d = U - W h (DELTA, stored to d_out) or d = v;
    h = e^Gamma h + (k e^(Gamma - G))^T d. vu: v or U [tokens, H, V]; hs: [slots, H, K, V]
    (dot dtype); h0, hN: [N, H, K, V] fp32. Grid (V blocks, N * H); the whole K is one tile.
    """
    IT: tl.constexpr = W.dtype.element_ty  # the delta rule's intermediates
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    WT: tl.constexpr = d_out.dtype.element_ty  # the writes: v, or the corrected writes
    vb, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    s0 = first_slot(n, bos, T, C, IS_VARLEN)
    kr = tl.arange(0, BKF)
    vr = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    if HAS_INIT:
        S = load_state(h0, n, h, H, K, V, kr, vr, K, False).to(tl.float32)
    else:
        S = tl.full([BKF, BV], 0.0, tl.float32)
    for c in range((eos - bos + C - 1) // C):
        t0 = bos + c * C
        nrows = tl.minimum(eos - t0, C)
        store_state(hs, S, s0 + c, h, H, K, V, kr, vr)
        if DELTA:
            Wt = load_rows(W, t0, nrows, h, H, K, rows, kr, False)
            d = load_rows(vu, t0, nrows, h, H, V, rows, vr, False) - mm(Wt, S, IT, X)
            store_rows(d_out, d, t0, nrows, h, H, V, rows, vr)
        else:
            d = load_rows(vu, t0, nrows, h, H, V, rows, vr, False)
        kT = load_rows(k, t0, nrows, h, H, K, rows, kr, True)
        valid = rows < nrows
        if DECAY == 1:
            Gs = load_gate_rows(G, t0, nrows, h, H, rows)
            last = tl.load(G + (t0 + nrows - 1) * H + h)
            kT = kT * masked_exp(valid[None, :], last - Gs[None, :])
            S = S * tl.exp(last)
        elif DECAY == 2:
            GT = load_rows(G, t0, nrows, h, H, K, rows, kr, True)
            last = tl.load(G + ((t0 + nrows - 1) * H + h) * K + kr, mask=kr < K, other=0.0)
            kT = kT * masked_exp(valid[None, :], last[:, None] - GT)
            S = S * tl.exp(last)[:, None]
        S += mm(kT, d, WT, X)
    if STORE_FINAL:
        store_state(hN, S, n, h, H, K, V, kr, vr)


@triton.jit
def output_kernel(q, k, d, v, G, u, hs, A_out, o, cu_seqlens, scale, T, H, N, K, V,
                  DECAY: tl.constexpr, BONUS: tl.constexpr, IS_VARLEN: tl.constexpr,
                  C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Per chunk: A = scale A_qk (stored for the backward), o = scale (q e^Gq) h + A d (+ bonus).

    d: the writes [tokens, H, V] (v, or the delta rule's corrected writes); v: the values
    (read only for the bonus); u: [H, K]; hs: chunk-start states [slots, H, K, V];
    A_out: [tokens, H, C]; o: [tokens, H, V]. Grid (slots, H).
    """
    HT: tl.constexpr = hs.dtype.element_ty
    AT: tl.constexpr = A_out.dtype.element_ty
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    A = scale * chunk_scores(q, k, G, t0, nrows, h, H, K, DECAY, BONUS, BONUS, C, SB, BK, X)
    store_rows(A_out, A, t0, nrows, h, H, C, rows, rows)
    if DECAY == 1:
        eq = tl.exp(load_gate_rows(G, t0, nrows, h, H, rows - BONUS))[:, None]
    if BONUS:
        qku = tl.full([C], 0.0, tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            uu = tl.load(u + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)
            qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False)
            qku += total(qt * uu[None, :] * load_rows(k, t0, nrows, h, H, K, rows, cols, False), 1)
    for v0 in range(0, V, BV):
        vr = v0 + tl.arange(0, BV)
        acc = tl.full([C, BV], 0.0, tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False)
            if DECAY == 1:
                qt = qt * eq
            elif DECAY == 2:
                qt = qt * tl.exp(load_rows(G, t0, nrows, h, H, K, rows - BONUS, cols, False))
            acc += mm(qt, load_state(hs, slot, h, H, K, V, cols, vr, tl.where(nrows > 0, K, 0), False), HT, X)
        out = scale * acc + mm(A, load_rows(d, t0, nrows, h, H, V, rows, vr, False), AT, X)
        if BONUS:
            out += scale * qku[:, None] * load_rows(v, t0, nrows, h, H, V, rows, vr, False)
        store_rows(o, out, t0, nrows, h, H, V, rows, vr)
