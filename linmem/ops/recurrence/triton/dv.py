"""Stage 2 of the backward (additive rule): the value gradient, in parallel over chunks and V blocks.

``dv = A^T dO + (k e^(Gamma - G)) dH`` plus the bonus's ``scale (q . (u k)) dO``, from the chunk-end state
gradients of the reverse pass. (The delta rule's dv comes from its WY factors, in ``score_grads.py``.)
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .configs import CHUNK, Shapes, cdiv
from .launch import launch_kernel
from .layout import load_gate_rows, load_rows, load_state, locate_chunk, store_rows
from .numerics import masked_exp2, mm
from .scores import bonus_scores
from .switches import CHANNEL_DECAY, SCALAR_DECAY, Decay


@triton.jit
def dv_kernel(q, k, G, u, A, do, dHs, dv, cu_seqlens, scale, T, H, N, K, V,
              DECAY: tl.constexpr, BONUS: tl.constexpr,
              C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The additive rule's value gradient for one chunk and V block: dv = A^T dO + (k e^(Gamma-G)) dH,
    plus the bonus's scale (q u k) dO.

    A: the forward's scaled scores [tokens, H, C]; dHs: the chunk-end state gradients [slots, H, K, V]
    from ``state_bwd_kernel``; dv: [tokens, H, V] in the input dtype. Inside the sequential pass these products
    would take two thirds of the pass's time; here they run in parallel. Grid (V blocks, slots, H).
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    vb, slot, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    vr = vb * BV + tl.arange(0, BV)
    valid = rows < nrows
    Klive = tl.where(nrows > 0, K, 0)  # key rows of dH to read (none in an idle slot)
    last_row = tl.maximum(t0 + nrows - 1, 0)
    dO = load_rows(do, t0, nrows, h, H, V, rows, vr, False)
    dvt = mm(load_rows(A, t0, nrows, h, H, C, rows, rows, True), dO, A.dtype.element_ty, X)
    if DECAY == SCALAR_DECAY:
        last = tl.where(nrows > 0, tl.load(G + last_row * H + h), 0.0)
        ek = masked_exp2(valid, last - load_gate_rows(G, t0, nrows, h, H, rows))[:, None]
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        kt = load_rows(k, t0, nrows, h, H, K, rows, cols, False)
        if DECAY == SCALAR_DECAY:
            kt = kt * ek
        elif DECAY == CHANNEL_DECAY:
            lastk = tl.load(G + (last_row * H + h) * K + cols, mask=cols < Klive, other=0.0)
            kt = kt * masked_exp2(valid[:, None], lastk[None, :] - load_rows(G, t0, nrows, h, H, K, rows, cols, False))
        dvt += mm(kt, load_state(dHs, slot, h, H, K, V, cols, vr, Klive, False), dHs.dtype.element_ty, X)
    # WORKAROUND(triton 3.6, sm_90): the k tile of the products read again for the bonus miscompiles at 3 stages
    if BONUS:  # a loop of its own
        dvt += scale * bonus_scores(q, k, u, t0, nrows, h, H, K, rows, BK)[:, None] * dO
    store_rows(dv, dvt, t0, nrows, h, H, V, rows, vr)


def additive_dv(plan: dict, s: Shapes, *, q: torch.Tensor, k: torch.Tensor, G: Optional[torch.Tensor],
                u: Optional[torch.Tensor], A: torch.Tensor, do: torch.Tensor, dHs: torch.Tensor, dv: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor], scale: float, decay: Decay) -> None:
    """dv [B, T, H, V] from A [B, T, H, C] (the forward's scaled scores), do [B, T, H, V] and dHs [slots, H, K, V]
    (the chunk-end state gradients); q, k: [B, T, H, K], G: [B, T, H(, K)] fp32, u: the bonus [H, K]."""
    bv = s.dv_BV(decay)
    launch_kernel(plan, "dv", dv_kernel, (cdiv(s.V, bv), s.slots, s.H),
                  q, k, G, u, A, do, dHs, dv, cu_seqlens, scale, s.T, s.H, s.N, s.K, s.V, DECAY=decay,
                  BONUS=int(u is not None), C=CHUNK, BK=s.BK, BV=bv)
