"""Stage 3 of the backward: what loops over value channels, for one chunk each.

The score gradients ``dA[t, s] = scale dO_t . d_s`` (on the score pairs; the scalar decays' pairwise decays folded
in), and for the delta rule ``Y = T^T dd``, ``dv = beta Y``, ``dL = -Y d^T`` and dbeta's value part; with the
bonus ``dO_t . d_t``. Stored for the WY and key-channel stages.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import configs
from .configs import CHUNK, Shapes
from .launch import launch_kernel
from .layout import load_gate_rows, load_rows, locate_chunk, store_rows
from .numerics import bf16_parts, masked_exp2, mm, mm_parts, total
from .wy_grads import wy_grads_chunk
from .switches import SCALAR_DECAY, Decay


@triton.jit
def score_grads_kernel(q, v, beta, G, Tt, d, do, dd, dA_out, dL_out, Y_out, dv, dbeta, dov_out,
                       k, hs, dk, dg, cu_seqlens, scale, T, H, N, K, V,
                       DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr,
                       WY: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       SPAN: tl.constexpr, CSPAN: tl.constexpr, KP: tl.constexpr):
    """The gradients of one chunk that loop over value channels, stored for ``wy_grads_kernel`` and
    ``grads_kernel``; with WY (the delta rule) it then runs ``wy_grads_kernel``'s part itself
    (``wy_grads.wy_grads_chunk``: k, hs, dk, dg and the constexprs after WY are that kernel's), reading Y and dL back
    as this program stored them.

    dA_out[t, s] = scale dO_t . d_s on the score pairs (times e^(Gq_t - G_s) for SCALAR_DECAY):
    [tokens, H, C] in the states' dtype, which grads_kernel's products round it to (CHANNEL_DECAY's products run in
    tf32, on dA widened; fp16 inputs store it in fp32: see ``pipeline.chunk_backward``). Delta rule, with
    Tt = T^T stored by the prep kernel: Y = T^T dd (Y_out, [tokens, H, V]); dv = beta Y; dL_out[s, r] =
    -Y_s . d_r on the strict pairs (times e^(G_s - G_r) for SCALAR_DECAY); dbeta gets its value part sum_v v Y.
    Y_out takes the dtype of hs, dL_out that of dA_out; the products of ``wy_grads_kernel`` run in them (in tf32
    on dL for CHANNEL_DECAY; the additive rule's dv is ``dv_kernel``'s). Bonus: dov_out[t] = dO_t . d_t
    ([tokens, H] fp32). Grid (slots, H).

    Precision of the delta rule's two products (SPLIT: bf16 inputs, whose d and dd are bf16): Y = T^T dd as two
    bf16 products on T split once into its bf16 part and remainder (``numerics.mm_parts``, about 16 of T's
    mantissa bits), and -Y d^T on Y rounded to bf16, the Y that Y_out stores and the WY part reads; dd and d enter
    the tensor cores as loaded, rather than widened to fp32 in registers first. fp16 and fp32 inputs: both in tf32
    (tf32x3 for fp32).
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    WYT: tl.constexpr = Tt.dtype.element_ty if DELTA else tl.float32  # the delta rule's WY factors
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
    if DECAY == SCALAR_DECAY:  # fold the pairwise decays into the score gradients
        Gr = load_gate_rows(G, t0, nrows, h, H, rows)
        dA = dA * masked_exp2(causal, load_gate_rows(G, t0, nrows, h, H, rows - BONUS)[:, None] - Gr[None, :])
    store_rows(dA_out, dA, t0, nrows, h, H, C, rows, rows)
    if DELTA:
        strict = (rows[:, None] > rows[None, :]) & valid[:, None]
        dL = tl.where(strict, dL, 0.0)
        if DECAY == SCALAR_DECAY:
            dL = dL * masked_exp2(strict, Gr[:, None] - Gr[None, :])
        store_rows(dL_out, dL, t0, nrows, h, H, C, rows, rows)
        if WY:
            tl.debug_barrier()  # Y and dL, stored by other threads, are read back below
            wy_grads_chunk(k, beta, G, hs, Y_out, dL_out, dk, dbeta, dg, db, slot, h, t0, nrows, H, K, V, DECAY, C, SB,
                           BK, BV, SPAN, CSPAN, KP)
        else:
            tl.store(dbeta + (t0 * H + h) + rows * H, db, mask=valid)
    if BONUS:
        tl.store(dov_out + (t0 * H + h) + rows * H, dov, mask=valid)


def score_grads(plan: dict, s: Shapes, *, q: torch.Tensor, v: torch.Tensor, beta: Optional[torch.Tensor],
                G: Optional[torch.Tensor], Tt: Optional[torch.Tensor], d: torch.Tensor, do: torch.Tensor,
                dd: Optional[torch.Tensor], dA: torch.Tensor, dL: Optional[torch.Tensor], Y: Optional[torch.Tensor],
                dv: torch.Tensor, dbeta: Optional[torch.Tensor], dov: Optional[torch.Tensor], k: torch.Tensor,
                hs: torch.Tensor, dk: torch.Tensor, dg: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                scale: float, decay: Decay, delta: bool, bonus: bool, wy_fused: bool) -> None:
    """dA [B, T, H, C]; the delta rule's dL [B, T, H, C], Y [B, T, H, V], dv [B, T, H, V] and dbeta [B, T, H] fp32
    (its value part, or whole with ``wy_fused``); the bonus's dov [B, T, H] fp32. From d (the writes: v, or the
    delta rule's corrected writes), do, the delta rule's dd and Tt (T transposed per chunk). ``wy_fused``: the WY
    stage runs here too, on k, hs, dk and dg (see ``wy_grads.wy_grads``)."""
    launch_kernel(plan, ("score_wy_grads" if wy_fused else "score_grads_delta") if delta else "score_grads",
                  score_grads_kernel, (s.slots, s.H),
                  q, v, beta, G, Tt, d, do, dd, dA, dL, Y, dv, dbeta, dov, k, hs, dk, dg, cu_seqlens, scale, s.T,
                  s.H, s.N, s.K, s.V, DECAY=decay, DELTA=int(delta), BONUS=int(bonus), WY=int(wy_fused), C=CHUNK,
                  SB=configs.PAIR_SUB, BK=s.wy_BK(decay), BV=s.BV, SPAN=configs.BLOCK_SPAN, CSPAN=configs.CHUNK_SPAN,
                  KP=s.BKF)
