"""Stage 4 of the forward: the outputs of each chunk, in parallel over chunks.

``A = scale A_qk`` (the intra-chunk scores, stored for the backward) and ``o = scale (q e^Gq) h + A d`` (plus the
RWKV-6 bonus ``scale (q . (u k)) v``), with ``Gq = G`` (``G`` of the previous token with the bonus).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs
from .configs import CHUNK, Shapes
from .launch import launch_kernel
from .layout import load_gate_rows, load_rows, load_state, locate_chunk, store_rows
from .numerics import exp2, mm
from .scores import bonus_scores, chunk_scores
from .switches import CHANNEL_DECAY, SCALAR_DECAY, Decay

#: what :func:`_output_block` does with the decayed queries q e^G of a per-channel decay (its QG): nothing, store
#: them to qg (the first V block of the delta rule's), or read them back from qg (its later V blocks)
QG_NONE: tl.constexpr = tl.constexpr(0)
QG_STORE: tl.constexpr = tl.constexpr(1)
QG_READ: tl.constexpr = tl.constexpr(2)


@triton.jit
def _output_block(q, d, v, G, hs, A, o, qg, qku, eq, slot, t0, nrows, h, H, K, V, rows, vr, scale,
                  DECAY: tl.constexpr, BONUS: tl.constexpr, QG: tl.constexpr, BK: tl.constexpr,
                  HT: tl.constexpr, AT: tl.constexpr, X: tl.constexpr):
    """One V block of the output: scale (q e^Gq) h[:, vr] + A d[:, vr] (+ the bonus) -> o. QG (per-channel
    decays): QG_STORE also stores q e^G -> qg, which the caller asks of its first V block alone; QG_READ reads it
    back from qg (rounded to qg's dtype, as the product rounds it to hs's: the same values). Storing qg from one
    block and reading it back in the others costs less than a runtime test inside the V loop."""
    acc = tl.full([rows.shape[0], vr.shape[0]], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        if QG == QG_READ:
            qt = load_rows(qg, t0, nrows, h, H, K, rows, cols, False)
        else:
            qt = load_rows(q, t0, nrows, h, H, K, rows, cols, False)
            if DECAY == CHANNEL_DECAY:
                qt = qt * exp2(load_rows(G, t0, nrows, h, H, K, rows - BONUS, cols, False))
                if QG == QG_STORE:
                    store_rows(qg, qt, t0, nrows, h, H, K, rows, cols)
        acc += mm(qt, load_state(hs, slot, h, H, K, V, cols, vr, tl.where(nrows > 0, K, 0), False), HT, X)
    if DECAY == SCALAR_DECAY:  # a scalar decay scales the product's rows, and q goes to the tensor cores as loaded
        acc = acc * eq
    out = scale * acc + mm(A, load_rows(d, t0, nrows, h, H, V, rows, vr, False), AT, X)
    if BONUS:
        out += scale * qku[:, None] * load_rows(v, t0, nrows, h, H, V, rows, vr, False)
    store_rows(o, out, t0, nrows, h, H, V, rows, vr)


@triton.jit
def output_kernel(q, k, d, v, G, u, hs, A_out, o, qg, cu_seqlens, scale, T, H, N, K, V,
                  DECAY: tl.constexpr, BONUS: tl.constexpr,
                  C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPAN: tl.constexpr,
                  CSPAN: tl.constexpr, KP: tl.constexpr):
    """Per chunk: A = scale A_qk (stored for the backward), o = scale (q e^Gq) h + A d (+ bonus).

    d: the writes [tokens, H, V] (v, or the delta rule's corrected writes); v: the values
    (read only for the bonus); u: [H, K]; hs: chunk-start states [slots, H, K, V];
    A_out: [tokens, H, C]; o: [tokens, H, V]. qg given (the delta rule with a per-channel decay): also
    store the decayed queries of the inter-chunk product, qg = q e^G ([tokens, H, K], q's dtype), which
    ``state_bwd_kernel`` reads instead of q and G. Grid (slots, H).
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    STORE_QG: tl.constexpr = qg is not None
    HT: tl.constexpr = hs.dtype.element_ty
    AT: tl.constexpr = A_out.dtype.element_ty
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    A = scale * chunk_scores(q, k, G, t0, nrows, h, H, K, DECAY, BONUS, BONUS, C, SB, BK, X, SPAN, CSPAN, KP)
    store_rows(A_out, A, t0, nrows, h, H, C, rows, rows)
    eq = rows  # a scalar decay's e^Gq on the rows (unused otherwise)
    if DECAY == SCALAR_DECAY:
        eq = exp2(load_gate_rows(G, t0, nrows, h, H, rows - BONUS))[:, None]
    qku = rows  # the bonus's scores (unused without it)
    if BONUS:
        qku = bonus_scores(q, k, u, t0, nrows, h, H, K, rows, BK)
    v_first = 0  # the first V block of the loop below
    if STORE_QG:  # the first V block on its own, which stores qg; the others read it back
        _output_block(q, d, v, G, hs, A, o, qg, qku, eq, slot, t0, nrows, h, H, K, V, rows, tl.arange(0, BV), scale,
                      DECAY, BONUS, QG_STORE, BK, HT, AT, X)
        v_first = BV
        tl.debug_barrier()  # qg, stored by other threads, is read below
    for v0 in range(v_first, V, BV):
        _output_block(q, d, v, G, hs, A, o, qg, qku, eq, slot, t0, nrows, h, H, K, V, rows, v0 + tl.arange(0, BV),
                      scale, DECAY, BONUS, QG_READ if STORE_QG else QG_NONE, BK, HT, AT, X)


def chunk_output(plan: dict, s: Shapes, *, q: torch.Tensor, k: torch.Tensor, d: torch.Tensor, v: torch.Tensor,
                 G: Optional[torch.Tensor], u: Optional[torch.Tensor], hs: torch.Tensor, A: torch.Tensor,
                 o: torch.Tensor, Qg: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                 decay: Decay) -> None:
    """o [B, T, H, V] and the scaled scores A [B, T, H, C] (``configs.Precision.scores``). q, k: [B, T, H, K];
    d: the writes [B, T, H, V] (v, or the delta rule's corrected writes); v: the values (read for the bonus);
    G: [B, T, H(, K)] fp32; u: the bonus [H, K]; hs: the chunk-start states [slots, H, K, V]; Qg (the delta rule
    with a per-channel decay): q e^G [B, T, H, K], stored here for the backward's pass."""
    launch_kernel(plan, "output_vector" if decay == Decay.CHANNEL else "output", output_kernel, (s.slots, s.H),
                  q, k, d, v, G, u, hs, A, o, Qg, cu_seqlens, scale, s.T, s.H, s.N, s.K, s.V, DECAY=decay,
                  BONUS=int(u is not None), C=CHUNK, SB=configs.PAIR_SUB, BK=s.scores_BK(decay), BV=s.BV,
                  SPAN=configs.BLOCK_SPAN, CSPAN=configs.CHUNK_SPAN, KP=s.BKF)
