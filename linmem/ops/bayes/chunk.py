"""The Bayesian filter chunk by chunk: the exact joint-Gaussian form of C tokens at once.

Per head, over a chunk of C tokens i = 1..C from the filtered belief (m [K, V], P [K, K]) at its
start, the memory follows ``M_i = a_i M_{i-1} + xi_i`` with ``Cov(xi_i) = w_i I`` (w = process noise,
0 if None) and is observed as ``y_i = M_i^T k_i + eps_i`` (variance r_i). With
``G_i = sum_{l <= i} log a_l`` (G_0 = 0), ``alpha_i = exp(G_i)``, ``alpha_{i:j} = exp(G_j - G_i)`` for
i <= j (always the exp of a difference <= 0) and the noise gathered since the chunk start
``beta_i = a_i^2 beta_{i-1} + w_i = sum_{l <= i} alpha_{l:i}^2 w_l``, the prior states are jointly
Gaussian with ``Cov(M_i, M_j) = alpha_i alpha_j P + alpha_{i:j} beta_i I`` (i <= j), so::

    S_ij = alpha_i alpha_j k_i^T P k_j + alpha_{i:j} beta_i k_i . k_j + r_i [i = j]   innovations [C, C], = L L^T
    Z    = L^-1 (Y - Yhat),  Yhat_i = alpha_i k_i^T m                                whitened [C, V]
    H_it = alpha_i alpha_t k_i^T P q_t + alpha_{i:t} beta_i k_i . q_t  (0 for i > t)  Cov(y_i, q_t^T M_t) [C, C]
    W    = L^-1 H                                                                    [C, C]
    o_t   = scale * (alpha_t q_t^T m + sum_{i <= t} W_it Z_i)                         [C, V]
    var_t = alpha_t^2 q_t^T P q_t + beta_t |q_t|^2 - sum_{i <= t} W_it^2 + r_t        [C]
    R_i   = alpha_i alpha_C k_i^T P + alpha_{i:C} beta_i k_i^T,  F = L^-1 R          Cov(y_i, M_C) [C, K]
    m'    = alpha_C m + F^T Z,   P' = alpha_C^2 P + beta_C I - F^T F                  the next chunk's start

(L is lower triangular, so the first t rows of W only read y_1..t: the read-out at t is the filter's.)
Chunks run one after another; every sequence of ``cu_seqlens`` runs alone from its own initial belief.
Everything runs in fp32 (fp64 for fp64 inputs); the gradients come from autograd through
``torch.linalg.cholesky`` and ``solve_triangular``. S meets up to C times the token loop's condition
(:mod:`.conditioning`): beyond it ``bayes_filter`` hands the inputs to the token loop, and where values are not
checked a factorisation that rounding made fail is a named ``ValueError``. Keep this file short and literal.
"""

from __future__ import annotations

from typing import Optional

import torch

from .conditioning import CHUNK_SIZE
from .inputs import FilterInputs, State, compute_dtype
from .reference import initial_belief


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _innovation_factor(S: torch.Tensor) -> torch.Tensor:
    """L with S = L L^T; a named error where rounding has left S [N, H, C, C] not positive definite."""
    try:
        return torch.linalg.cholesky(S)
    except torch.linalg.LinAlgError as error:
        raise ValueError(
            f"bayes_filter: backend 'chunk' cannot factor a chunk's innovation matrix in {S.dtype} ({error}): "
            "`obs_noise` is too small for the norms of `k` and of the covariance (`initial_state`'s P or `prior`), "
            "or `initial_state`'s P is not positive semi-definite. The token-loop backends ('reference', 'triton') "
            "serve inputs up to the chunk length times worse conditioned; debug checks (LINMEM_DEBUG=1) name the "
            "token (docs/bayes.md, \"Conditioning\")"
        ) from error


