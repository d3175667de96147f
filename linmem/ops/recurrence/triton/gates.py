"""The cumulative gates ``G`` as the kernels read them: chunk-end decays, spans, and reference points.

``G`` is the chunk-local cumulative sum of the log decay in log2 units (``log2(e)`` times it, written by the
cumulative-sum stage), non-increasing along each channel. A decay between two tokens is always ``2^`` of a
non-positive difference of them, masked before the ``exp2``.

Per-channel decays: across sub-blocks of ``SB`` tokens the reference point ``R_j`` (the cumulative gate at the
end of sub-block j) splits ``exp(G_t - G_s) = exp(G_t - R_j) exp(R_j - G_s)`` for s in sub-block j into two
factors <= 1 that enter a matrix product. Each side takes one exponential per row and channel, against the
nearest reference point: ``exp(R_j - G_s)`` for s in sub-block j, and ``exp(G_t - R_(i-1))`` for t in sub-block
i, carried to an earlier reference by the factors ``exp(R_m - R_(m-1)) <= 1`` (per channel) as the loop over j
walks past sub-block m. :func:`chunk_span` and :func:`block_span` measure how far the gates fall over a chunk or
a block of rows, which picks the cheaper paths of ``scores.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout import load_gate_rows, load_rows
from .numerics import exp2, largest, masked_exp2, total
from .switches import CHANNEL_DECAY, SCALAR_DECAY


@triton.jit
def end_decay(G, t0, nrows, h, H, K, kb, DECAY: tl.constexpr):
    """A chunk's total decay in log2 units, G at its last row: a scalar (SCALAR_DECAY, G [tokens, H]) or
    [KB] at key channels kb (CHANNEL_DECAY, G [tokens, H, K]; 0 past K and for an empty chunk, nrows 0, which
    a pass loading its gates a chunk ahead asks for past its sequence's first chunk)."""
    if DECAY == SCALAR_DECAY:
        last = tl.load(G + (t0 + nrows - 1) * H + h)
    else:
        last = tl.load(G + ((t0 + nrows - 1) * H + h) * K + kb, mask=kb < tl.where(nrows > 0, K, 0), other=0.0)
    return last


@triton.jit
def end_gates(G, t0, nrows, h, H, K, kb0, NKB: tl.constexpr):
    """:func:`end_decay` of a per-channel decay for the NKB (1, 2 or 4) state tiles of len(kb0) key rows from kb0:
    four [KB] fp32 vectors, those past NKB repeating the first."""
    KB: tl.constexpr = kb0.shape[0]
    g0 = end_decay(G, t0, nrows, h, H, K, kb0, CHANNEL_DECAY)
    g1, g2, g3 = g0, g0, g0
    if NKB > 1:
        g1 = end_decay(G, t0, nrows, h, H, K, kb0 + KB, CHANNEL_DECAY)
    if NKB > 2:
        g2 = end_decay(G, t0, nrows, h, H, K, kb0 + 2 * KB, CHANNEL_DECAY)
        g3 = end_decay(G, t0, nrows, h, H, K, kb0 + 3 * KB, CHANNEL_DECAY)
    return g0, g1, g2, g3


@triton.jit
def scalar_gates(G, t0, nrows, h, H, rows):
    """A scalar decay's cumulative gates of one chunk (G [tokens, H], log2 units): ``(G at its rows [C],
    0 outside the chunk; G at its last row, 0 for an empty chunk (nrows 0))``."""
    Gr = load_gate_rows(G, t0, nrows, h, H, rows)
    last = tl.load(G + (t0 + nrows - 1) * H + h, mask=nrows > 0, other=0.0)
    return Gr, last


@triton.jit
def chunk_span(G_ptr, t0, nrows, h, H, K, KP: tl.constexpr):
    """The most a per-channel gate falls over a whole chunk, from its start to its last valid row (log2 units;
    G is 0 before the chunk and non-increasing along each channel): a scalar, 0 for an idle chunk. One load of
    the last row's KP >= K channels."""
    cols = tl.arange(0, KP)
    last = tl.load(G_ptr + ((t0 + nrows - 1) * H + h) * K + cols, mask=cols < tl.where(nrows > 0, K, 0), other=0.0)
    return largest(-last, 0)


@triton.jit
def block_span(G_ptr, t0, nrows, h, H, K, C: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr):
    """The most a per-channel gate falls inside one block of RB rows of a chunk, from the row before the block
    to its last valid row (log2 units; G non-increasing along each channel): a scalar, 0 for an idle chunk."""
    j = tl.arange(0, C // RB)
    live = (j * RB < nrows)[:, None]
    span = total(tl.full([C // RB], 0.0, tl.float32), 0)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        before = load_rows(G_ptr, t0, nrows, h, H, K, j * RB - 1, cols, False)
        last = load_rows(G_ptr, t0, nrows, h, H, K, tl.minimum(j * RB + RB - 1, nrows - 1), cols, False)
        span = tl.maximum(span, largest(largest(tl.where(live, before - last, 0.0), 1), 0))
    return span


@triton.jit
def ref_point(G_ptr, t0, nrows, h, H, K, cols, j, SB: tl.constexpr):
    """R_j: G at the last valid row of sub-block j ([BK]; 0 for j < 0 or an idle slot)."""
    ref = tl.minimum((j + 1) * SB - 1, nrows - 1)
    return tl.load(G_ptr + ((t0 + ref) * H + h) * K + cols, mask=cols < tl.where(ref >= 0, K, 0), other=0.0)


@triton.jit
def row_refs(G_ptr, t0, nrows, h, H, K, cols, rows, SB: tl.constexpr, AFTER: tl.constexpr, TRANS: tl.constexpr):
    """Per row t of a chunk, the nearest reference point: R of the sub-block before t's (the
    query side; 0 in sub-block 0) or, if AFTER, of t's own sub-block (the key side). [C, BK], or
    [BK, C] if TRANS."""
    blk = rows // SB
    if AFTER:
        r = tl.minimum(blk * SB + SB - 1, nrows - 1)
    else:
        r = blk * SB - 1
    return load_rows(G_ptr, t0, nrows, h, H, K, r, cols, TRANS)


@triton.jit
def since_ref(Gx, G_ptr, t0, nrows, h, H, K, cols, rows, SB: tl.constexpr):
    """The query side's decay from its nearest reference point, 2^(Gx_t - R_(blk(t)-1)): [C, BK] (0 on
    rows past the chunk's end)."""
    return masked_exp2((rows < nrows)[:, None], Gx - row_refs(G_ptr, t0, nrows, h, H, K, cols, rows, SB, False, False))


@triton.jit
def to_ref(Gs, G_ptr, t0, nrows, h, H, K, cols, rows, SB: tl.constexpr, TRANS: tl.constexpr,
           BEFORE: tl.constexpr):
    """The key side's decay to the reference point of its own sub-block, 2^(R_blk(s) - G_s) (<= 1), or if BEFORE
    from the row before that sub-block, 2^(R_(blk(s)-1) - G_s) (>= 1): [C, BK], or [BK, C] if TRANS (0 on rows
    past the chunk's end). Gs: G of the chunk's rows, in that layout."""
    R = row_refs(G_ptr, t0, nrows, h, H, K, cols, rows, SB, 1 - BEFORE, TRANS)
    if TRANS:
        mask = (rows < nrows)[None, :]
    else:
        mask = (rows < nrows)[:, None]
    return masked_exp2(mask, R - Gs)


@triton.jit
def carry_left(L, R_j, G_ptr, t0, nrows, h, H, K, cols, j, SB: tl.constexpr):
    """The left factors 2^(Gx_t - R_j) of L carried to 2^(Gx_t - R_(j-1)) by 2^(R_j - R_(j-1)) <= 1:
    (L, R_(j-1))."""
    R_prev = ref_point(G_ptr, t0, nrows, h, H, K, cols, j - 1, SB)
    return L * exp2(R_j - R_prev)[None, :], R_prev
