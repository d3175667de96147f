"""Where a kernel's tokens, chunks and states live, and the tile loads and stores that follow from it.

* Activations are read as ``[tokens, H, D]`` with ``tokens = B * T`` (fixed length) or the packed varlen axis;
  sequence ``n`` owns tokens ``[bos, eos)``.
* A sequence is cut into chunks of ``C`` tokens. Chunk ``c`` of sequence ``n`` has a *slot* (``first_slot(n) +
  c``) in the per-chunk buffers (chunk-start states ``[slots, H, K, V]``). For varlen batches ``first_slot(n) =
  bos // C + n``, which never overlaps and needs no host synchronisation; a few slots stay idle and every kernel
  masks them out.
* A sequential pass holds its state as up to four tiles of ``KB`` key rows (``first_state_tiles``,
  ``store_state_tiles``), each with its own loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import rounded


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
def first_state(init, PRESENT: tl.constexpr, n, h, H, K, V, kr, vr):
    """Rows kr, columns vr of sequence n's state in ``init`` [N, H, K, V] as fp32, or zeros when not PRESENT."""
    if PRESENT:
        S = load_state(init, n, h, H, K, V, kr, vr, K, False).to(tl.float32)
    else:
        S = tl.full([kr.shape[0], vr.shape[0]], 0.0, tl.float32)
    return S


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
