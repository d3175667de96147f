"""Stage 5 of the backward (per-channel decays): the intra-chunk parts of dq and dk, by blocks of rows.

``dqi[t] = sum_s dA[t, s] k_s e^(Gq_t - G_s)`` and ``dki[s] = sum_t dA[t, s] q_t e^(Gq_t - G_s)`` over the score
pairs, for the chunks whose gates fall too far for the key-channel stage's one-reference products
(``gates.chunk_span``); the other chunks' programs stop after that check.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs
from .configs import CHUNK, Shapes, cdiv
from .gates import chunk_span
from .launch import launch_kernel
from .layout import load_rows, locate_chunk, store_rows
from .numerics import exp2, largest, masked_exp2, mm


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
                       BONUS: tl.constexpr,
                       C: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
                       CSPAN: tl.constexpr, KP: tl.constexpr):
    """Per-channel decays: the intra-chunk parts of dq and dk for one block of RB rows of a chunk and
    BK key channels, which ``grads_kernel`` completes; only in chunks whose gates fall by more than
    2^-CSPAN over the chunk (``gates.chunk_span``, KP: K padded to a power of 2): ``grads_kernel`` takes the
    others' from two products of its own. Those chunks' programs stop after that check, one load of the last
    row's gates. (One program per chunk looping over its blocks would stop sooner, but at twice the registers it
    slows the other chunks' work more.)

    dqi[t] = sum_s dA[t, s] k_s e^(Gq_t - G_s),  dki[s] = sum_t dA[t, s] q_t e^(Gq_t - G_s)
    over the score pairs (s <= t; s < t and Gq_t = G_(t-1) with the bonus): [tokens, H, K] fp32.
    Every decay splits at a reference point R between its two rows, so both factors are <= 1:
    - the blocks before this one, for dq: R0 = G at the row before the block, one product
      dA[block, j] (k_j e^(R0 - G_j)) per block j;
    - the blocks after it, for dk: R1 = G at the block's last row, one product per block;
    - pairs across the block's two halves of RB / 2 rows: Rm = G at the first half's last row, one
      masked product per side. The second half's rows then take Rm as their reference for dq (the
      earlier blocks' sum carried there by e^(Rm - R0)), the first half's for dk (by e^(R1 - Rm));
    - pairs inside a half: one exponential per pair and channel (half the pairwise exponentials of the whole
      block).
    Where no gate of the block's channels falls by more than 2^-SPAN over the block (R0 - R1 <= SPAN),
    its own pairs go through R0 (dq) and R1 (dk) as well, in one more product per side, with factors up
    to 2^SPAN and no exponential per pair.
    Grid (K blocks, slots * C / RB, H).
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
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


def intra_grads(plan: dict, s: Shapes, *, q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, dA: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor], bonus: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dqi, dki) [B, T, H, K] fp32 from q, k [B, T, H, K], G [B, T, H, K] fp32 and dA [B, T, H, C]."""
    dqi, dki = torch.empty_like(q, dtype=torch.float32), torch.empty_like(k, dtype=torch.float32)
    grid = (cdiv(s.K, s.BK), s.slots * (CHUNK // configs.INTRA_ROWS), s.H)
    launch_kernel(plan, "intra_grads", intra_grads_kernel, grid, q, k, G, dA, dqi, dki, cu_seqlens, s.T, s.H, s.N,
                  s.K, BONUS=int(bonus), C=CHUNK, RB=configs.INTRA_ROWS, BK=s.BK, SPAN=configs.BLOCK_SPAN,
                  CSPAN=configs.CHUNK_SPAN, KP=s.BKF)
    return dqi, dki
