"""Stage 1 of the backward: the reverse sequential pass, the gradients of the chunk-end states.

Per chunk, last to first: ``dH = e^Gamma dH + scale (q e^Gq)^T dO``, and for the delta rule ``- W^T dd`` with
``dd = A^T dO + (k e^(Gamma - G)) dH`` (the gradient of its corrected writes, which its next step needs). The
additive rule's ``dd`` (its ``dv``) is off this path: ``dv.py`` computes it in parallel afterwards.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .configs import CHUNK, Shapes
from .gates import end_decay, end_gates, scalar_gates
from .launch import launch_sequential
from .layout import (first_state_tiles, load_gate_rows, load_rows, load_state, sequence_state, store_rows,
                     store_state_tiles)
from .numerics import exp2, masked_exp2, mm
from .switches import CHANNEL_DECAY, SCALAR_DECAY, Decay


@triton.jit
def _writes_grad_part(k, dS, t0, nrows, h, H, K, rows, kb, SD: tl.constexpr, X: tl.constexpr):
    """(k e^(Gamma - G))[:, kb] dS: the part of the delta rule's dd that key rows kb carry, [C, BV] fp32.
    A scalar decay's e^(Gamma - G) is left out: the caller puts it on the rows of the parts' sum; a
    per-channel decay's k arrives with it (kg of ``delta_prep_kernel``)."""
    return mm(load_rows(k, t0, nrows, h, H, K, rows, kb, False), dS, SD, X)


@triton.jit
def _writes_grad_parts(dd, k, dS0, dS1, dS2, dS3, t0, nrows, h, H, K, rows, kb0, NKB: tl.constexpr,
                       SD: tl.constexpr, X: tl.constexpr):
    """dd plus :func:`_writes_grad_part` of each of the NKB state tiles (of len(kb0) key rows each)."""
    KB: tl.constexpr = kb0.shape[0]
    dd += _writes_grad_part(k, dS0, t0, nrows, h, H, K, rows, kb0, SD, X)
    if NKB > 1:
        dd += _writes_grad_part(k, dS1, t0, nrows, h, H, K, rows, kb0 + KB, SD, X)
    if NKB > 2:
        dd += _writes_grad_part(k, dS2, t0, nrows, h, H, K, rows, kb0 + 2 * KB, SD, X)
        dd += _writes_grad_part(k, dS3, t0, nrows, h, H, K, rows, kb0 + 3 * KB, SD, X)
    return dd


@triton.jit
def _state_grad_step(dS, q, Wt, G, dO, dd, eg, slot, t0, nrows, h, H, K, rows, kb, scale,
                     DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr, C: tl.constexpr,
                     X: tl.constexpr, GATES_AHEAD: tl.constexpr):
    """Key rows kb of the gradient of the chunk's start state: e^Gamma dS + scale (q e^Gq)^T dO (- W^T dd).
    With a scalar decay the delta rule's dO arrives as e^Gq dO (the decay on its rows), with eg = e^Gamma;
    with a per-channel decay the delta rule's q arrives decayed (qg of ``output_kernel``), and with GATES_AHEAD
    its chunk-end gates as eg (log2 units, [KB])."""
    qT = load_rows(q, t0, nrows, h, H, K, rows, kb, True)
    if DECAY == SCALAR_DECAY:
        if not DELTA:  # on q^T: on the additive rule's bf16 dO rows it broke the bf16 bound of dlog_decay
            qT = qT * exp2(load_gate_rows(G, t0, nrows, h, H, rows - BONUS))[None, :]
            eg = exp2(end_decay(G, t0, nrows, h, H, K, kb, DECAY))
        dS = dS * eg
    elif DECAY == CHANNEL_DECAY:
        if not DELTA:
            qT = qT * exp2(load_rows(G, t0, nrows, h, H, K, rows - BONUS, kb, True))
        if GATES_AHEAD:
            dS = dS * exp2(eg)[:, None]
        else:
            dS = dS * exp2(end_decay(G, t0, nrows, h, H, K, kb, DECAY))[:, None]
    dS += scale * mm(qT, dO, q.dtype.element_ty, X)
    if DELTA:
        dS -= mm(load_state(Wt, slot, h, H, K, C, kb, rows, K, False), dd, Wt.dtype.element_ty, X)
    return dS


