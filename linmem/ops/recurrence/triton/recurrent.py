"""Fused recurrent kernel: a few tokens against a state held in memory, updated in place.

This is the decoding path (``linear_recurrence_step``): per token it reads nothing but q, k, v, the gate and beta,
and the state is read and written once per call, so a step costs about one pass over the fp32 state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .configs import cdiv, pow2
from .launch import launch_kernel, on_inputs_device, plan_for
from .numerics import exp, total
from .switches import CHANNEL_DECAY, CONSTANT_DECAY, SCALAR_DECAY


@triton.jit
def recurrent_kernel(q, k, v, g, beta, u, S, o, scale, T, H, K, V,
                     DECAY: tl.constexpr, DELTA: tl.constexpr, BONUS: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
    """T tokens of one (sequence, head) against S[n, h, :, V block], token by token.

    q, k: [N, T, H, K]; v, o: [N, T, H, V]; g: None, [N, T, H] (SCALAR_DECAY), [N, T, H, K]
    (CHANNEL_DECAY) or [H] (CONSTANT_DECAY: a constant per head, as given: read once, not expanded per token);
    beta: [N, T, H]; u: [H, K]; S: [N, H, K, V] fp32, read once and written back.
    Per token: (bonus: o = scale (q S + (q . u k) v)); S = e^g S; S += k^T (beta (v - k S))
    (DELTA) or k^T v; o = scale q S. Grid (V blocks, N * H).
    """
    vb, nh = tl.program_id(0), tl.program_id(1)
    n, h = nh // H, nh % H
    kr = tl.arange(0, BK)
    vr = vb * BV + tl.arange(0, BV)
    mk, mv = kr < K, vr < V
    s_ptr = S + nh.to(tl.int64) * K * V + kr[:, None] * V + vr[None, :]
    St = tl.load(s_ptr, mask=mk[:, None] & mv[None, :], other=0.0)
    if BONUS:
        uu = tl.load(u + h * K + kr, mask=mk, other=0.0).to(tl.float32)
    if DECAY == CONSTANT_DECAY:
        eg = exp(tl.load(g + h).to(tl.float32))
    for t in range(T):
        tok = (n.to(tl.int64) * T + t) * H + h
        qt = tl.load(q + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + tok * K + kr, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + tok * V + vr, mask=mv, other=0.0).to(tl.float32)
        if BONUS:
            out = scale * (total(qt[:, None] * St, 0) + total(qt * uu * kt, 0) * vt)
        if DECAY == SCALAR_DECAY:
            St = St * exp(tl.load(g + tok).to(tl.float32))
        elif DECAY == CHANNEL_DECAY:
            St = St * exp(tl.load(g + tok * K + kr, mask=mk, other=0.0).to(tl.float32))[:, None]
        elif DECAY == CONSTANT_DECAY:
            St = St * eg
        if DELTA:
            vt = tl.load(beta + tok).to(tl.float32) * (vt - total(kt[:, None] * St, 0))
        St += kt[:, None] * vt[None, :]
        if not BONUS:
            out = scale * total(qt[:, None] * St, 0)
        tl.store(o + tok * V + vr, out.to(o.dtype.element_ty), mask=mv)
    tl.store(s_ptr, St, mask=mk[:, None] & mv[None, :])


@on_inputs_device
def recurrent_step(q, k, v, g, beta, u, state, scale: float, decay: int) -> torch.Tensor:
    """Tokens q, k: [N, T, H, K], v: [N, T, H, V] against ``state`` [N, H, K, V] fp32 (updated in place).

    g: None (``Decay.NONE``), [N, T, H] (``Decay.SCALAR``), [N, T, H, K] (``Decay.CHANNEL``) or [H]
    (``Decay.CONSTANT``); beta:
    [N, T, H] or None; u: [H, K] or None. Returns o: [N, T, H, V] in the dtype of q.
    """
    plan = plan_for("step", q, k, v, g, beta, u, state, scale, decay)
    N, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    BK = pow2(K)
    BV = min(pow2(V), configs.RECURRENT_BV)
    launch_kernel(plan, "recurrent", recurrent_kernel, (cdiv(V, BV), N * H),
                  q, k, v, g, beta, u, state, o, scale, T, H, K, V, DECAY=decay, DELTA=int(beta is not None),
                  BONUS=int(u is not None), BK=BK, BV=BV)
    return o
