"""The gradient of one chunk of the chunked Bayesian filter, by hand: the maths of the "chunk_triton" backward.

:func:`chunk_step_vjp` is the vector-Jacobian product of :func:`.chunk.chunk_step` written out step by step
(the names are chunk.py's; ``U`` is the mask i <= j, ``sym(X) = (X + X^T) / 2``). It recomputes the chunk from
its start ``(m, P)`` with the explicit inverse ``Li = L^-1`` of the innovation factor, so that every triangular
solve is a product::

    Z = Li E (E = Y - Yhat),   Wf = Li H,   W = U * Wf,   F = Li R

Backwards from the cotangents ``do, dvar`` of the chunk's read-outs and ``dm', dP'`` of its end state
(``D = sym(dP')``, ``aC = alpha_C``)::

    dZ = scale W do + F dm'                    dW = U * (scale Z do^T - 2 W diag(dvar))
    dF = Z dm'^T - 2 F D                       dm = aC dm' + scale q^T (alpha do) - k^T (alpha dE)
    X  = -(dZ Z^T + dW Wf^T + dF F^T)          (= L^T dL: the cotangent of L, through Li = L^-1)
    dS = Li^T Phi(X) Li,   Phi(X) = (tril(X) + tril(X, -1)^T) / 2      (the Cholesky factor's VJP)
    dE = Li^T dZ,   dH = U * Li^T dW,   dR = Li^T dF,   dv = dE

and from dS, dH, dR, dE through the products that built S, H, R and Yhat to q, k, P and the decays
``alpha_i alpha_j``, ``alpha_{i:j}``, ``beta`` (:func:`_gate_grads`: back to the log decays by a reverse
cumulative sum, the process noise through ``beta_j = sum_l alpha_{l:j}^2 w_l``). dP leaves unsymmetrised:
the previous chunk's ``sym`` (or the initial belief's) symmetrises it. :func:`chunk_backward` runs the chunks
in reverse over a batch, from the chunk-start states the forward keeps. Tested against autograd through
chunk.py in fp64 (``tests/ops/test_bayes_chunk_triton.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def _diag(x: Tensor) -> Tensor:
    return torch.diagonal(x, dim1=-2, dim2=-1)


def _gate_grads(g: Tensor, w: Tensor, dalpha: Tensor, dAA: Tensor, dB: Tensor, dbeta: Tensor
                ) -> tuple[Tensor, Tensor]:
    """(dg, dw) [N, H, C] from the cotangents of alpha [C], AA = alpha_i alpha_j [C, C], B = U * alpha_{i:j} beta_i
    [C, C] and beta [C] (w: the process noise, zeros without it)."""
    C = g.shape[-1]
    G = g.cumsum(-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=g.device).triu()
    A = (G[..., None, :] - G[..., :, None]).masked_fill(~upper, float("-inf")).exp()
    beta = (A * A * w[..., :, None]).sum(-2)
    dbeta = dbeta + (dB * A).sum(-1)  # B_ij = A_ij beta_i
    dA = dB * beta[..., :, None] + 2 * A * w[..., :, None] * dbeta[..., None, :]  # and beta_j = sum_l A_lj^2 w_l
    dw = (A * A * dbeta[..., None, :]).sum(-1)
    AA = (G[..., :, None] + G[..., None, :]).exp()
    Y = (dA * A).masked_fill(~upper, 0.0)  # A_ij = exp(G_j - G_i)
    dG = dalpha * G.exp() + (dAA * AA).sum(-1) + (dAA * AA).sum(-2) + Y.sum(-2) - Y.sum(-1)
    return dG.flip(-1).cumsum(-1).flip(-1), dw  # G = cumsum(g)


def chunk_step_vjp(m: Tensor, P: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, r: Tensor, w: Optional[Tensor],
                   scale: float, do: Tensor, dvar: Optional[Tensor], dm_next: Tensor, dP_next: Tensor
                   ) -> tuple[Tensor, ...]:
    """The VJP of :func:`.chunk.chunk_step` for N sequences.

    Inputs as chunk_step's (m [N, H, K, V], P [N, H, K, K] symmetric, q, k [N, H, C, K], v [N, H, C, V], g, r, w
    [N, H, C], w may be None) and the cotangents do [N, H, C, V], dvar [N, H, C] (None: the variance was not
    read), dm_next [N, H, K, V], dP_next [N, H, K, K] of the chunk end. Returns
    ``(dm, dP, dq, dk, dv, dg, dr, dw)``, dw None without w.
    """
    C = q.shape[-2]
    w0 = torch.zeros_like(g) if w is None else w
    G = g.cumsum(-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu()
    A = (G[..., None, :] - G[..., :, None]).masked_fill(~upper, float("-inf")).exp()
    alpha = G.exp()
    AA = (G[..., :, None] + G[..., None, :]).exp()
    beta = (A * A * w0[..., :, None]).sum(-2)
    B = A * beta[..., :, None]
    B_sym = B + _t(B) - torch.diag_embed(_diag(B))
    kP, KK, KQ = k @ P, k @ _t(k), k @ _t(q)
    KPK, KPQ = kP @ _t(k), kP @ _t(q)
    S = AA * KPK + B_sym * KK + torch.diag_embed(r)
    Li = torch.linalg.solve_triangular(torch.linalg.cholesky(S), torch.eye(C, dtype=S.dtype, device=S.device),
                                       upper=False)
    Hm = (AA * KPQ).masked_fill(~upper, 0.0) + B * KQ
    R = AA[..., -1:] * kP + B[..., -1:] * k
    km = k @ m
    Z = Li @ (v - alpha[..., None] * km)
    Wf = Li @ Hm
    W = Wf.masked_fill(~upper, 0.0)
    F = Li @ R
    aC = alpha[..., -1, None, None]

    # the read-outs and the chunk end
    D = 0.5 * (dP_next + _t(dP_next))
    dZ = scale * W @ do + F @ dm_next
    dW = scale * Z @ _t(do)
    dF = Z @ _t(dm_next) - 2 * F @ D
    dalpha = scale * (do * (q @ m)).sum(-1)
    dalpha[..., -1] += (dm_next * m).sum((-2, -1)) + 2 * aC[..., 0, 0] * (D * P).sum((-2, -1))
    dq = scale * alpha[..., None] * (do @ _t(m))
    dm = aC * dm_next + scale * _t(q) @ (alpha[..., None] * do)
    dP = aC ** 2 * D
    dbeta = torch.zeros_like(beta)
    dbeta[..., -1] = _diag(D).sum(-1)
    dr = torch.zeros_like(r)
    if dvar is not None:
        qP = q @ P
        a2dvar = alpha ** 2 * dvar
        dalpha += 2 * alpha * (qP * q).sum(-1) * dvar
        dq += 2 * a2dvar[..., None] * qP + 2 * (beta * dvar)[..., None] * q
        dP += _t(q) @ (a2dvar[..., None] * q)
        dbeta += dvar * (q * q).sum(-1)
        dW -= 2 * W * dvar[..., None, :]
        dr += dvar
    dW = dW.masked_fill(~upper, 0.0)

    # through the whitening by Li = L^-1 and the Cholesky factor L of S
    X = -(dZ @ _t(Z) + dW @ _t(Wf) + dF @ _t(F))
    dS = _t(Li) @ (0.5 * (X.tril() + _t(X.tril(-1)))) @ Li
    dE = _t(Li) @ dZ
    dH = (_t(Li) @ dW).masked_fill(~upper, 0.0)
    dR = _t(Li) @ dF

    # Yhat = alpha * (k m), E = v - Yhat
    dalpha -= (dE * km).sum(-1)
    dk = -alpha[..., None] * (dE @ _t(m))
    dm -= _t(k) @ (alpha[..., None] * dE)
    # R = AA[:, C] * kP + B[:, C] * k
    dkP = AA[..., -1:] * dR
    dAA = torch.zeros_like(AA)
    dB = torch.zeros_like(B)
    dAA[..., -1] += (dR * kP).sum(-1)
    dk += B[..., -1:] * dR
    dB[..., -1] += (dR * k).sum(-1)
    # H = U * AA * (kP q^T) + B * (k q^T)
    X1, X2 = dH * AA, dH * B
    dkP += X1 @ q
    dq += _t(X1) @ kP + _t(X2) @ k
    dk += X2 @ q
    dAA += dH * KPQ
    dB += dH * KQ
    # S = AA * (kP k^T) + B_sym * (k k^T) + diag(r), dS symmetric
    Y1, Y2 = dS * AA, dS * B_sym
    dkP += Y1 @ k
    dk += _t(Y1) @ kP + (Y2 + _t(Y2)) @ k
    dAA += dS * KPK
    dBs = dS * KK
    dB += (dBs + _t(dBs)).masked_fill(~upper, 0.0) - torch.diag_embed(_diag(dBs))
    dr += _diag(dS)
    # kP = k P
    dk += dkP @ P
    dP += _t(k) @ dkP

    dg, dw = _gate_grads(g, w0, dalpha, dAA, dB, dbeta)
    return dm, dP, dq, dk, dE, dg, dr, (None if w is None else dw)


def chunk_backward(starts: list[tuple[Tensor, Tensor]], xs: list[Optional[Tensor]], scale: float, chunk_size: int,
                   do: Tensor, dvar: Optional[Tensor], dMT: Tensor, dPT: Tensor) -> tuple[Tensor, ...]:
    """The gradients of one batch's chunked scan (:func:`.chunk._scan`), chunk by chunk in reverse.

    starts: the chunk-start ``(m, P)`` of every chunk (``P`` symmetric); xs = (q, k, v, g, r, w) ``[N, T, H, ...]``
    as the scan took them (w may be None); do ``[N, T, H, V]``, dvar ``[N, T, H]`` or None, dMT, dPT the
    cotangents of the final state. Returns ``(dq, dk, dv, dg, dr, dw, dM0, dP0)`` with the inputs' layout, dw
    None without w, dM0 and dP0 those of the initial belief (dP0 symmetric).
    """
    q, k, v, g, r, w = (None if x is None else x.transpose(1, 2) for x in xs)  # [N, H, T, ...]
    do = do.transpose(1, 2)
    dvar = None if dvar is None else dvar.transpose(1, 2)
    grads = [[] for _ in range(6)]
    dm, dP = dMT, dPT
    for c in reversed(range(len(starts))):
        s = slice(c * chunk_size, (c + 1) * chunk_size)
        chunk = [None if x is None else x[:, :, s] for x in (q, k, v, g, r, w)]
        dm, dP, *d = chunk_step_vjp(*starts[c], *chunk, scale, do[:, :, s], None if dvar is None else dvar[:, :, s],
                                    dm, dP)
        for acc, x in zip(grads, d):
            acc.insert(0, x)
    T = q.shape[2]
    empty = [q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)] + [g.new_zeros(g.shape)] * 3
    out = [None if parts and parts[0] is None else (torch.cat(parts, 2) if T else e).transpose(1, 2)
           for parts, e in zip(grads, empty)]
    if w is None:
        out[5] = None
    return (*out, dm, 0.5 * (dP + _t(dP)))