@triton.jit
def state_bwd_kernel(q, k, Wt, G, A, do, dd_out, dHs, dhN, dh0, cu_seqlens, scale, T, H, N, K, V,
                     DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr,
                     C: tl.constexpr, BKF: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr):
    """The reverse sequential pass: the gradients of the chunk-end states (and of the delta rule's writes).

    Per chunk, last to first: dHs[slot] = dH; dH = e^Gamma dH + scale (q e^Gq)^T dO. The delta rule's
    dH also takes - W^T dd, with dd = A^T dO + (k e^(Gamma-G)) dH (stored to dd_out, in d's dtype). The
    additive rule's dd, its dv, is off this path: ``dv_kernel`` computes it chunk by chunk in parallel
    (k, A and dd_out are then unused). With a per-channel decay the delta rule's q and k arrive decayed
    (q e^G and k e^(Gamma - G): qg of ``output_kernel``, kg of ``delta_prep_kernel``), and this pass loads
    only the chunk-end gates. A: [tokens, H, C] (scaled scores of the forward); Wt: [slots, H,
    K, C] (the delta rule's W, transposed per chunk); dHs: [slots, H, K, V]; dhN, dh0: [N, H, K, V]
    fp32. Grid (V blocks, N * H).
    The state is held as BKF // KB tiles (1, 2 or 4) of KB key rows, each with its own loads: at
    K = 128 the delta rule's pass then needs fewer registers than with one [K, BV] tile.
    A scalar decay (gated delta rule) enters the delta rule's pass on [C, BV] rows, off the chain of dependent
    products: e^(Gamma - G) on the rows of the sum of the key tiles' products, e^Gq on dO's rows for the q^T
    product; its gates are loaded a chunk ahead. The additive rule keeps its decay on the q tiles (see
    ``_state_grad_step``) and loads its gates in place, which is faster there. The per-channel delta rule (KDA)
    loads its chunk-end gates a chunk ahead too (``gates.end_gates``, one [KB] vector per state tile), except for
    fp32 inputs, whose pass spills and is faster loading them in place.
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    HAS_DFINAL: tl.constexpr = dhN is not None
    X: tl.constexpr = q.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    SD: tl.constexpr = dHs.dtype.element_ty
    NKB: tl.constexpr = BKF // KB
    GATES_AHEAD: tl.constexpr = DECAY == CHANNEL_DECAY and DELTA and not X  # KDA's chunk-end gates loaded a chunk ahead
    n, h, bos, eos, s0, kb0, vr, rows = sequence_state(cu_seqlens, T, H, C, IS_VARLEN, KB, BV)
    kb1, kb2, kb3 = kb0 + KB, kb0 + 2 * KB, kb0 + 3 * KB
    dS0, dS1, dS2, dS3 = first_state_tiles(dhN, HAS_DFINAL, n, h, H, K, V, kb0, vr, NKB)
    nchunks = (eos - bos + C - 1) // C
    if DECAY == SCALAR_DECAY and DELTA:  # the gates of the first chunk this pass takes (the last; no bonus here)
        tn = bos + (nchunks - 1) * C
        Gn, lastn = scalar_gates(G, tn, tl.where(nchunks > 0, eos - tn, 0), h, H, rows)
    if GATES_AHEAD:  # likewise a per-channel decay's chunk-end gates, one [KB] per state tile
        tn = bos + (nchunks - 1) * C
        gn0, gn1, gn2, gn3 = end_gates(G, tn, tl.where(nchunks > 0, eos - tn, 0), h, H, K, kb0, NKB)
    for i in range(nchunks):
        slot = s0 + nchunks - 1 - i
        t0 = bos + (nchunks - 1 - i) * C
        nrows = tl.minimum(eos - t0, C)
        eg = nrows  # the delta rule's e^Gamma for a scalar decay (unused otherwise)
        if DECAY == SCALAR_DECAY and DELTA:  # this chunk's gates, loaded by the step before; load the next chunk's
            ek = masked_exp2(rows < nrows, lastn - Gn)
            eq = exp2(Gn)
            eg = exp2(lastn)
            Gn, lastn = scalar_gates(G, t0 - C, tl.where(t0 > bos, C, 0), h, H, rows)
        eg0, eg1, eg2, eg3 = eg, eg, eg, eg  # per state tile: a per-channel decay's chunk-end gates instead
        if GATES_AHEAD:
            eg0, eg1, eg2, eg3 = gn0, gn1, gn2, gn3
            gn0, gn1, gn2, gn3 = end_gates(G, t0 - C, tl.where(t0 > bos, C, 0), h, H, K, kb0, NKB)
        store_state_tiles(dHs, dS0, dS1, dS2, dS3, slot, h, H, K, V, kb0, vr, NKB)
        dO = load_rows(do, t0, nrows, h, H, V, rows, vr, False)
        dd = dO  # the additive rule's pass does not read it
        if DELTA:
            dd = mm(load_rows(A, t0, nrows, h, H, C, rows, rows, True), dO, A.dtype.element_ty, X)
            if DECAY == SCALAR_DECAY:  # the key tiles' products first, their rows decayed once
                kdS = tl.full([C, BV], 0.0, tl.float32)  # (tl.zeros is a jit helper: see numerics.py)
                kdS = _writes_grad_parts(kdS, k, dS0, dS1, dS2, dS3, t0, nrows, h, H, K, rows, kb0, NKB, SD, X)
                dd += kdS * ek[:, None]
                dO = dO * eq[:, None]
            else:
                dd = _writes_grad_parts(dd, k, dS0, dS1, dS2, dS3, t0, nrows, h, H, K, rows, kb0, NKB, SD, X)
            store_rows(dd_out, dd, t0, nrows, h, H, V, rows, vr)
        dS0 = _state_grad_step(dS0, q, Wt, G, dO, dd, eg0, slot, t0, nrows, h, H, K, rows, kb0, scale, DECAY, DELTA,
                               BONUS, C, X, GATES_AHEAD)
        if NKB > 1:
            dS1 = _state_grad_step(dS1, q, Wt, G, dO, dd, eg1, slot, t0, nrows, h, H, K, rows, kb1, scale, DECAY, DELTA,
                                   BONUS, C, X, GATES_AHEAD)
        if NKB > 2:
            dS2 = _state_grad_step(dS2, q, Wt, G, dO, dd, eg2, slot, t0, nrows, h, H, K, rows, kb2, scale, DECAY, DELTA,
                                   BONUS, C, X, GATES_AHEAD)
            dS3 = _state_grad_step(dS3, q, Wt, G, dO, dd, eg3, slot, t0, nrows, h, H, K, rows, kb3, scale, DECAY, DELTA,
                                   BONUS, C, X, GATES_AHEAD)
    if dh0 is not None:
        store_state_tiles(dh0, dS0, dS1, dS2, dS3, n, h, H, K, V, kb0, vr, NKB)


def backward_pass(plan: dict, s: Shapes, *, q: torch.Tensor, k: torch.Tensor, Wt: Optional[torch.Tensor],
                  G: Optional[torch.Tensor], A: torch.Tensor, do: torch.Tensor, dd: Optional[torch.Tensor],
                  dHs: torch.Tensor, dhN: Optional[torch.Tensor], dh0: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], scale: float, decay: Decay, delta: bool, bonus: bool) -> None:
    """The chunk-end state gradients dHs [slots, H, K, V], the delta rule's dd [B, T, H, V] and the initial state's
    gradient dh0 [N, H, K, V] fp32 (if given), from do [B, T, H, V] and the final state's gradient dhN [N, H, K, V]
    (zeros if None). q, k: [B, T, H, K] (the delta rule with a per-channel decay: Qg and Kg, decayed); Wt: the
    delta rule's W transposed per chunk [slots, H, K, C]; A: the forward's scaled scores [B, T, H, C]."""
    launch_sequential(plan, "state_bwd", state_bwd_kernel, s, delta, decay,
                      q, k, Wt, G, A, do, dd, dHs, dhN, dh0, cu_seqlens, scale, s.T, s.H, s.N, s.K, s.V,
                      DECAY=decay, DELTA=int(delta), BONUS=int(bonus), C=CHUNK, BKF=s.BKF, KB=s.state_KB(delta))
