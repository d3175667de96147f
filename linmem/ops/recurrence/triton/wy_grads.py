"""Stage 4 of the backward (delta rule): the key gradients through the WY factors, for one chunk each.

``W = T (beta k e^G)`` gives ``d(beta k e^G) = -Y h^T`` (``Y = T^T dd``); ``L = I + diag(beta) strict(A_kk)`` gives,
with ``dL`` as the score-gradient stage stored it, the row part ``beta (dL k)`` (e^+G side) and the column part
``dL^T (beta k)`` (e^-G side). This stage stores that part of dk, its part of the gate gradient and dbeta's key
part; the key-channel stage adds the rest. For bf16 inputs without a per-channel decay the score-gradient stage
runs :func:`wy_grads_chunk` itself (``configs.WY_FUSED``) and this launch is skipped.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs
from .configs import CHUNK, Shapes
from .gates import block_span, chunk_span
from .launch import launch_kernel
from .layout import load_gate_rows, load_rows, load_state, locate_chunk, store_rows
from .numerics import exp2, masked_exp2, mm, total
from .scores import FAST_BLOCK, intra_cols, intra_rows
from .switches import CHANNEL_DECAY, SCALAR_DECAY, Decay


@triton.jit
def wy_grads_kernel(k, beta, G, hs, Y, dL_in, dk, dbeta, dg, cu_seqlens, T, H, N, K, V,
                    DECAY: tl.constexpr,
                    C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    SPAN: tl.constexpr, CSPAN: tl.constexpr, KP: tl.constexpr):
    """The delta rule's key gradients through its WY factors, for one chunk; ``grads_kernel`` adds the rest.

    W = T (beta k e^G) gives d(beta k e^G) = -Y h^T; L = I + diag(beta) strict(A_kk) gives, with
    dL as stored by ``score_grads_kernel``, the row part beta (dL k) (e^+G side) and the column part
    dL^T (beta k) (e^-G side). Stores that part of dk to ``dk`` (input dtype), its gate gradient
    k (dk parts, e^-G parts negated) to ``dg`` (CHANNEL_DECAY: [tokens, H, K]; SCALAR_DECAY: summed over the
    channels, [tokens, H]; before the reverse cumulative sum) and adds the key part of dbeta,
    sum_k k (e^G (-Y h^T) + dL k), to ``dbeta``, which holds its value part. Per-channel decays take both
    parts by one product each where the chunk's gates fall by at most 2^-CSPAN over it (:func:`chunk_span`,
    KP: K padded to a power of 2; :func:`_wy_one_ref`), as ``grads_kernel`` does. Grid (slots, H).
    A kernel of its own rather than a part of ``grads_kernel``, whose registers it would fill (one 8-warp program
    per SM).
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    db = load_gate_rows(dbeta, t0, nrows, h, H, tl.arange(0, C))
    wy_grads_chunk(k, beta, G, hs, Y, dL_in, dk, dbeta, dg, db, slot, h, t0, nrows, H, K, V, DECAY, C, SB, BK, BV,
                   SPAN, CSPAN, KP)


