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

from .common import (_INTERP, LOG2E, bonus_scores, chunk_scores, end_decay, exp2, first_state_tiles, load_gate_rows,
                     load_rows, load_state, locate_chunk, masked_exp2, mm, mm_split, running_total, sequence_state,
                     store_rows, store_rows_t, store_state, store_state_tiles)


@triton.jit
def chunk_cumsum_kernel(g, G, cu_seqlens, T, H, N, K,
                        VECTOR: tl.constexpr, IS_VARLEN: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """G = log2(e) x the cumulative sum of the log decay g inside each chunk, fp32 (decays are 2^(G_t - G_s)).

    g, G: [tokens, H] (one gate per token) or [tokens, H, K] (VECTOR). Grid (slots, H, K blocks).
    """
    slot, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    if VECTOR:
        cols = kb * BK + tl.arange(0, BK)
        x = load_rows(g, t0, nrows, h, H, K, rows, cols, False)
        store_rows(G, running_total(x, 0) * LOG2E, t0, nrows, h, H, K, rows, cols)
    else:
        _scalar_cumsum(g, G, t0, nrows, h, H, C)


@triton.jit
def _scalar_cumsum(g, G, t0, nrows, h, H, C: tl.constexpr):
    """A scalar decay's G ([tokens, H]) for one chunk (:func:`chunk_cumsum_kernel`)."""
    rows = tl.arange(0, C)
    x = load_gate_rows(g, t0, nrows, h, H, rows)
    tl.store(G + (t0 * H + h) + rows * H, running_total(x, 0) * LOG2E, mask=rows < nrows)


@triton.jit
def _inv_mm(a, b, X: tl.constexpr):
    """a @ b for the inverse's small products, a and b fp32: in IEEE fp32 for fp32 inputs (X), else as three bf16
    products on both split in two bf16 parts (``common.mm_split``, about 16 mantissa bits each)."""
    if X:
        if _INTERP:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")
    return mm_split(a, b)


@triton.jit
def _lower_block(Lp, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, i: tl.constexpr, j: tl.constexpr):
    """Block (i, j) [SB, SB] of a chunk's [C, C] matrix stored as rows of a [tokens, H, C] buffer."""
    return load_rows(Lp, t0, nrows, h, H, C, i * SB + tl.arange(0, SB), j * SB + tl.arange(0, SB), False)


@triton.jit
def _diag_inverse(Lp, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, i: tl.constexpr, X: tl.constexpr):
    """(I + L_ii)^-1 for the diagonal block i [SB, SB] of the strictly lower L stored in Lp, by doubling (see
    :func:`unit_lower_inverse`), as one [SB, SB] tile.

    The four blocks used to be doubled together as one [4, SB, SB] tensor; taking each block out of it took a
    cross-thread reduction (13.6% of the prep kernel's warp samples, Nsight Compute, session 26). Apart, the four
    blocks are independent chains of products and need no reduction: prep 0.236 -> 0.221 ms for deltanet at
    8 x 2048 on an H200 (gated delta 0.255 -> 0.239, kda 0.411 -> 0.400), the same bits."""
    a = tl.arange(0, SB)[:, None]
    c = tl.arange(0, SB)[None, :]
    Li = _lower_block(Lp, t0, nrows, h, H, C, SB, i, i)
    # s = 1: the inverse of each 2 x 2 block [[1, 0], [l, 1]] is [[1, 0], [-l, 1]]
    D = tl.where(a == c, 1.0, 0.0) - tl.where((a // 2 == c // 2) & (a % 2 == 1) & (c % 2 == 0), Li, 0.0)
    for m in tl.static_range(1, 5):
        if (1 << m) < SB:  # from blocks of s = 2^m rows to blocks of 2s
            Lo = tl.where((a // (2 << m) == c // (2 << m)) & ((a >> m) % 2 == 1) & ((c >> m) % 2 == 0), Li, 0.0)
            D -= _inv_mm(_inv_mm(D, Lo, X), D, X)
    return D


@triton.jit
def unit_lower_inverse(Lp, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, X: tl.constexpr):
    """T = (I + L)^-1 for the strictly lower L [C, C] (fp32, stored in Lp); returns T's ten nonzero
    blocks [SB, SB] (C = 4 SB), row by row: T00, T10, T11, T20, ..., T33.

    The diagonal blocks D_b = (I + L_bb)^-1, each by doubling (:func:`_diag_inverse`): with D the
    inverse of the diagonal s x s blocks of I + L_bb and Lo the entries of L_bb in the lower-left
    s x s block of each 2s x 2s block, ``D - D Lo D`` is the inverse of the 2s x 2s blocks
    (``[[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``). From s = 1 (D = I) that is two
    products per doubling, six for SB = 16, instead of SB - 1 dependent substitution steps, and no
    product grows past the inverse's own blocks; the four blocks' chains are independent. (The nilpotent
    series ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` takes as many products, but its powers of L grow with
    correlated keys and beta near 2: their cancellation cost ``T x`` up to 5% relative error in fp32,
    ``scripts/wy_inverse_accuracy.py``.)
    Then the blocks below the diagonal, ``T_ij = -D_i sum_{j<=m<i} L_im T_mj`` ((I + L) T = I solved
    for block (i, j)), nearest the diagonal first: 16 products of [SB, SB] blocks, none on the six
    zero blocks above the diagonal. Products in IEEE fp32 for fp32 inputs (X), else bf16 x3 (:func:`_inv_mm`).
    """
    tl.static_assert(C == 4 * SB)
    tl.static_assert(SB <= 32)
    D0 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 0, X)
    D1 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 1, X)
    D2 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 2, X)
    D3 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 3, X)
    L10 = _lower_block(Lp, t0, nrows, h, H, C, SB, 1, 0)
    L21 = _lower_block(Lp, t0, nrows, h, H, C, SB, 2, 1)
    L32 = _lower_block(Lp, t0, nrows, h, H, C, SB, 3, 2)
    T10 = -_inv_mm(D1, _inv_mm(L10, D0, X), X)
    T21 = -_inv_mm(D2, _inv_mm(L21, D1, X), X)
    T32 = -_inv_mm(D3, _inv_mm(L32, D2, X), X)
    L31 = _lower_block(Lp, t0, nrows, h, H, C, SB, 3, 1)
    T20 = -_inv_mm(D2, _inv_mm(_lower_block(Lp, t0, nrows, h, H, C, SB, 2, 0), D0, X) + _inv_mm(L21, T10, X), X)
    T31 = -_inv_mm(D3, _inv_mm(L31, D1, X) + _inv_mm(L32, T21, X), X)
    T30 = -_inv_mm(D3, _inv_mm(_lower_block(Lp, t0, nrows, h, H, C, SB, 3, 0), D0, X) + _inv_mm(L31, T10, X)
                   + _inv_mm(L32, T20, X), X)
    return D0, T10, D1, T20, T21, D2, T30, T31, T32, D3


@triton.jit
def _store_t_block(Tt, x, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, i: tl.constexpr, j: tl.constexpr):
    """Block (i, j) [SB, SB] of T into Tt, transposed (Tt[t0 + s, h, c] = T[c, s])."""
    r = tl.arange(0, SB)
    store_rows_t(Tt, x, t0, nrows, h, H, C, j * SB + r, i * SB + r)


@triton.jit
def _factor_product(Tp, x, X: tl.constexpr):
    """Tp @ x for the delta rule's W and U: Tp [C, C] fp32 (T with its columns scaled), x [C, BD] (the keys or
    values, or KDA's decayed keys in fp32). bf16 and fp16 inputs: bf16 products on Tp and x split in two bf16 parts
    where they are not bf16 already (``common.mm_split``: about 16 mantissa bits, where a tf32 product keeps 10;
    an fp16 value is exactly the sum of its two parts). fp32 inputs (X): ``mm``'s fp32-accurate product."""
    if X:
        return mm(Tp, x, tl.float32, X)
    if x.dtype != tl.bfloat16:
        x = x.to(tl.float32)
    return mm_split(Tp, x)


@triton.jit
def delta_prep_kernel(k, v, beta, g, G, Tt, W, Wt, U, kg, cu_seqlens, T, H, N, K, V,
                      DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_W: tl.constexpr, C: tl.constexpr,
                      SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPAN: tl.constexpr, CSPAN: tl.constexpr,
                      KP: tl.constexpr):
    """Delta rule, per chunk: T = (I + diag(beta) strict(A_kk))^-1 [C, C], W = T (beta k e^G) [C, K],
    U = T (beta v) [C, V] (the WY/UT form); the inverse by blocks (:func:`unit_lower_inverse`).

    k: [tokens, H, K], v: [tokens, H, V], beta: [tokens, H]; G: [tokens, H(, K)], which a scalar decay
    (DECAY 1) stores here first, from its log decay g ([tokens, H]) as :func:`chunk_cumsum_kernel` would;
    outputs Tt: [tokens, H, C] (fp32,
    T transposed: row s of a chunk holds T[:, s]; first used as scratch for L), W: [tokens, H, K],
    Wt: [slots, H, K, C] (W transposed, per chunk, in the dtype of the backward's W^T dd product),
    U: [tokens, H, V] (W and U fp32, or bf16 where ``launch.factors_dtype`` says so; W is stored only if
    STORE_W: with bf16 factors Wt holds the same values, and the forward pass reads those). The backward reads
    T and W only transposed, and fp32 operands of tensor-core products must not be transposed on the way
    in: they would go through shared memory one element at a time. A per-channel decay (DECAY 2) also
    stores the keys decayed to the chunk's end, kg = k e^(Gamma - G) ([tokens, H, K], k's dtype), which the
    sequential passes read instead of k and G. Grid (slots, H).

    W and U are one [C, C] product per column block, on T read back whole (a strided load of Tt) with its
    columns scaled by beta (and e^G), so that the keys and values enter as they are (:func:`_factor_product`).
    """
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    valid = rows < nrows
    if DECAY == 1:  # G first, read back below after the barrier; this saves the cumsum kernel's launch (gated delta
        # 1.535 -> 1.529 ms at 4 x 4096, 1.858 -> 1.844 at 1 x 16384 on an H200). A per-channel G here lost:
        # KDA's prep 0.400 -> 0.485 ms against the cumsum kernel's 0.066
        _scalar_cumsum(g, G, t0, nrows, h, H, C)
        tl.debug_barrier()
    b = load_gate_rows(beta, t0, nrows, h, H, rows)
    L = b[:, None] * chunk_scores(k, k, G, t0, nrows, h, H, K, DECAY, True, 0, C, SB, BK, X, SPAN, CSPAN, KP)
    store_rows(Tt, L, t0, nrows, h, H, C, rows, rows)
    tl.debug_barrier()  # L is read back by blocks, by other threads
    T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = unit_lower_inverse(Tt, t0, nrows, h, H, C, SB, X)
    tl.debug_barrier()  # every block of L is read before T overwrites it
    for i in tl.static_range(3):  # the zero blocks above the diagonal: the scratch holds L's entries there
        for j in tl.static_range(i + 1, 4):
            _store_t_block(Tt, tl.full([SB, SB], 0.0, tl.float32), t0, nrows, h, H, C, SB, i, j)
    _store_t_block(Tt, T00, t0, nrows, h, H, C, SB, 0, 0)
    _store_t_block(Tt, T10, t0, nrows, h, H, C, SB, 1, 0)
    _store_t_block(Tt, T11, t0, nrows, h, H, C, SB, 1, 1)
    _store_t_block(Tt, T20, t0, nrows, h, H, C, SB, 2, 0)
    _store_t_block(Tt, T21, t0, nrows, h, H, C, SB, 2, 1)
    _store_t_block(Tt, T22, t0, nrows, h, H, C, SB, 2, 2)
    _store_t_block(Tt, T30, t0, nrows, h, H, C, SB, 3, 0)
    _store_t_block(Tt, T31, t0, nrows, h, H, C, SB, 3, 1)
    _store_t_block(Tt, T32, t0, nrows, h, H, C, SB, 3, 2)
    _store_t_block(Tt, T33, t0, nrows, h, H, C, SB, 3, 3)
    tl.debug_barrier()  # T's blocks are stored before T is read back whole
    # T [C, C] (columns past the chunk's end 0), its columns scaled by beta (U) and beta e^G (W): the products then
    # take the keys and values as they are, which bf16 inputs keep exact
    TU = load_rows(Tt, t0, nrows, h, H, C, rows, rows, True) * b[None, :]
    TW = TU
    if DECAY == 1:
        TW = TU * exp2(load_gate_rows(G, t0, nrows, h, H, rows))[None, :]
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = load_rows(k, t0, nrows, h, H, K, rows, cols, False)
        if DECAY == 2:  # the per-channel decay on the keys, and kg, the keys decayed to the chunk's end
            Gr = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
            last = tl.load(G + ((t0 + nrows - 1) * H + h) * K + cols, mask=cols < K, other=0.0)
            store_rows(kg, x * masked_exp2(valid[:, None], last[None, :] - Gr), t0, nrows, h, H, K, rows, cols)
            x = x * exp2(Gr)
        y = _factor_product(TW, x, X)
        if STORE_W:
            store_rows(W, y, t0, nrows, h, H, K, rows, cols)
        store_state(Wt, y, slot, h, H, K, C, cols, rows, True)  # every row of the slot: 0 past the chunk's end
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        store_rows(U, _factor_product(TU, load_rows(v, t0, nrows, h, H, V, rows, cols, False), X), t0, nrows, h,
                   H, V, rows, cols)


@triton.jit
def _state_step(S, k, G, d, t0, nrows, h, H, K, rows, kb, DECAY: tl.constexpr, DELTA: tl.constexpr,
                PT: tl.constexpr, SPLIT: tl.constexpr, X: tl.constexpr):
    """Key rows kb of the next chunk's start state: e^Gamma S + (k e^(Gamma - G))^T d. With a scalar decay the
    delta rule's d arrives decayed (e^(Gamma - G) on its rows, a [C, BV] tile before its tf32 product); with a
    per-channel decay its k (kg)."""
    kT = load_rows(k, t0, nrows, h, H, K, rows, kb, True)
    valid = rows < nrows
    if DECAY == 1:
        last = end_decay(G, t0, nrows, h, H, K, kb, DECAY)
        if not DELTA:  # on k^T: decaying the bf16 writes instead broke the bf16 bound of dlog_decay
            kT = kT * masked_exp2(valid[None, :], last - load_gate_rows(G, t0, nrows, h, H, rows)[None, :])
        S = S * exp2(last)
    elif DECAY == 2:  # last in each branch: one line above both reorders the additive rule's loads (new sm_90 code)
        if DELTA:  # k arrives decayed (kg of delta_prep_kernel)
            last = end_decay(G, t0, nrows, h, H, K, kb, DECAY)
        else:
            GT = load_rows(G, t0, nrows, h, H, K, rows, kb, True)
            last = end_decay(G, t0, nrows, h, H, K, kb, DECAY)
            kT = kT * masked_exp2(valid[None, :], last[:, None] - GT)
        S = S * exp2(last)[:, None]
    return S + _pass_mm(kT, d, PT, SPLIT, X)


@triton.jit
def _w_tile(W, slot, t0, nrows, h, H, K, rows, kb, C: tl.constexpr, W_T: tl.constexpr):
    """Key columns kb of the delta rule's W for one chunk, [C, len(kb)]: from W by tokens, or (W_T) from its
    transposed copy per chunk [slots, H, K, C], whose rows past the chunk's end hold 0."""
    if W_T:
        return load_state(W, slot, h, H, K, C, kb, rows, K, True)
    return load_rows(W, t0, nrows, h, H, K, rows, kb, False)


@triton.jit
def _pass_mm(a, b, DT: tl.constexpr, SPLIT: tl.constexpr, X: tl.constexpr):
    """A product of the forward pass with an fp32 right factor (the state, or the delta rule's d): in DT, or with
    a bf16 left factor (SPLIT: the delta rule's bf16 W and U) as two bf16 products (``mm_split``)."""
    if SPLIT:
        return mm_split(a, b)
    return mm(a, b, DT, X)


@triton.jit
def state_fwd_kernel(k, vu, W, G, hs, d_out, h0, hN, cu_seqlens, T, H, N, K, V,
                     DECAY: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                     HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, W_T: tl.constexpr, NARROW: tl.constexpr,
                     C: tl.constexpr, BKF: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr):
    """The sequential pass over chunks: stores the chunk-start states and carries the state.

    Per chunk: hs[slot] = h; d = U - W h (DELTA, stored to d_out) or d = v;
    h = e^Gamma h + (k e^(Gamma - G))^T d, computed as k^T (e^(Gamma - G) d) for the delta rule
    with a scalar decay. k: the keys (for the delta rule with a per-channel decay, decayed to the chunk's
    end: kg of ``delta_prep_kernel``); vu: v or U [tokens, H, V]; W: the delta rule's W [tokens, H, K], or with
    W_T its transposed copy per chunk (Wt of ``delta_prep_kernel``, [slots, H, K, C]; bf16 factors, whose W it
    equals); hs: [slots, H, K, V] (dot dtype); h0, hN:
    [N, H, K, V] fp32. Grid (V blocks, N * H). The state is held as BKF // KB tiles (1, 2 or 4)
    of KB key rows, each with its own loads.
    The delta rule's products: with fp32 W and U, W h and k^T d run in tf32 (tf32x3 for fp32 inputs)
    whatever d_out's dtype: with d stored in bf16 and the same bf16 tile fed to k^T d, Triton 3.6
    miscompiles this kernel on Hopper at V blocks of 16 and 32 (NaN outputs; H200, 2026-11-22). With
    bf16 W and U (``launch.factors_dtype``: bf16 inputs, K <= 128) W h runs as two bf16 products on h split in
    two bf16 parts (SPLIT, ``common.mm_split``), and so does k^T d on d, but on grids narrower than half the SMs
    (NARROW, ``launch.NARROW_BF16_FACTORS``), where it stays one tf32 product on the k tile widened: there the
    pass is bound by its chain of dependent products, which the second product lengthened.
    """
    IT: tl.constexpr = W.dtype.element_ty  # k, or the delta rule's WY factors
    PT: tl.constexpr = tl.float32 if DELTA else IT  # the dtype of k^T d
    SPLIT: tl.constexpr = DELTA and IT == tl.bfloat16  # W h as two bf16 products (common.mm_split)
    SPLIT_KD: tl.constexpr = SPLIT and not NARROW  # and k^T d; NARROW: in tf32, on the k tile widened
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    NKB: tl.constexpr = BKF // KB
    n, h, bos, eos, s0, kb0, vr, rows = sequence_state(cu_seqlens, T, H, C, IS_VARLEN, KB, BV)
    kb1, kb2, kb3 = kb0 + KB, kb0 + 2 * KB, kb0 + 3 * KB
    S0, S1, S2, S3 = first_state_tiles(h0, HAS_INIT, n, h, H, K, V, kb0, vr, NKB)
    for c in range((eos - bos + C - 1) // C):
        t0 = bos + c * C
        nrows = tl.minimum(eos - t0, C)
        store_state_tiles(hs, S0, S1, S2, S3, s0 + c, h, H, K, V, kb0, vr, NKB)
        d = load_rows(vu, t0, nrows, h, H, V, rows, vr, False)
        if DELTA:
            d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb0, C, W_T), S0, IT, SPLIT, X)
            if NKB > 1:
                d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb1, C, W_T), S1, IT, SPLIT, X)
            if NKB > 2:
                d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb2, C, W_T), S2, IT, SPLIT, X)
                d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb3, C, W_T), S3, IT, SPLIT, X)
            store_rows(d_out, d, t0, nrows, h, H, V, rows, vr)
            if DECAY == 1:
                d = d * masked_exp2(rows < nrows, end_decay(G, t0, nrows, h, H, K, kb0, DECAY)
                                    - load_gate_rows(G, t0, nrows, h, H, rows))[:, None]
        S0 = _state_step(S0, k, G, d, t0, nrows, h, H, K, rows, kb0, DECAY, DELTA, PT, SPLIT_KD, X)
        if NKB > 1:
            S1 = _state_step(S1, k, G, d, t0, nrows, h, H, K, rows, kb1, DECAY, DELTA, PT, SPLIT_KD, X)
        if NKB > 2:
            S2 = _state_step(S2, k, G, d, t0, nrows, h, H, K, rows, kb2, DECAY, DELTA, PT, SPLIT_KD, X)
            S3 = _state_step(S3, k, G, d, t0, nrows, h, H, K, rows, kb3, DECAY, DELTA, PT, SPLIT_KD, X)
    if STORE_FINAL:
        store_state_tiles(hN, S0, S1, S2, S3, n, h, H, K, V, kb0, vr, NKB)


