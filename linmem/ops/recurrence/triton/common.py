"""Pieces shared by the Triton kernels of the unified recurrence.

Layout conventions of every kernel (DESIGN.md section 3):

* activations are read as ``[tokens, H, D]`` with ``tokens = B * T`` (fixed length) or the
  packed varlen axis; sequence ``n`` owns tokens ``[bos, eos)``;
* a sequence is cut into chunks of ``C`` tokens; chunk ``c`` of sequence ``n`` has a *slot*
  (``first_slot(n) + c``) in the per-chunk buffers (chunk-start states ``[slots, H, K, V]``);
  for varlen batches ``first_slot(n) = bos // C + n``, which never overlaps and needs no
  host synchronisation; a few slots stay idle and every kernel masks them out;
* gates arrive as chunk-local cumulative sums ``G`` (fp32) in log2 units (``log2(e)`` times the
  cumulative log decay, written by ``chunk_cumsum_kernel``); a decay between two tokens is
  always ``2^`` of a non-positive difference of them (``exp2``), masked *before* the ``exp2``.

Per-channel decays: across sub-blocks of ``SB`` tokens the reference point ``R_j`` (the
cumulative gate at the end of sub-block j) splits ``exp(G_t - G_s) = exp(G_t - R_j) exp(R_j - G_s)``
for s in sub-block j into two factors <= 1 that enter a matrix product. Each side takes one
exponential per row and channel, against the nearest reference point: ``exp(R_j - G_s)`` for s in
sub-block j, and ``exp(G_t - R_(i-1))`` for t in sub-block i, carried to an earlier reference by the
factors ``exp(R_m - R_(m-1)) <= 1`` (per channel) as the loop over j walks past sub-block m. Pairs
inside a sub-block take the same split at the row before it when no gate falls by more than
``2^-SPAN`` there (``launch.BLOCK_SPAN``; the right factor is then at most 2^SPAN, finite), and one
exponential per pair and channel otherwise (the pairwise loops). Before either, a chunk whose gates fall by
at most ``2^-CSPAN`` over the whole chunk (``launch.CHUNK_SPAN``, :func:`chunk_span`) needs no reference
point but its start: ``exp(G_t - G_s) = exp(G_t) exp(-G_s)``, one product, as for a scalar decay.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: chunk length of the chunked algorithm
CHUNK = 64
#: sub-block length of the delta rule's blockwise inverse (C = 4 SUB)
SUB = 16
#: row block of the per-channel decays' products without pairwise exponentials (``_block_scores``, the fast
#: path of ``intra_grads_kernel`` takes ``launch.INTRA_ROWS``)
FAST_BLOCK: tl.constexpr = tl.constexpr(16)
#: log2(e): the cumulative gates G of the chunk kernels are log2(e) times the cumulative log decays
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
#: True when the kernels run on the CPU through the Triton interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_INTERP: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def total(x, axis: tl.constexpr):
    """tl.sum, spelled with Triton builtins only.

    ``triton.language``'s own helpers are jit functions fixed when ``triton`` is imported; these
    work in the interpreter even when TRITON_INTERPRET=1 was set only after that import.
    """
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def largest(x, axis: tl.constexpr):
    """tl.max, spelled with Triton builtins only (see :func:`total`)."""
    return tl.reduce(x, axis, _larger)


@triton.jit
def running_total(x, axis: tl.constexpr):
    """tl.cumsum (inclusive), spelled with Triton builtins only (see :func:`total`)."""
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def remaining_total(x, axis: tl.constexpr):
    """The reverse inclusive cumulative sum (element i: the sum of elements i, i + 1, ... along axis), spelled
    with Triton builtins only (see :func:`total`)."""
    return tl.associative_scan(x, axis, tl.standard._sum_combine, reverse=True)


@triton.jit
def rounded(x, DT: tl.constexpr):
    """x rounded to DT (round to nearest even), as DT.

    The interpreter truncates fp32 -> bf16; there the rounding is done on the bits first, so
    the CPU sees the same precision as the GPU.
    """
    if _INTERP and DT == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def mm(a, b, DT: tl.constexpr, X: tl.constexpr):
    """a @ b with both operands rounded to the dot dtype DT, fp32 accumulation.

    X: the kernel's inputs are fp32, so products keep about fp32's accuracy: three tf32 tensor-core
    products (``tf32x3``; the IEEE fp32 products before session 23 ran 1.5 to 13 times slower, their
    kernels compiled to up to 10 KB of spills). fp32 intermediates of bf16/fp16 inputs use tf32
    products. The interpreter multiplies bf16 bit patterns as integers, so there the rounded operands
    are widened to fp32.
    """
    a = rounded(a, DT)
    b = rounded(b, DT)
    if _INTERP:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if X and DT == tl.float32:
        acc = tl.dot(a, b, input_precision="tf32x3")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def bf16_parts(x):
    """fp32 x as (hi, lo): its bf16 rounding and the bf16 rounding of the remainder, whose sum keeps about 16 of x's
    mantissa bits (the operands of :func:`mm_split` and :func:`mm_parts`)."""
    hi = rounded(x, tl.bfloat16)
    return hi, bf16_rest(x, hi)


@triton.jit
def bf16_rest(x, hi):
    """The bf16 rounding of x - hi, for fp32 x and its bf16 rounding hi (the lo of :func:`bf16_parts`)."""
    return rounded(x - hi.to(tl.float32), tl.bfloat16)


@triton.jit
def mm_split(a, b):
    """a @ b as bf16 products, for bf16 or fp32 operands: an fp32 operand is split into ``hi`` (rounded to bf16)
    and ``lo`` (the rest, rounded to bf16), which keeps about 16 of its mantissa bits (tf32 keeps 10) without an
    fp32 copy of the other operand. ``hi a @ hi b``, then ``hi a @ lo b`` and ``lo a @ hi b`` where those exist
    (the product of two remainders is left out). fp32 accumulation."""
    ah = rounded(a, tl.bfloat16)
    bh = rounded(b, tl.bfloat16)
    if a.dtype != tl.bfloat16:
        al = bf16_rest(a, ah)
    if b.dtype != tl.bfloat16:
        bl = bf16_rest(b, bh)
    if _INTERP:
        ah = ah.to(tl.float32)
        bh = bh.to(tl.float32)
        if a.dtype != tl.bfloat16:
            al = al.to(tl.float32)
        if b.dtype != tl.bfloat16:
            bl = bl.to(tl.float32)
    acc = tl.dot(ah, bh)
    if b.dtype != tl.bfloat16:
        acc = tl.dot(ah, bl, acc)
    if a.dtype != tl.bfloat16:
        acc = tl.dot(al, bh, acc)
    return acc


@triton.jit
def mm_parts(ah, al, b):
    """(ah + al) @ b as two bf16 products, for an fp32 left factor already split into its bf16 part ah and the bf16
    rounding of its remainder al (:func:`bf16_parts`, done once where the factor is reused), b bf16. fp32
    accumulation."""
    if _INTERP:
        ah = ah.to(tl.float32)
        al = al.to(tl.float32)
        b = b.to(tl.float32)
    acc = tl.dot(ah, b)
    return tl.dot(al, b, acc)


@triton.jit
def mm_wide(a, b, X: tl.constexpr):
    """a @ b for a stored score gradient a (bf16, or fp32 for fp16 and fp32 inputs) and an fp32 b of any range (a
    per-channel decay's factors, up to 2^CHUNK_SPAN). A bf16 a enters the tensor cores as loaded, b as its bf16
    parts (:func:`mm_split`: two bf16 products, about 16 of b's mantissa bits); an fp32 a takes one tf32 product
    (tf32x3 for fp32 inputs, X). fp32 accumulation.

    ``grads_kernel`` takes it for a per-channel decay's one-reference chunks (not RWKV-6's). There, one tf32
    product on the widened bf16 dA spent about a tenth of the warp samples on the widening and its change of layout
    (the transposed dA through shared memory 16 bits at a time; Nsight Compute, KDA at 4 x 4096, session 32). b keeps
    16 mantissa bits instead of tf32's 10. Measured on an H200 (session 32, 4 x 4096, H = 16, K = V = 128, bf16),
    grads_kernel ms: kda 0.630 -> 0.579, gla 0.564 -> 0.506; error ratios against float64 the same or lower.
    Where it did not land: KDA's WY products on dL (``chunk_bwd._wy_one_ref``: score_grads 0.451 -> 0.449, and on the
    H200 dk came out wrong at K = 100, V = 72 and differed between the fused and separate WY kernels at K = 80, which
    the CPU interpreter passed, as session 18's bf16 products on dL did); ``intra_grads_kernel``'s [16, 16] products
    (slower: 0.322 -> 0.363 ms at gates x10, 0.684 -> 0.780 at x100; sm_90 stack 0 -> 112 bytes); RWKV-6's
    one-reference products (0.819 -> 0.887)."""
    if a.dtype == tl.bfloat16:
        return mm_split(a, b)
    return mm(a, b, tl.float32, X)


@triton.jit
def sequence_bounds(n, cu_seqlens, T, IS_VARLEN: tl.constexpr):
    """First and one-past-last token of sequence n (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def first_slot(n, bos, T, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Slot of the first chunk of sequence n (see the module docstring)."""
    if IS_VARLEN:
        slot = bos // C + n
    else:
        slot = n.to(tl.int64) * ((T + C - 1) // C)
    return slot


@triton.jit
def locate_chunk(slot, cu_seqlens, N, T, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The chunk behind a slot: (sequence n, first token t0, valid rows nrows; nrows <= 0 if idle).

    Varlen: a binary search for the last sequence whose first slot is <= slot.
    """
    if IS_VARLEN:
        lo = slot * 0
        hi = lo + N - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = tl.load(cu_seqlens + mid).to(tl.int64) // C + mid <= slot
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        n = lo
    else:
        n = slot // ((T + C - 1) // C)
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    t0 = bos + (slot - first_slot(n, bos, T, C, IS_VARLEN)) * C
    nrows = tl.minimum(eos - t0, C)
    return n, t0, nrows


@triton.jit
def sequence_state(cu_seqlens, T, H, C: tl.constexpr, IS_VARLEN: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr):
    """The start of a sequential pass's program (grid: V blocks x N * H).

    Returns (n, h, bos, eos, first slot, the first state tile's key rows [KB], value range [BV], chunk rows [C]).
    """
    vb, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    s0 = first_slot(n, bos, T, C, IS_VARLEN)
    return n, h, bos, eos, s0, tl.arange(0, KB), vb * BV + tl.arange(0, BV), tl.arange(0, C)


@triton.jit
def end_decay(G, t0, nrows, h, H, K, kb, DECAY: tl.constexpr):
    """A chunk's total decay in log2 units, G at its last row: a scalar (DECAY 1, G [tokens, H]) or
    [KB] at key channels kb (DECAY 2, G [tokens, H, K]; 0 past K and for an empty chunk, nrows 0, which
    a pass loading its gates a chunk ahead asks for past its sequence's first chunk)."""
    if DECAY == 1:
        last = tl.load(G + (t0 + nrows - 1) * H + h)
    else:
        last = tl.load(G + ((t0 + nrows - 1) * H + h) * K + kb, mask=kb < tl.where(nrows > 0, K, 0), other=0.0)
    return last


@triton.jit
def end_gates(G, t0, nrows, h, H, K, kb0, NKB: tl.constexpr):
    """:func:`end_decay` of a per-channel decay for the NKB (1, 2 or 4) state tiles of len(kb0) key rows from kb0:
    four [KB] fp32 vectors, those past NKB repeating the first."""
    KB: tl.constexpr = kb0.shape[0]
    g0 = end_decay(G, t0, nrows, h, H, K, kb0, 2)
    g1, g2, g3 = g0, g0, g0
    if NKB > 1:
        g1 = end_decay(G, t0, nrows, h, H, K, kb0 + KB, 2)
    if NKB > 2:
        g2 = end_decay(G, t0, nrows, h, H, K, kb0 + 2 * KB, 2)
        g3 = end_decay(G, t0, nrows, h, H, K, kb0 + 3 * KB, 2)
    return g0, g1, g2, g3


@triton.jit
def first_state_tiles(init, PRESENT: tl.constexpr, n, h, H, K, V, kb0, vr, NKB: tl.constexpr):
    """Sequence n's state in ``init`` as NKB tiles (1, 2 or 4) of len(kb0) key rows from kb0, fp32 (see
    :func:`first_state`); the tiles past NKB are returned as the first, unused."""
    KB: tl.constexpr = kb0.shape[0]
    S0 = first_state(init, PRESENT, n, h, H, K, V, kb0, vr)
    S1, S2, S3 = S0, S0, S0
    if NKB > 1:
        S1 = first_state(init, PRESENT, n, h, H, K, V, kb0 + KB, vr)
    if NKB > 2:
        S2 = first_state(init, PRESENT, n, h, H, K, V, kb0 + 2 * KB, vr)
        S3 = first_state(init, PRESENT, n, h, H, K, V, kb0 + 3 * KB, vr)
    return S0, S1, S2, S3


@triton.jit
def store_state_tiles(ptr, S0, S1, S2, S3, idx, h, H, K, V, kb0, vr, NKB: tl.constexpr):
    """The first NKB tiles of a state held as tiles of len(kb0) key rows from kb0 -> S[idx, h] (see
    :func:`store_state`)."""
    KB: tl.constexpr = kb0.shape[0]
    store_state(ptr, S0, idx, h, H, K, V, kb0, vr, False)
    if NKB > 1:
        store_state(ptr, S1, idx, h, H, K, V, kb0 + KB, vr, False)
    if NKB > 2:
        store_state(ptr, S2, idx, h, H, K, V, kb0 + 2 * KB, vr, False)
        store_state(ptr, S3, idx, h, H, K, V, kb0 + 3 * KB, vr, False)


@triton.jit
def first_state(init, PRESENT: tl.constexpr, n, h, H, K, V, kr, vr):
    """Rows kr, columns vr of sequence n's state in ``init`` [N, H, K, V] as fp32, or zeros when not PRESENT."""
    if PRESENT:
        S = load_state(init, n, h, H, K, V, kr, vr, K, False).to(tl.float32)
    else:
        S = tl.full([kr.shape[0], vr.shape[0]], 0.0, tl.float32)
    return S


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


@triton.jit
def load_rows(ptr, t0, nrows, h, H, D, r, cols, TRANS: tl.constexpr):
    """x[t0 + r, h, cols] of a [tokens, H, D] tensor, in its dtype: [R, BD], or [BD, R] if TRANS.

    Rows outside [0, nrows) and columns >= D read as 0.
    """
    ok_r = (r >= 0) & (r < nrows)
    ok_c = cols < D
    base = ptr + (t0 * H + h) * D  # 64-bit scalar base, 32-bit offsets
    if TRANS:
        x = tl.load(base + r[None, :] * (H * D) + cols[:, None], mask=ok_r[None, :] & ok_c[:, None], other=0.0)
    else:
        x = tl.load(base + r[:, None] * (H * D) + cols[None, :], mask=ok_r[:, None] & ok_c[None, :], other=0.0)
    return x


@triton.jit
def store_rows(ptr, x, t0, nrows, h, H, D, r, cols):
    """x[R, BD] -> y[t0 + r, h, cols] for the valid rows and columns."""
    p = ptr + (t0 * H + h) * D + r[:, None] * (H * D) + cols[None, :]
    m = ((r >= 0) & (r < nrows))[:, None] & (cols < D)[None, :]
    tl.store(p, rounded(x, ptr.dtype.element_ty), mask=m)


@triton.jit
def store_rows_t(ptr, xT, t0, nrows, h, H, D, r, cols):
    """xT[BD, R] -> y[t0 + r, h, cols] for the valid rows and columns: the transpose of
    :func:`store_rows`, writing the layout ``load_rows(TRANS=True)`` reads."""
    p = ptr + (t0 * H + h) * D + r[None, :] * (H * D) + cols[:, None]
    m = ((r >= 0) & (r < nrows))[None, :] & (cols < D)[:, None]
    tl.store(p, rounded(xT, ptr.dtype.element_ty), mask=m)


@triton.jit
def load_gate_rows(ptr, t0, nrows, h, H, r):
    """One value per token: g[t0 + r, h] of a [tokens, H] tensor as fp32 (0 outside the chunk)."""
    ok = (r >= 0) & (r < nrows)
    return tl.load(ptr + (t0 * H + h) + r * H, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def scalar_gates(G, t0, nrows, h, H, rows):
    """A scalar decay's cumulative gates of one chunk (G [tokens, H], log2 units): ``(G at its rows [C],
    0 outside the chunk; G at its last row, 0 for an empty chunk (nrows 0))``."""
    Gr = load_gate_rows(G, t0, nrows, h, H, rows)
    last = tl.load(G + (t0 + nrows - 1) * H + h, mask=nrows > 0, other=0.0)
    return Gr, last


@triton.jit
def load_state(ptr, idx, h, H, K, V, kr, vr, nk, TRANS: tl.constexpr):
    """S[idx, h, kr, vr] of a [*, H, K, V] state buffer, in its dtype: [BK, BV], or [BV, BK] if TRANS.

    Only key rows < nk are read (nk = K, or 0 to read nothing); the rest is 0.
    """
    base = ptr + (idx.to(tl.int64) * H + h) * K * V
    if TRANS:
        m = (kr[None, :] < nk) & (vr[:, None] < V)
        x = tl.load(base + kr[None, :] * V + vr[:, None], mask=m, other=0.0)
    else:
        m = (kr[:, None] < nk) & (vr[None, :] < V)
        x = tl.load(base + kr[:, None] * V + vr[None, :], mask=m, other=0.0)
    return x


@triton.jit
def store_state(ptr, x, idx, h, H, K, V, kr, vr, TRANS: tl.constexpr):
    """x[BK, BV] (or x[BV, BK] if TRANS) -> S[idx, h, kr, vr] of a [*, H, K, V] buffer."""
    base = ptr + (idx.to(tl.int64) * H + h) * K * V
    if TRANS:
        m = (kr[None, :] < K) & (vr[:, None] < V)
        tl.store(base + kr[None, :] * V + vr[:, None], rounded(x, ptr.dtype.element_ty), mask=m)
    else:
        m = (kr[:, None] < K) & (vr[None, :] < V)
        tl.store(base + kr[:, None] * V + vr[None, :], rounded(x, ptr.dtype.element_ty), mask=m)


@triton.jit
def exp2(x):
    """2^x of fp32 x as one ``ex2.approx.ftz`` (results under 2^-126 flush to 0); tl.exp2 in the interpreter.

    tl.exp compiles to the same instruction plus a multiply by log2(e) and three instructions that
    keep results in the subnormal range, which no decay here needs. The chunk kernels keep their
    cumulative gates in log2 units, so each decay is this one instruction.
    """
    if _INTERP:
        y = tl.exp2(x)
    else:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return y


@triton.jit
def exp(x):
    """e^x of fp32 x (see :func:`exp2`)."""
    return exp2(x * LOG2E)


@triton.jit
def masked_exp2(mask, x):
    """2^x where mask, exactly 0 elsewhere (the exponent is masked first, so nothing overflows)."""
    return exp2(tl.where(mask, x, float("-inf")))


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
    if DECAY == 2:
        # one path for the whole chunk, a loop each (a choice per key block inside one loop measured the same:
        # gla's output kernel 0.688 against 0.689 ms by products, before launch.MAX_REGISTERS capped the two paths)
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
        if DECAY == 1:
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
    gradient of; for DECAY 1 it already carries the decays (then this is a plain product).
    Gx: [C, BK] (DECAY 2), G of the chunk's rows. With ``blocks`` (a chunk within :func:`block_span`'s bound) the
    decays split at the blocks' starts (:func:`_block_rows`); otherwise at the sub-blocks' reference points, and
    pairwise inside them, for a chunk of any gates (``chunk_bwd._wy_one_ref`` takes the chunks within
    :func:`chunk_span`'s bound in one product). Products run in dtype MT.
    """
    rows = tl.arange(0, C)
    if DECAY != 2:
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
    (DECAY 2), G of the chunk's rows, taken as in :func:`intra_rows` (``blocks`` only without SHIFT:
    :func:`_block_cols`). Products run in dtype MT.
    """
    rows = tl.arange(0, C)
    valid = rows < nrows
    x = load_rows(x_ptr, t0, nrows, h, H, K, rows, cols, False)
    dST = load_rows(dS, t0, nrows, h, H, C, rows, rows, True)  # [s, t]
    if WEIGHTED:
        x = x * load_gate_rows(w_ptr, t0, nrows, h, H, rows)[:, None]
    if DECAY != 2:
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
