"""Intra-chunk scores and their gradients' products, for every decay kind.

``chunk_scores`` computes ``A[t, s] = sum_k x_tk y_sk exp2(Gx_tk - G_sk)`` for one chunk; ``intra_rows`` and
``intra_cols`` the products of a score gradient with the keys or queries that carry the same decays. Per-channel
decays take one of three paths per chunk, the cheapest its gates allow, each exact:

* one reference point: the gates fall by at most ``2^-CSPAN`` over the whole chunk (``gates.chunk_span``), so
  ``exp(G_t - G_s) = exp(G_t) exp(-G_s)`` with the right factor at most ``2^CSPAN``: one product, as a scalar
  decay's;
* block products: the gates fall by at most ``2^-SPAN`` inside every block of ``FAST_BLOCK`` rows
  (``gates.block_span``), so the decays split at the blocks' starts and even the pairs inside a block enter
  matrix products (``_block_scores``, ``_block_rows``, ``_block_cols``);
* pairwise: reference points between sub-blocks of ``SB`` rows (``gates.py``) and one exponential per pair and
  channel inside them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gates import block_span, carry_left, chunk_span, ref_point, since_ref, to_ref
from .layout import load_gate_rows, load_rows
from .numerics import exp2, masked_exp2, mm, total
from .switches import CHANNEL_DECAY, SCALAR_DECAY

#: row block of the per-channel decays' products without pairwise exponentials (``_block_scores``; the block
#: path of the intra-chunk gradient stage takes ``configs.INTRA_ROWS``)
FAST_BLOCK: tl.constexpr = tl.constexpr(16)


@triton.jit
def bonus_scores(q, k, u, t0, nrows, h, H, K, rows, BK: tl.constexpr):
    """The RWKV-6 bonus's score of each row with itself, ``q_t . (u k_t)``: [C] fp32 (u: [H, K])."""
    qku = tl.full([rows.shape[0]], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        uu = tl.load(u + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        qku += total(load_rows(q, t0, nrows, h, H, K, rows, cols, False) * uu[None, :]
                     * load_rows(k, t0, nrows, h, H, K, rows, cols, False), 1)
    return qku


@triton.jit
def _chained_scores(acc, xE, yFT, G_ptr, t0, nrows, h, H, K, cols, rows, C: tl.constexpr, SB: tl.constexpr,
                    OWN: tl.constexpr, PT: tl.constexpr, X: tl.constexpr):
    """acc [C, C] fp32 plus the pairs of one key block that the sub-blocks' reference points split, as products.

    For each sub-block j (last first), L holds the rows of the later sub-blocks (and of j itself if OWN)
    against the reference point of the columns ``yFT`` of sub-block j, and meets them in one product; L then
    reaches the next reference by ``exp2(R_m - R_(m-1)) <= 1``. xE, yFT: the rows and the transposed columns
    scaled to their references (:func:`since_ref`, :func:`to_ref`; with OWN, the columns' reference is the row
    before their sub-block). Products in dtype PT.
    """
    NB: tl.constexpr = C // SB
    blk = rows // SB
    L = tl.full([C, cols.shape[0]], 0.0, tl.float32)
    R = ref_point(G_ptr, t0, nrows, h, H, K, cols, NB - 2, SB)
    for jj in range(NB - 1 + OWN):
        j = NB - 2 + OWN - jj
        L += tl.where((blk == j + 1 - OWN)[:, None], xE, 0.0)
        acc += mm(L, tl.where((blk == j)[None, :], yFT, 0.0), PT, X)
        L, R = carry_left(L, R, G_ptr, t0, nrows, h, H, K, cols, j - OWN, SB)
    return acc


@triton.jit
def _block_scores(acc, x_ptr, y_ptr, G_ptr, t0, nrows, h, H, K, cols, rows, SHIFT: tl.constexpr, C: tl.constexpr,
                  X: tl.constexpr):
    """acc plus one key block's part of :func:`chunk_scores` for a chunk whose gates fall by at most 2^SPAN inside
    each block of FAST_BLOCK rows (:func:`block_span`): [C, C] fp32, exact on the pairs s <= t, finite on the rest.

    R_j, G at the row before block j, splits every decay at the start of the column's block:
    ``exp2(Gx_t - G_s) = exp2(Gx_t - R_j) exp2(R_j - G_s)``, the left factor <= 1 and the right one at most
    2^SPAN. So the pairs inside a block enter the same products as those across blocks
    (:func:`_chained_scores` with OWN), and no pairwise exponential is left. The products run in tf32 (tf32x3
    for fp32 inputs): the right factors exceed fp16's range.
    """
    Gx = load_rows(G_ptr, t0, nrows, h, H, K, rows - SHIFT, cols, False)
    xE = load_rows(x_ptr, t0, nrows, h, H, K, rows, cols, False) * since_ref(Gx, G_ptr, t0, nrows, h, H, K, cols,
                                                                             rows, FAST_BLOCK)
    yFT = load_rows(y_ptr, t0, nrows, h, H, K, rows, cols, True) * to_ref(
        load_rows(G_ptr, t0, nrows, h, H, K, rows, cols, True), G_ptr, t0, nrows, h, H, K, cols, rows, FAST_BLOCK,
        True, True)
    return _chained_scores(acc, xE, yFT, G_ptr, t0, nrows, h, H, K, cols, rows, C, FAST_BLOCK, 1, tl.float32, X)


@triton.jit
def chunk_scores(x_ptr, y_ptr, G_ptr, t0, nrows, h, H, K,
                 DECAY: tl.constexpr, STRICT: tl.constexpr, SHIFT: tl.constexpr,
                 C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, X: tl.constexpr, SPAN: tl.constexpr,
                 CSPAN: tl.constexpr, KP: tl.constexpr):
    """Decayed scores of one chunk, ``A[t, s] = sum_k x_tk y_sk exp2(Gx_tk - G_sk)``: [C, C] fp32.

    Pairs s <= t (s < t if STRICT); 0 elsewhere. ``Gx`` is ``G`` of row t, or of row t - 1
    if SHIFT (the RWKV-6 read-out before the step's decay). DECAY: 0 none, 1 one gate per
    token ([tokens, H]), 2 one per key channel ([tokens, H, K]). x, y: [tokens, H, K].
    Per-channel decays: a chunk whose gates fall by at most 2^-CSPAN over the whole chunk (:func:`chunk_span`)
    splits every decay at the chunk's start, ``exp2(Gx_t) exp2(-G_s)``, the right factor at most 2^CSPAN: one
    product per key block, in tf32 (tf32x3 for fp32 inputs), as a scalar decay's. Otherwise a chunk whose
    gates fall by at most 2^-SPAN inside every block of FAST_BLOCK rows (:func:`block_span`) takes
    :func:`_block_scores`; any other, the pairwise loop below.
    """
    DT: tl.constexpr = x_ptr.dtype.element_ty
    rows = tl.arange(0, C)
    valid = rows < nrows
    if STRICT:
        causal = rows[:, None] > rows[None, :]
    else:
        causal = rows[:, None] >= rows[None, :]
    acc = tl.full([C, C], 0.0, tl.float32)
    if DECAY == CHANNEL_DECAY:
        # one path for the whole chunk, a loop each (a choice per key block inside one loop runs no faster)
        if chunk_span(G_ptr, t0, nrows, h, H, K, KP) <= CSPAN:
            for k0 in range(0, K, BK):
                cols = k0 + tl.arange(0, BK)
                xE = load_rows(x_ptr, t0, nrows, h, H, K, rows, cols, False) * exp2(
                    load_rows(G_ptr, t0, nrows, h, H, K, rows - SHIFT, cols, False))
                yFT = load_rows(y_ptr, t0, nrows, h, H, K, rows, cols, True) * masked_exp2(
                    valid[None, :], -load_rows(G_ptr, t0, nrows, h, H, K, rows, cols, True))
                acc += mm(xE, yFT, tl.float32, X)
            # the pairs past the diagonal are finite (factors up to 2^CSPAN); the causal mask drops them
            acc = tl.where(causal & valid[:, None], acc, 0.0)
        elif block_span(G_ptr, t0, nrows, h, H, K, C, FAST_BLOCK, BK) <= SPAN:
            for k0 in range(0, K, BK):
                cols = k0 + tl.arange(0, BK)
                acc = _block_scores(acc, x_ptr, y_ptr, G_ptr, t0, nrows, h, H, K, cols, rows, SHIFT, C, X)
            # the blocks' products also filled the pairs past the diagonal (finite), which the causal mask drops
            acc = tl.where(causal & valid[:, None], acc, 0.0)
        else:
            blk = rows // SB
            offs = tl.arange(0, SB)
            P = tl.full([C, SB], 0.0, tl.float32)  # P[t, off]: the pair (t, first row of t's sub-block + off)
            for k0 in range(0, K, BK):
                cols = k0 + tl.arange(0, BK)
                x = load_rows(x_ptr, t0, nrows, h, H, K, rows, cols, False)
                Gx = load_rows(G_ptr, t0, nrows, h, H, K, rows - SHIFT, cols, False)
                # s in an earlier sub-block j than t, through R_j (G at the end of sub-block j): x_t e^(Gx_t - R_j)
                # and y_s e^(R_j - G_s), both <= 1
                xE = x * since_ref(Gx, G_ptr, t0, nrows, h, H, K, cols, rows, SB)
                yFT = load_rows(y_ptr, t0, nrows, h, H, K, rows, cols, True) * to_ref(
                    load_rows(G_ptr, t0, nrows, h, H, K, rows, cols, True), G_ptr, t0, nrows, h, H, K, cols, rows,
                    SB, True, False)
                acc = _chained_scores(acc, xE, yFT, G_ptr, t0, nrows, h, H, K, cols, rows, C, SB, 0, DT, X)
                # s in the same sub-block as t: pairwise, one column offset at a time
                for off in range(SB):
                    src = (rows // SB) * SB + off
                    ysel = load_rows(y_ptr, t0, nrows, h, H, K, src, cols, False)
                    Gsel = load_rows(G_ptr, t0, nrows, h, H, K, src, cols, False)
                    if STRICT:
                        pair = valid & (rows % SB > off)
                    else:
                        pair = valid & (rows % SB >= off)
                    P += tl.where(offs[None, :] == off, total(x.to(tl.float32) * ysel * masked_exp2(
                        pair[:, None], Gx - Gsel), 1)[:, None], 0.0)
            # the pairs to their columns once, after every key block: a [C, SB] sum per step above, not a [C, C] one
            same = blk[:, None] == blk[None, :]
            acc += tl.where(same, tl.gather(P, tl.broadcast_to((rows % SB)[None, :], [C, C]), 1), 0.0)
    else:
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            x = load_rows(x_ptr, t0, nrows, h, H, K, rows, cols, False)
            yT = load_rows(y_ptr, t0, nrows, h, H, K, rows, cols, True)
            acc += mm(x, yT, DT, X)
        if DECAY == SCALAR_DECAY:
            Gx = load_gate_rows(G_ptr, t0, nrows, h, H, rows - SHIFT)
            Gs = load_gate_rows(G_ptr, t0, nrows, h, H, rows)
            acc = acc * masked_exp2(causal & valid[:, None], Gx[:, None] - Gs[None, :])
        else:
            acc = tl.where(causal, acc, 0.0)
    return acc


@triton.jit
def _block_refs(G_ptr, t0, nrows, h, H, K, cols, C: tl.constexpr):
    """For the block products of one chunk: (valid rows [C], each row's block of FAST_BLOCK rows [C], P [C, BK]:
    G at the row before that block, 0 for the first)."""
    rows = tl.arange(0, C)
    blk = rows // FAST_BLOCK
    return rows < nrows, blk, load_rows(G_ptr, t0, nrows, h, H, K, blk * FAST_BLOCK - 1, cols, False)


@triton.jit
def _block_rows(dSf, y, Gs, G_ptr, t0, nrows, h, H, K, cols, MT: tl.constexpr, C: tl.constexpr, X: tl.constexpr):
    """:func:`intra_rows` by blocks of FAST_BLOCK rows, for a chunk whose gates fall by at most 2^SPAN inside each
    (:func:`block_span`); dSf [C, C] widened, y [C, BK] and Gs (G of the same rows) as loaded.

    P_j, G at the row before block j, splits every decay at the start of the column's block:
    ``exp2(G_t - G_s) = exp2(G_t - P_b) exp2(P_b - P_j) exp2(P_j - G_s)`` for s in block j, t in block b >= j. The
    right factor enters the product on the keys (at most 2^SPAN), the middle one carries M, the sum over the blocks
    so far, from one reference to the next (<= 1), and the left one (<= 1) comes last. The pairs inside a block take
    the same products as the pairs across blocks: C / FAST_BLOCK masked products and no pairwise exponential."""
    NB: tl.constexpr = C // FAST_BLOCK
    valid, blk, P = _block_refs(G_ptr, t0, nrows, h, H, K, cols, C)
    yF = y * masked_exp2(valid[:, None], P - Gs)
    M = tl.full([C, cols.shape[0]], 0.0, tl.float32)
    P_prev = tl.full([cols.shape[0]], 0.0, tl.float32)
    for j in range(NB):
        Pj = ref_point(G_ptr, t0, nrows, h, H, K, cols, j - 1, FAST_BLOCK)
        M = tl.where((blk >= j)[:, None], M * exp2(Pj - P_prev)[None, :], M)
        M += mm(tl.where((blk == j)[None, :], dSf, 0.0), yF, MT, X)
        P_prev = Pj
    return M * masked_exp2(valid[:, None], Gs - P)


@triton.jit
def _block_cols(dST, x, Gs, G_ptr, t0, nrows, h, H, K, cols, MT: tl.constexpr, C: tl.constexpr, X: tl.constexpr):
    """:func:`intra_cols` by blocks of FAST_BLOCK rows (as :func:`_block_rows`, transposed), without SHIFT; dST
    [C, C] (dS transposed), x [C, BK] (weighted) and Gs (G of the same rows) as loaded.

    For s in block j: ``Z[s] = exp2(P_j - G_s) sum_t dS[t, s] L_t``, L_t = w_t x_t exp2(G_t - P_j) <= 1 over the
    rows of blocks j and later, which reaches P_(j-1) by ``exp2(P_j - P_(j-1)) <= 1`` (the last block first)."""
    NB: tl.constexpr = C // FAST_BLOCK
    valid, blk, P = _block_refs(G_ptr, t0, nrows, h, H, K, cols, C)
    xE = x * masked_exp2(valid[:, None], Gs - P)
    L = tl.full([C, cols.shape[0]], 0.0, tl.float32)
    Z = tl.full([C, cols.shape[0]], 0.0, tl.float32)
    Pj = ref_point(G_ptr, t0, nrows, h, H, K, cols, NB - 2, FAST_BLOCK)
    for jj in range(NB):
        j = NB - 1 - jj
        L += tl.where((blk == j)[:, None], xE, 0.0)
        Z += mm(tl.where((blk == j)[:, None], dST, 0.0), L, MT, X)
        P_prev = ref_point(G_ptr, t0, nrows, h, H, K, cols, j - 2, FAST_BLOCK)
        L = L * exp2(Pj - P_prev)[None, :]
        Pj = P_prev
    return Z * masked_exp2(valid[:, None], P - Gs)


@triton.jit
def intra_rows(dS, y_ptr, G_ptr, Gx, t0, nrows, h, H, K, cols, blocks, MT: tl.constexpr,
               DECAY: tl.constexpr, STRICT: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, X: tl.constexpr):
    """``Z[t] = sum_s dS[t, s] y_s exp2(Gx_t - G_s)`` for one chunk and key columns ``cols``: [C, BK].

    dS: a score gradient as stored by ``score_grads_kernel`` ([tokens, H, C], row t holds
    dS[t, :]), zero outside the pairs (s <= t, or s < t if STRICT) of the scores it is the
    gradient of; for SCALAR_DECAY it already carries the decays (then this is a plain product).
    Gx: [C, BK] (CHANNEL_DECAY), G of the chunk's rows. With ``blocks`` (a chunk within :func:`block_span`'s bound) the
    decays split at the blocks' starts (:func:`_block_rows`); otherwise at the sub-blocks' reference points, and
    pairwise inside them, for a chunk of any gates (``wy_grads._wy_one_ref`` takes the chunks within
    :func:`chunk_span`'s bound in one product). Products run in dtype MT.
    """
    rows = tl.arange(0, C)
    if DECAY != CHANNEL_DECAY:
        Z = mm(load_rows(dS, t0, nrows, h, H, C, rows, rows, False), load_rows(y_ptr, t0, nrows, h, H, K, rows, cols,
                                                                            False), MT, X)
    elif blocks:
        Z = _block_rows(load_rows(dS, t0, nrows, h, H, C, rows, rows, False),
                        load_rows(y_ptr, t0, nrows, h, H, K, rows, cols, False), Gx, G_ptr, t0, nrows, h, H, K,
                        cols, MT, C, X)
    else:
        valid = rows < nrows
        blk = rows // SB
        yF = load_rows(y_ptr, t0, nrows, h, H, K, rows, cols, False) * to_ref(
            load_rows(G_ptr, t0, nrows, h, H, K, rows, cols, False), G_ptr, t0, nrows, h, H, K, cols, rows, SB, False,
            False)
        # s in an earlier sub-block j than t, through R_j: M[t] sums over j < blk(t) the products
        # dS[t, sub-block j] (y e^(R_j - G))[sub-block j], each times e^(R_(blk(t)-1) - R_j), which M
        # gathers as the loop passes the later reference points; e^(Gx_t - R_(blk(t)-1)) comes last
        dSf = load_rows(dS, t0, nrows, h, H, C, rows, rows, False)
        M = tl.full([C, cols.shape[0]], 0.0, tl.float32)
        R_prev = ref_point(G_ptr, t0, nrows, h, H, K, cols, 0, SB)
        for j in range(C // SB - 1):
            R = ref_point(G_ptr, t0, nrows, h, H, K, cols, j, SB)
            M = tl.where((blk > j)[:, None], M * exp2(R - R_prev)[None, :], M)
            M += mm(tl.where((blk[:, None] > j) & (blk[None, :] == j), dSf, 0.0), yF, MT, X)
            R_prev = R
        Z = since_ref(Gx, G_ptr, t0, nrows, h, H, K, cols, rows, SB) * M
        # s in the same sub-block as t: pairwise, one column offset at a time
        for off in range(SB):
            src = (rows // SB) * SB + off
            # dS[t, src], widened: a bf16 dS times bf16 keys would round each pair's product to bf16 (and the
            # interpreter multiplies bf16 bit patterns as integers)
            coef = tl.load(dS + (t0 * H + h) * C + rows * (H * C) + src, mask=valid, other=0.0).to(tl.float32)
            ysel = load_rows(y_ptr, t0, nrows, h, H, K, src, cols, False)
            Gsel = load_rows(G_ptr, t0, nrows, h, H, K, src, cols, False)
            if STRICT:
                pair = valid & (src < nrows) & (rows % SB > off)
            else:
                pair = valid & (src < nrows) & (rows % SB >= off)
            Z += coef[:, None] * ysel * masked_exp2(pair[:, None], Gx - Gsel)
    return Z


@triton.jit
def intra_cols(dS, x_ptr, w_ptr, G_ptr, Gs, t0, nrows, h, H, K, cols, blocks, MT: tl.constexpr,
               DECAY: tl.constexpr, STRICT: tl.constexpr, SHIFT: tl.constexpr, WEIGHTED: tl.constexpr,
               C: tl.constexpr, SB: tl.constexpr, X: tl.constexpr):
    """``Z[s] = sum_t dS[t, s] w_t x_t exp2(Gx_t - G_s)`` for one chunk and key columns ``cols``: [C, BK].

    The transposed companion of :func:`intra_rows`: dS as stored there, read transposed (a
    transposed load, never a transposed product). w: one weight per token ([tokens, H], the
    delta rule's beta) if WEIGHTED, else 1. Gx is G of row t (t - 1 if SHIFT); Gs: [C, BK]
    (CHANNEL_DECAY), G of the chunk's rows, taken as in :func:`intra_rows` (``blocks`` only without SHIFT:
    :func:`_block_cols`). Products run in dtype MT.
    """
    rows = tl.arange(0, C)
    valid = rows < nrows
    x = load_rows(x_ptr, t0, nrows, h, H, K, rows, cols, False)
    dST = load_rows(dS, t0, nrows, h, H, C, rows, rows, True)  # [s, t]
    if WEIGHTED:
        x = x * load_gate_rows(w_ptr, t0, nrows, h, H, rows)[:, None]
    if DECAY != CHANNEL_DECAY:
        Z = mm(dST, x, MT, X)
    elif blocks:
        tl.static_assert(SHIFT == 0)
        Z = _block_cols(dST, x, Gs, G_ptr, t0, nrows, h, H, K, cols, MT, C, X)
    else:
        Gx = load_rows(G_ptr, t0, nrows, h, H, K, rows - SHIFT, cols, False)
        blk = rows // SB
        # s in an earlier sub-block j than t, as in chunk_scores: L holds w_t x_t e^(Gx_t - R_j) for the
        # rows after sub-block j; e^(R_j - G_s) for s in sub-block j comes last
        xE = x * since_ref(Gx, G_ptr, t0, nrows, h, H, K, cols, rows, SB)
        L = tl.full([C, cols.shape[0]], 0.0, tl.float32)
        Z = tl.full([C, cols.shape[0]], 0.0, tl.float32)
        R_next = ref_point(G_ptr, t0, nrows, h, H, K, cols, C // SB - 2, SB)
        for jj in range(C // SB - 1):
            j = C // SB - 2 - jj
            L += tl.where((blk == j + 1)[:, None], xE, 0.0)
            Z += mm(tl.where((blk == j)[:, None], dST, 0.0), L, MT, X)
            L, R_next = carry_left(L, R_next, G_ptr, t0, nrows, h, H, K, cols, j, SB)
        Z = Z * to_ref(Gs, G_ptr, t0, nrows, h, H, K, cols, rows, SB, False, False)
        for off in range(SB):
            src = (rows // SB) * SB + off
            coef = tl.load(dS + (t0 * H + h) * C + src * (H * C) + rows, mask=valid & (src < nrows),
                           other=0.0).to(tl.float32)  # dS[src, s], widened as in intra_rows
            if WEIGHTED:
                coef = coef * load_gate_rows(w_ptr, t0, nrows, h, H, src)
            xsel = load_rows(x_ptr, t0, nrows, h, H, K, src, cols, False)
            Gxsel = load_rows(G_ptr, t0, nrows, h, H, K, src - SHIFT, cols, False)
            if STRICT:
                pair = valid & (src < nrows) & (off > rows % SB)
            else:
                pair = valid & (src < nrows) & (off >= rows % SB)
            Z += coef[:, None] * xsel * masked_exp2(pair[:, None], Gxsel - Gs)
    return Z
