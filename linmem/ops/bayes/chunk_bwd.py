"""The chunked Bayesian filter's backward kernel and its launcher (backend "chunk_triton").

One program per (sequence, head) runs the chunks in reverse, carrying the adjoints ``dm [K, V]`` and ``dP [K, K]``
of the chunk end to its start. Entering a group of GROUP chunks (:mod:`.chunk_fwd`) it recomputes their starts
from the group's saved start and the saved inverse factors ``Li`` into a scratch of GROUP states per program; each
chunk is then recomputed from its start and ``Li``, and the vector-Jacobian product of :mod:`.chunk_grad` applied
line by line; that module writes the maths out in PyTorch and is tested against autograd. The Cholesky factor's
VJP in the explicit-inverse form::

    X  = -(dZ Z^T + dW Wf^T + dF F^T),   dS = Li^T Phi(X) Li,   Phi(X) = (tril(X) + tril(X, -1)^T) / 2

Layout as the forward's; the gates' gradients go to ``[tokens, H, 3]`` fp32 (log decay, observation noise,
process noise).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..recurrence.triton.layout import first_slot, sequence_bounds
from ..recurrence.triton.numerics import remaining_total, total
from ..triton_launch import run_kernel
from .chunk_fwd import (GROUP, GROUP_TL, STAGES, ChunkLaunch, chunk_end, decays, dot, dot_state, dot_state_t, dot_sym,
                        last, load_gates, load_rows, pow2, state_offsets, store_rows)


@triton.jit
def gate_grads(g, w, dalpha, dAA, dB, dbeta, rows, cols):
    """(dg, dw) [C] from the cotangents of alpha [C], AA [C, C], B [C, C] and beta [C] (chunk_grad._gate_grads)."""
    alpha, A, AA, beta, B = decays(g, w, rows, cols)
    dbeta += total(dB * A, 1)  # B_ij = A_ij beta_i
    dA = dB * beta[:, None] + 2.0 * A * w[:, None] * dbeta[None, :]  # beta_j = sum_l A_lj^2 w_l
    dw = total(A * A * dbeta[None, :], 1)
    Y = tl.where(rows[:, None] <= cols[None, :], dA * A, 0.0)  # A_ij = exp(G_j - G_i)
    dG = dalpha * alpha + total(dAA * AA, 1) + total(dAA * AA, 0) + total(Y, 0) - total(Y, 1)
    return remaining_total(dG, 0), dw  # G = cumsum(g)


@triton.jit
def chunk_bwd_kernel(q, k, v, gates, states, factors, scratch, do, dvar, dMT, dPT, dq, dk, dv, dgates, dM0, dP0,
                     cu_seqlens, scale, T, H, K, V, VAR: tl.constexpr, IS_VARLEN: tl.constexpr, C: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
    """The gradients of one sequence and head, a chunk at a time in reverse. states, factors: the forward's;
    scratch: [N H, GROUP, K V + K K] fp32. dq, dk, dv in the dtypes of q, k, v; dgates [tokens, H, 3], dM0
    [N, H, K, V], dP0 [N, H, K, K] (symmetric) fp32; dMT, dPT: the final state's cotangents [N, H, K, V],
    [N, H, K, K] fp32."""
    nh = tl.program_id(0)
    n, h = nh // H, nh % H
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    rows, cols = tl.arange(0, C), tl.arange(0, C)
    kr, vr = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = kr < K, vr < V
    mkk, mkv = mk[:, None] & mk[None, :], mk[:, None] & mv[None, :]
    diag = rows[:, None] == cols[None, :]
    upper = rows[:, None] <= cols[None, :]
    lastcol = cols[None, :] == C - 1
    state_m = nh.to(tl.int64) * K * V + kr[:, None] * V + vr[None, :]
    state_P = nh.to(tl.int64) * K * K + kr[:, None] * K + kr[None, :]
    dm = tl.load(dMT + state_m, mask=mkv, other=0.0)
    dP = tl.load(dPT + state_P, mask=mkk, other=0.0)
    SZ = K * V + K * K
    at_m, at_P = state_offsets(K, V, kr, vr)
    eye = tl.where((kr[:, None] == kr[None, :]) & mk[:, None], 1.0, 0.0)
    chunks = (eos - bos + C - 1) // C
    first = first_slot(n, bos, T, C, IS_VARLEN)
    first_group = first_slot(n, bos, T, C * GROUP_TL, IS_VARLEN)
    own = scratch + nh.to(tl.int64) * GROUP_TL * SZ
    for i in range(0, chunks):
        c = chunks - 1 - i
        if (c == chunks - 1) | (c % GROUP_TL == GROUP_TL - 1):  # entering a group: the starts of its chunks up to c
            start = states + ((first_group + c // GROUP_TL) * H + h) * SZ
            gm = tl.load(start + at_m, mask=mkv, other=0.0)
            gP = tl.load(start + at_P, mask=mkk, other=0.0)
            tl.debug_barrier()  # the scratch's last reads are done
            for j in range(0, c % GROUP_TL):
                tl.store(own + j * SZ + at_m, gm, mask=mkv)
                tl.store(own + j * SZ + at_P, gP, mask=mkk)
                cj = c - c % GROUP_TL + j
                tokj = (bos + cj * C + rows) * H + h
                validj = bos + cj * C + rows < eos
                gj, _, wj = load_gates(gates, tokj, validj)
                Lij = tl.load(factors + ((first + cj) * H + h) * C * C + rows[:, None] * C + cols[None, :])
                gm, gP = chunk_end(gm, gP, load_rows(k, tokj, validj, kr, K, mk), load_rows(v, tokj, validj, vr, V, mv),
                                   gj, wj, Lij, eye, rows, cols, C)
            tl.store(own + (c % GROUP_TL) * SZ + at_m, gm, mask=mkv)
            tl.store(own + (c % GROUP_TL) * SZ + at_P, gP, mask=mkk)
            tl.debug_barrier()  # every start is written before it is read
        t0 = bos + c * C
        valid = t0 + rows < eos
        tok = (t0 + rows) * H + h
        qc = load_rows(q, tok, valid, kr, K, mk)
        kc = load_rows(k, tok, valid, kr, K, mk)
        vc = load_rows(v, tok, valid, vr, V, mv)
        doc = load_rows(do, tok, valid, vr, V, mv)
        g, r, w = load_gates(gates, tok, valid)
        m = tl.load(own + (c % GROUP_TL) * SZ + at_m, mask=mkv, other=0.0)
        P = tl.load(own + (c % GROUP_TL) * SZ + at_P, mask=mkk, other=0.0)
        Li = tl.load(factors + ((first + c) * H + h) * C * C + rows[:, None] * C + cols[None, :])
        LiT = tl.trans(Li)

        # the chunk again (chunk_fwd.whitening, keeping its pieces)
        alpha, A, AA, beta, B = decays(g, w, rows, cols)
        B_sym = B + tl.trans(B) - tl.where(diag, B, 0.0)
        kP = dot_sym(kc, P)
        KK, KQ = dot(kc, tl.trans(kc)), dot(kc, tl.trans(qc))
        KPK, KPQ = dot(kP, tl.trans(kc)), dot(kP, tl.trans(qc))
        aC = last(alpha, rows, C)
        Alast = total(tl.where(lastcol, A, 0.0), 1)
        R = (alpha * aC)[:, None] * kP + (Alast * beta)[:, None] * kc
        km = dot_state(kc, m)
        Z = dot(Li, vc - alpha[:, None] * km)
        Wf = dot(Li, tl.where(upper, AA * KPQ, 0.0) + B * KQ)
        W = tl.where(upper, Wf, 0.0)
        F = dot(Li, R)

        # the read-outs and the chunk end
        D = 0.5 * (dP + tl.trans(dP))
        dZ = scale * dot(W, doc) + dot_state(F, dm)
        dW = scale * dot(Z, tl.trans(doc))
        dF = dot_state_t(Z, dm) - 2.0 * dot_sym(F, D)
        dalpha = scale * total(doc * dot_state(qc, m), 1)
        daC = total(total(dm * m, 1), 0) + 2.0 * aC * total(total(D * P, 1), 0)
        dalpha += tl.where(rows == C - 1, daC, 0.0)
        dqc = scale * alpha[:, None] * dot_state_t(doc, m)
        dm_prev = aC * dm + scale * dot(tl.trans(qc), alpha[:, None] * doc)
        dP_prev = (aC * aC) * D
        dbeta = tl.where(rows == C - 1, total(total(tl.where(kr[:, None] == kr[None, :], D, 0.0), 1), 0), 0.0)
        dr = r * 0.0
        if VAR:
            dv_ = tl.load(dvar + tok, mask=valid, other=0.0)
            qP = dot_sym(qc, P)
            a2dvar = alpha * alpha * dv_
            dalpha += 2.0 * alpha * total(qP * qc, 1) * dv_
            dqc += 2.0 * a2dvar[:, None] * qP + 2.0 * (beta * dv_)[:, None] * qc
            dP_prev += dot(tl.trans(qc), a2dvar[:, None] * qc)
            dbeta += dv_ * total(qc * qc, 1)
            dW -= 2.0 * W * dv_[None, :]
            dr += dv_
        dW = tl.where(upper, dW, 0.0)

        # through Li = L^-1 and the Cholesky factor L of S
        X = -(dot(dZ, tl.trans(Z)) + dot(dW, tl.trans(Wf)) + dot(dF, tl.trans(F)))
        Phi = 0.5 * tl.where(rows[:, None] >= cols[None, :], X, tl.trans(X))  # (tril(X) + tril(X, -1)^T) / 2
        dS = dot(dot(LiT, Phi), Li)
        dE = dot(LiT, dZ)
        dH = tl.where(upper, dot(LiT, dW), 0.0)
        dR = dot(LiT, dF)
        store_rows(dv, tok, valid, vr, V, mv, dE)

        # Yhat = alpha * (k m)
        dalpha -= total(dE * km, 1)
        dkc = -alpha[:, None] * dot_state_t(dE, m)
        dm_prev -= dot(tl.trans(kc), alpha[:, None] * dE)
        # R = AA[:, C] * kP + B[:, C] * k
        dkP = (alpha * aC)[:, None] * dR
        dAA = tl.where(lastcol, total(dR * kP, 1)[:, None], 0.0)
        dkc += (Alast * beta)[:, None] * dR
        dB = tl.where(lastcol, total(dR * kc, 1)[:, None], 0.0)
        # H = U * AA * (kP q^T) + B * (k q^T)
        X1, X2 = dH * AA, dH * B
        dkP += dot(X1, qc)
        dqc += dot(tl.trans(X1), kP) + dot(tl.trans(X2), kc)
        dkc += dot(X2, qc)
        dAA += dH * KPQ
        dB += dH * KQ
        # S = AA * (kP k^T) + B_sym * (k k^T) + diag(r)
        Y1, Y2 = dS * AA, dS * B_sym
        dkP += dot(Y1, kc)
        dkc += dot(tl.trans(Y1), kP) + dot(Y2 + tl.trans(Y2), kc)
        dAA += dS * KPK
        dBs = dS * KK
        dB += tl.where(upper, dBs + tl.trans(dBs), 0.0) - tl.where(diag, dBs, 0.0)
        dr += total(tl.where(diag, dS, 0.0), 1)
        # kP = k P
        dkc += dot_sym(dkP, P)
        dP_prev += dot(tl.trans(kc), dkP)

        dg, dw = gate_grads(g, w, dalpha, dAA, dB, dbeta, rows, cols)
        store_rows(dq, tok, valid, kr, K, mk, dqc)
        store_rows(dk, tok, valid, kr, K, mk, dkc)
        tl.store(dgates + tok * 3, dg, mask=valid)
        tl.store(dgates + tok * 3 + 1, dr, mask=valid)
        tl.store(dgates + tok * 3 + 2, dw, mask=valid)
        dm, dP = dm_prev, dP_prev
    tl.store(dM0 + state_m, dm, mask=mkv)
    tl.store(dP0 + state_P, 0.5 * (dP + tl.trans(dP)), mask=mkk)


def chunk_backward(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, states: Tensor, factors: Tensor,
                   cu_seqlens: Optional[Tensor], scale: float, do: Tensor, dvar: Optional[Tensor], dMT: Tensor,
                   dPT: Tensor, launch: ChunkLaunch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk [B, T, H, K], dv [B, T, H, V] in the dtypes of q, k, v; dgates [B, T, H, 3] fp32 (log decay,
    observation noise, process noise); dM0 [N, H, K, V], dP0 [N, H, K, K] fp32, those of the initial belief).

    Inputs as :func:`.chunk_fwd.chunk_forward` took them, ``states`` and ``factors`` as it returned; do
    [B, T, H, V] contiguous, dvar [B, T, H] fp32 contiguous or None (the variance was not read), dMT [N, H, K, V] and
    dPT [N, H, K, K] fp32 contiguous (zeros where the final state was not read).
    """
    B, T, H, K = q.shape
    V, N = v.shape[-1], dMT.shape[0]
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dgates = torch.empty(B, T, H, 3, **f32)
    dM0, dP0 = torch.empty(N, H, K, V, **f32), torch.empty(N, H, K, K, **f32)
    scratch = torch.empty(N * H, GROUP, K * V + K * K, **f32)
    run_kernel(
        chunk_bwd_kernel, (N * H,),
        (q, k, v, gates, states, factors, scratch, do, gates if dvar is None else dvar, dMT, dPT, dq, dk, dv, dgates,
         dM0, dP0, gates if cu_seqlens is None else cu_seqlens, scale, T, H, K, V),
        {"VAR": dvar is not None, "IS_VARLEN": cu_seqlens is not None, "C": launch.chunk, "BK": pow2(K),
         "BV": pow2(V)}, launch.num_warps, STAGES)
    return dq, dk, dv, dgates, dM0, dP0


def chunk_cotangents(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], variance: bool, do: Optional[Tensor],
                     dvar: Optional[Tensor], dMT: Optional[Tensor], dPT: Optional[Tensor]
                     ) -> tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """The cotangents as the backward kernel takes them: contiguous, zeros for an output autograd left out, dvar
    None without the variance."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = dict(dtype=torch.float32, device=q.device)
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dvar = None if not variance else (torch.zeros(B, T, H, **f32) if dvar is None else dvar.float().contiguous())
    dMT = torch.zeros(N, H, K, v.shape[-1], **f32) if dMT is None else dMT.float().contiguous()
    dPT = torch.zeros(N, H, K, K, **f32) if dPT is None else dPT.float().contiguous()
    return do, dvar, dMT, dPT
