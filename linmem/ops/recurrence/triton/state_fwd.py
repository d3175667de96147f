"""Stage 3 of the forward: the sequential pass over chunks, the only stage that walks a sequence in order.

Per chunk: its start state ``h`` is stored for the later stages; ``d = U - W h`` (the delta rule's corrected
writes, stored) or ``d = v``; then ``h = e^Gamma h + (k e^(Gamma - G))^T d``. The last ``h`` is the final state.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .configs import CHUNK, Shapes
from .gates import end_decay
from .launch import launch_sequential
from .layout import (first_state_tiles, load_gate_rows, load_rows, load_state, sequence_state, store_rows,
                     store_state_tiles)
from .numerics import exp2, masked_exp2, mm, mm_split
from .wy_prep import Factors
from .switches import CHANNEL_DECAY, SCALAR_DECAY, Decay


@triton.jit
def _state_step(S, k, G, d, t0, nrows, h, H, K, rows, kb, DECAY: tl.constexpr, DELTA: tl.constexpr,
                PT: tl.constexpr, SPLIT: tl.constexpr, X: tl.constexpr):
    """Key rows kb of the next chunk's start state: e^Gamma S + (k e^(Gamma - G))^T d. With a scalar decay the
    delta rule's d arrives decayed (e^(Gamma - G) on its rows, a [C, BV] tile before its tf32 product); with a
    per-channel decay its k (kg)."""
    kT = load_rows(k, t0, nrows, h, H, K, rows, kb, True)
    valid = rows < nrows
    if DECAY == SCALAR_DECAY:
        last = end_decay(G, t0, nrows, h, H, K, kb, DECAY)
        if not DELTA:  # on k^T: decaying the bf16 writes instead broke the bf16 bound of dlog_decay
            kT = kT * masked_exp2(valid[None, :], last - load_gate_rows(G, t0, nrows, h, H, rows)[None, :])
        S = S * exp2(last)
    elif DECAY == CHANNEL_DECAY:  # last in each branch: one line above both reorders the additive rule's loads
        if DELTA:  # k arrives decayed (kg of delta_prep_kernel)
            last = end_decay(G, t0, nrows, h, H, K, kb, DECAY)
        else:
            GT = load_rows(G, t0, nrows, h, H, K, rows, kb, True)
            last = end_decay(G, t0, nrows, h, H, K, kb, DECAY)
            kT = kT * masked_exp2(valid[None, :], last[:, None] - GT)
        S = S * exp2(last)[:, None]
    return S + _pass_mm(kT, d, PT, SPLIT, X)


@triton.jit
def _w_tile(W, slot, t0, nrows, h, H, K, rows, kb, C: tl.constexpr, W_T: tl.constexpr):
    """Key columns kb of the delta rule's W for one chunk, [C, len(kb)]: from W by tokens, or (W_T) from its
    transposed copy per chunk [slots, H, K, C], whose rows past the chunk's end hold 0."""
    if W_T:
        return load_state(W, slot, h, H, K, C, kb, rows, K, True)
    return load_rows(W, t0, nrows, h, H, K, rows, kb, False)


@triton.jit
def _pass_mm(a, b, DT: tl.constexpr, SPLIT: tl.constexpr, X: tl.constexpr):
    """A product of the forward pass with an fp32 right factor (the state, or the delta rule's d): in DT, or with
    a bf16 left factor (SPLIT: the delta rule's bf16 W and U) as two bf16 products (``mm_split``)."""
    if SPLIT:
        return mm_split(a, b)
    return mm(a, b, DT, X)