def chunk_step(m, P, q, k, v, g, r, w, scale: float, variance: bool):
    """One chunk for N sequences; returns (o [N, H, C, V], var [N, H, C] or None without ``variance``, m', P').

    m: [N, H, K, V]; P: [N, H, K, K]; q, k: [N, H, C, K]; v: [N, H, C, V]; g (log decay), r, w: [N, H, C]
    (w may be None). All in the accumulation dtype.
    """
    C = q.shape[-2]
    G = g.cumsum(-1)  # [N, H, C]
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu()  # i <= j
    A = (G[..., None, :] - G[..., :, None]).masked_fill(~upper, float("-inf")).exp()  # alpha_{i:j}, 0 for i > j
    alpha = G.exp()  # [N, H, C]
    AA = (G[..., :, None] + G[..., None, :]).exp()  # alpha_i alpha_j  [N, H, C, C]
    beta = torch.zeros_like(G) if w is None else (A.transpose(-1, -2) ** 2 @ w[..., None])[..., 0]  # [N, H, C]
    B = A * beta[..., :, None]  # alpha_{i:j} beta_i, 0 for i > j  [N, H, C, C]
    kP = k @ P  # [N, H, C, K]
    B_sym = B + _t(B) - torch.diag_embed(torch.diagonal(B, dim1=-2, dim2=-1))
    S = AA * (kP @ _t(k)) + B_sym * (k @ _t(k)) + torch.diag_embed(r)  # [N, H, C, C]
    L = _innovation_factor(S)
    Hm = (AA * (kP @ _t(q))).masked_fill(~upper, 0.0) + B * (k @ _t(q))  # [N, H, C(i), C(t)]
    R = (AA[..., -1:] * kP) + B[..., -1:] * k  # [N, H, C, K]
    Yhat = alpha[..., None] * (k @ m)  # [N, H, C, V]
    V = v.shape[-1]
    solved = torch.linalg.solve_triangular(L, torch.cat([v - Yhat, Hm, R], -1), upper=False)
    Z, W, F = solved[..., :V], solved[..., V:V + C].masked_fill(~upper, 0.0), solved[..., V + C:]  # W: i <= t only
    o = scale * (alpha[..., None] * (q @ m) + _t(W) @ Z)  # [N, H, C, V]
    var = None
    if variance:
        qPq = ((q @ P) * q).sum(-1)
        var = alpha ** 2 * qPq + beta * (q * q).sum(-1) - (W * W).sum(-2) + r  # [N, H, C]
    aC = alpha[..., -1, None, None]
    eye = torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    m = aC * m + _t(F) @ Z
    P = aC ** 2 * P + beta[..., -1, None, None] * eye - _t(F) @ F
    return o, var, m, 0.5 * (P + _t(P))


def _scan(xs, m, P, scale: float, variance: bool, chunk_size: int):
    """Run the chunks over T for a batch. xs = (q, k, v, g, r, w): [N, T, H, ...] in the accumulation dtype
    (w may be None); var only with ``variance`` (else None)."""
    q, k, v, g, r, w = (None if x is None else x.transpose(1, 2) for x in xs)  # [N, H, T, ...]
    N, H, T = q.shape[:3]
    outputs, variances = [], []
    for s in range(0, T, chunk_size):
        chunk = (None if x is None else x[:, :, s : s + chunk_size] for x in (q, k, v, g, r, w))
        o, var, m, P = chunk_step(m, P, *chunk, scale, variance)
        outputs.append(o)
        variances.append(var)
    if not outputs:
        return q.new_zeros(N, T, H, v.shape[-1]), q.new_zeros(N, T, H) if variance else None, m, P
    return torch.cat(outputs, 2).transpose(1, 2), torch.cat(variances, 2).transpose(1, 2) if variance else None, m, P


def chunk_filter(
    inputs: FilterInputs, chunk_size: int = CHUNK_SIZE
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[State]]:
    """Chunked backend of :func:`linmem.ops.bayes_filter` (inputs already validated, ``reset=False``).

    Returns the contract of :func:`.reference.reference_filter`: ``(o [B, T, H, V]`` in q's dtype,
    ``var [B, T, H]`` or None, ``(M [N, H, K, V], P [N, H, K, K])`` or None), var and state in fp32
    (fp64 for fp64 inputs).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_filter: `chunk_size` must be an int >= 1, got {chunk_size!r}")
    if inputs.reset:
        raise ValueError("chunk_filter: reset=True is the delta rule, served by the 'delta' backend")
    acc = compute_dtype(inputs.q)
    xs = [None if x is None else x.to(acc) for x in (inputs.q, inputs.k, inputs.v, inputs.log_decay,
                                                      inputs.obs_noise, inputs.process_noise)]
    variance = inputs.return_variance
    if inputs.cu_seqlens is None:
        o, var, M, P = _scan(xs, *initial_belief(inputs, 0, xs[0].shape[0], acc), inputs.scale, variance, chunk_size)
    else:  # variable length: each sequence runs alone from its own initial belief
        bounds = inputs.cu_seqlens.tolist()
        pieces = [
            _scan([None if x is None else x[:, start:end] for x in xs], *initial_belief(inputs, n, 1, acc),
                  inputs.scale, variance, chunk_size)
            for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]
        o, var, M, P = (None if parts[0] is None else torch.cat(parts, dim=1 if i < 2 else 0)
                        for i, parts in enumerate(zip(*pieces)))
    return o.to(inputs.q.dtype), var, (M, P) if inputs.output_final_state else None