@triton.jit
def _output_block(q, d, v, G, hs, A, o, qg, qku, eq, slot, t0, nrows, h, H, K, V, rows, vr, scale,
                  DECAY: tl.constexpr, BONUS: tl.constexpr, QG: tl.constexpr, BK: tl.constexpr,
                  HT: tl.constexpr, AT: tl.constexpr, X: tl.constexpr):
    """One V block of the output: scale (q e^Gq) h[:, vr] + A d[:, vr] (+ the bonus) -> o. QG (per-channel
    decays): 1 also stores q e^G -> qg, which the caller asks of its first V block alone; 2 reads it back from
    qg (rounded to qg's dtype, as the product rounds it to hs's, the same). Measured on an H200 (KDA,
    8 x 2048, H = 16, K = V = 128): the output kernel 0.285 ms without the store, 0.371 with it inside the V
    loop behind a runtime test, 0.338 with it in the first block alone, 0.321 with the later blocks reading
    it back."""
    acc = tl.full([rows.shape[0], vr.shape[0]], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        if QG == 2:
            qt = load_rows(qg, t0, nrows, h, H, K, rows, cols, False)
        else:
            qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False)
            if DECAY == 2:
                qt = qt * exp2(load_rows(G, t0, nrows, h, H, K, rows - BONUS, cols, False))
                if QG == 1:
                    store_rows(qg, qt, t0, nrows, h, H, K, rows, cols)
        acc += mm(qt, load_state(hs, slot, h, H, K, V, cols, vr, tl.where(nrows > 0, K, 0), False), HT, X)
    if DECAY == 1:  # a scalar decay scales the product's rows, and q goes to the tensor cores as loaded
        acc = acc * eq
    out = scale * acc + mm(A, load_rows(d, t0, nrows, h, H, V, rows, vr, False), AT, X)
    if BONUS:
        out += scale * qku[:, None] * load_rows(v, t0, nrows, h, H, V, rows, vr, False)
    store_rows(o, out, t0, nrows, h, H, V, rows, vr)