@triton.jit
def state_fwd_kernel(k, vu, W, G, hs, d_out, h0, hN, cu_seqlens, T, H, N, K, V,
                     DECAY: tl.constexpr, DELTA: tl.constexpr,
                     W_T: tl.constexpr, NARROW: tl.constexpr,
                     C: tl.constexpr, BKF: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr):
    """The sequential pass over chunks: stores the chunk-start states and carries the state.

    Per chunk: hs[slot] = h; d = U - W h (DELTA, stored to d_out) or d = v;
    h = e^Gamma h + (k e^(Gamma - G))^T d, computed as k^T (e^(Gamma - G) d) for the delta rule
    with a scalar decay. k: the keys (for the delta rule with a per-channel decay, decayed to the chunk's
    end: kg of ``delta_prep_kernel``); vu: v or U [tokens, H, V]; W: the delta rule's W [tokens, H, K], or with
    W_T its transposed copy per chunk (Wt of ``delta_prep_kernel``, [slots, H, K, C]; bf16 factors, whose W it
    equals); hs: [slots, H, K, V] (dot dtype); h0, hN:
    [N, H, K, V] fp32. Grid (V blocks, N * H). The state is held as BKF // KB tiles (1, 2 or 4)
    of KB key rows, each with its own loads.
    The delta rule's products: with fp32 W and U, W h and k^T d run in tf32 (tf32x3 for fp32 inputs) whatever
    d_out's dtype. With bf16 W and U (``configs.factors_dtype``: bf16 inputs, K <= 128) W h runs as two bf16
    products on h split in two bf16 parts (SPLIT, ``numerics.mm_split``), and so does k^T d on d, but on grids
    narrower than half the SMs (NARROW, ``configs.NARROW_BF16_FACTORS``), where it stays one tf32 product on the
    k tile widened: there the pass is bound by its chain of dependent products, which a second product lengthens.
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    HAS_INIT: tl.constexpr = h0 is not None
    IT: tl.constexpr = W.dtype.element_ty if DELTA else k.dtype.element_ty  # the delta rule's WY factors, or k
    # WORKAROUND(triton 3.6, sm_90): k^T d on the bf16 d tile it stores gives NaN at V blocks of 16 and 32: tf32
    PT: tl.constexpr = tl.float32 if DELTA else IT  # the dtype of k^T d
    SPLIT: tl.constexpr = DELTA and IT == tl.bfloat16  # W h as two bf16 products (numerics.mm_split)
    SPLIT_KD: tl.constexpr = SPLIT and not NARROW  # and k^T d; NARROW: in tf32, on the k tile widened
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    NKB: tl.constexpr = BKF // KB
    n, h, bos, eos, s0, kb0, vr, rows = sequence_state(cu_seqlens, T, H, C, IS_VARLEN, KB, BV)
    kb1, kb2, kb3 = kb0 + KB, kb0 + 2 * KB, kb0 + 3 * KB
    S0, S1, S2, S3 = first_state_tiles(h0, HAS_INIT, n, h, H, K, V, kb0, vr, NKB)
    for c in range((eos - bos + C - 1) // C):
        t0 = bos + c * C
        nrows = tl.minimum(eos - t0, C)
        store_state_tiles(hs, S0, S1, S2, S3, s0 + c, h, H, K, V, kb0, vr, NKB)
        d = load_rows(vu, t0, nrows, h, H, V, rows, vr, False)
        if DELTA:
            d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb0, C, W_T), S0, IT, SPLIT, X)
            if NKB > 1:
                d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb1, C, W_T), S1, IT, SPLIT, X)
            if NKB > 2:
                d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb2, C, W_T), S2, IT, SPLIT, X)
                d -= _pass_mm(_w_tile(W, s0 + c, t0, nrows, h, H, K, rows, kb3, C, W_T), S3, IT, SPLIT, X)
            store_rows(d_out, d, t0, nrows, h, H, V, rows, vr)
            if DECAY == SCALAR_DECAY:
                d = d * masked_exp2(rows < nrows, end_decay(G, t0, nrows, h, H, K, kb0, DECAY)
                                    - load_gate_rows(G, t0, nrows, h, H, rows))[:, None]
        S0 = _state_step(S0, k, G, d, t0, nrows, h, H, K, rows, kb0, DECAY, DELTA, PT, SPLIT_KD, X)
        if NKB > 1:
            S1 = _state_step(S1, k, G, d, t0, nrows, h, H, K, rows, kb1, DECAY, DELTA, PT, SPLIT_KD, X)
        if NKB > 2:
            S2 = _state_step(S2, k, G, d, t0, nrows, h, H, K, rows, kb2, DECAY, DELTA, PT, SPLIT_KD, X)
            S3 = _state_step(S3, k, G, d, t0, nrows, h, H, K, rows, kb3, DECAY, DELTA, PT, SPLIT_KD, X)
    if hN is not None:
        store_state_tiles(hN, S0, S1, S2, S3, n, h, H, K, V, kb0, vr, NKB)


def forward_pass(plan: dict, s: Shapes, *, k: torch.Tensor, vu: torch.Tensor, W: Optional[torch.Tensor],
                 G: Optional[torch.Tensor], hs: torch.Tensor, d: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                 hN: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], factors: Optional[Factors],
                 decay: Decay) -> None:
    """The chunk-start states hs [slots, H, K, V] (the states' dtype), the delta rule's corrected writes d
    [B, T, H, V] and the final state hN [N, H, K, V] fp32 (if given), from the initial state h0 [N, H, K, V] fp32
    (or zeros if None). k: [B, T, H, K] (the delta rule with a per-channel decay: Kg, the keys decayed to the
    chunk's end); vu: v or the delta rule's U; W: the delta rule's W (``factors``); G: [B, T, H(, K)] fp32."""
    delta = factors is not None
    bf16 = delta and factors.bf16
    launch_sequential(plan, "state_fwd_bf16" if bf16 else "state_fwd", state_fwd_kernel, s, delta, decay,
                      k, vu, W, G, hs, d, h0, hN, cu_seqlens, s.T, s.H, s.N, s.K, s.V,
                      DECAY=decay, DELTA=int(delta), W_T=int(delta and factors.transposed),
                      NARROW=int(delta and factors.narrow), C=CHUNK, BKF=s.BKF, KB=s.state_KB(delta))