@triton.jit
def wy_grads_chunk(k, beta, G, hs, Y, dL_in, dk, dbeta, dg, db, slot, h, t0, nrows, H, K, V, DECAY: tl.constexpr,
                   C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPAN: tl.constexpr,
                   CSPAN: tl.constexpr, KP: tl.constexpr):
    """The body of :func:`wy_grads_kernel` for one chunk, given dbeta's value part db [C] (which it completes and
    stores); also run by ``score_grads_kernel`` (WY) right after it stores Y and dL. A per-channel decay's chunk
    within ``gates.chunk_span``'s bound takes :func:`_wy_one_ref`; the others ``scores.intra_rows`` and
    ``intra_cols``: by blocks of ``scores.FAST_BLOCK`` rows where no gate falls by more than 2^-SPAN inside one
    (``gates.block_span``), else pairwise inside sub-blocks of SB rows."""
    # the products that read dL: in its dtype, but for per-channel decays in tf32 on a bf16 dL widened
    # WORKAROUND(triton 3.6, sm_90): per-channel decays' bf16 products on dL give a wrong dk (K = 100)
    LT: tl.constexpr = dL_in.dtype.element_ty if DECAY != CHANNEL_DECAY else tl.float32
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    rows = tl.arange(0, C)
    valid = rows < nrows
    Klive = tl.where(nrows > 0, K, 0)  # key columns to read (none in an idle slot)
    b = load_gate_rows(beta, t0, nrows, h, H, rows)
    one_ref = False
    if DECAY == CHANNEL_DECAY:
        one_ref = chunk_span(G, t0, nrows, h, H, K, KP) <= CSPAN
    if one_ref:  # a runtime branch: the constexpr test keeps the other decay kinds, whose G is None, from compiling it
        if DECAY == CHANNEL_DECAY:
            for k0 in range(0, K, BK):
                db = _wy_one_ref(k, G, hs, Y, dL_in, dk, dg, b, db, slot, h, t0, nrows, H, K, V,
                                 k0 + tl.arange(0, BK), LT, C, BV, X)
    else:
        blocks = False
        if DECAY == SCALAR_DECAY:
            Gr = load_gate_rows(G, t0, nrows, h, H, rows)
            dGk = tl.full([C], 0.0, tl.float32)
        elif DECAY == CHANNEL_DECAY:
            blocks = block_span(G, t0, nrows, h, H, K, C, FAST_BLOCK, BK) <= SPAN
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False).to(tl.float32)
            dkW = _less_y_h(tl.full([C, BK], 0.0, tl.float32), Y, hs, slot, h, t0, nrows, H, K, V, Klive, rows, cols,
                            BV, X)
            if DECAY == CHANNEL_DECAY:
                Gk = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
                dkW = dkW * exp2(Gk)
            elif DECAY == SCALAR_DECAY:
                Gk = Gr
                dkW = dkW * exp2(Gr)[:, None]
            else:
                Gk = tl.full([C, BK], 0.0, tl.float32)
            R = intra_rows(dL_in, k, G, Gk, t0, nrows, h, H, K, cols, blocks, LT, DECAY, 1, C, SB, X)
            db += total(kt * (dkW + R), 1)
            rowpart = b[:, None] * (dkW + R)
            Ccol = intra_cols(dL_in, k, beta, G, Gk, t0, nrows, h, H, K, cols, blocks, LT, DECAY, 1, 0, 1, C, SB, X)
            store_rows(dk, rowpart + Ccol, t0, nrows, h, H, K, rows, cols)
            if DECAY == CHANNEL_DECAY:
                store_rows(dg, kt * (rowpart - Ccol), t0, nrows, h, H, K, rows, cols)
            elif DECAY == SCALAR_DECAY:
                dGk += total(kt * (rowpart - Ccol), 1)
        if DECAY == SCALAR_DECAY:
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
    """:func:`wy_grads_chunk` for key columns ``cols`` of a chunk whose per-channel gates fall by at most 2^-CSPAN
    over it: every decay splits at the chunk's start (``e^(G_t - G_s) = e^G_t e^-G_s``, the right factor at most
    2^CSPAN), so the row part is ``b e^G (dL (k e^-G) - Y h^T)``, one accumulator for both products, and the column
    part ``e^-G (dL^T (b k e^G))``. Stores dk's and dg's parts; returns db plus its key part.

    Against the pairwise path's functions (``scores.intra_rows``, ``intra_cols``) on these chunks: one load of G
    and of k per block, two exponentials per element instead of five, one [C, BK] tile fewer; the G and k loads go
    ahead of the Y h^T loop, which hides them.
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


def wy_grads(plan: dict, s: Shapes, *, k: torch.Tensor, beta: torch.Tensor, G: Optional[torch.Tensor],
             hs: torch.Tensor, Y: torch.Tensor, dL: torch.Tensor, dk: torch.Tensor, dbeta: torch.Tensor,
             dg: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], decay: Decay) -> None:
    """dk's WY part -> dk [B, T, H, K], the gate gradient's -> dg ([B, T, H, K] per channel, [B, T, H] summed over
    the channels for a scalar decay; before the reverse cumulative sum), dbeta [B, T, H] fp32 completed (it holds
    the value part). Y [B, T, H, V] and dL [B, T, H, C]: from the score-gradient stage; hs: the chunk-start
    states [slots, H, K, V]."""
    launch_kernel(plan, "wy_grads_vector" if decay == Decay.CHANNEL else "wy_grads", wy_grads_kernel,
                  (s.slots, s.H), k, beta, G, hs, Y, dL, dk, dbeta, dg, cu_seqlens, s.T, s.H, s.N, s.K, s.V,
                  DECAY=decay, C=CHUNK, SB=configs.PAIR_SUB, BK=s.wy_BK(decay), BV=s.BV, SPAN=configs.BLOCK_SPAN,
                  CSPAN=configs.CHUNK_SPAN, KP=s.BKF)