@triton.jit
def output_kernel(q, k, d, v, G, u, hs, A_out, o, qg, cu_seqlens, scale, T, H, N, K, V,
                  DECAY: tl.constexpr, BONUS: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_QG: tl.constexpr,
                  C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPAN: tl.constexpr,
                  CSPAN: tl.constexpr, KP: tl.constexpr):
    """Per chunk: A = scale A_qk (stored for the backward), o = scale (q e^Gq) h + A d (+ bonus).

    d: the writes [tokens, H, V] (v, or the delta rule's corrected writes); v: the values
    (read only for the bonus); u: [H, K]; hs: chunk-start states [slots, H, K, V];
    A_out: [tokens, H, C]; o: [tokens, H, V]. STORE_QG (the delta rule with a per-channel decay): also
    store the decayed queries of the inter-chunk product, qg = q e^G ([tokens, H, K], q's dtype), which
    ``state_bwd_kernel`` reads instead of q and G. Grid (slots, H).
    """
    HT: tl.constexpr = hs.dtype.element_ty
    AT: tl.constexpr = A_out.dtype.element_ty
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    A = scale * chunk_scores(q, k, G, t0, nrows, h, H, K, DECAY, BONUS, BONUS, C, SB, BK, X, SPAN, CSPAN, KP)
    store_rows(A_out, A, t0, nrows, h, H, C, rows, rows)
    eq = rows  # a scalar decay's e^Gq on the rows (unused otherwise)
    if DECAY == 1:
        eq = exp2(load_gate_rows(G, t0, nrows, h, H, rows - BONUS))[:, None]
    qku = rows  # the bonus's scores (unused without it)
    if BONUS:
        qku = bonus_scores(q, k, u, t0, nrows, h, H, K, rows, BK)
    v_first = 0  # the first V block of the loop below
    if STORE_QG:  # the first V block on its own, which stores qg; the others read it back
        _output_block(q, d, v, G, hs, A, o, qg, qku, eq, slot, t0, nrows, h, H, K, V, rows, tl.arange(0, BV), scale,
                      DECAY, BONUS, 1, BK, HT, AT, X)
        v_first = BV
        tl.debug_barrier()  # qg, stored by other threads, is read below
    for v0 in range(v_first, V, BV):
        _output_block(q, d, v, G, hs, A, o, qg, qku, eq, slot, t0, nrows, h, H, K, V, rows, v0 + tl.arange(0, BV),
                      scale, DECAY, BONUS, 2 * STORE_QG, BK, HT, AT, X)
