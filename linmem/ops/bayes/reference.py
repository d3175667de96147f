"""The Bayesian filter one token at a time: the ground truth of every faster backend.

Per head the memory is a Gaussian belief over a matrix ``W: [K, V]`` (the value of key k is
``W^T k``): mean ``M: [K, V]``, covariance ``P: [K, K]`` shared over the V columns. Step t, with
``a = exp(log_decay_t)``, ``r = obs_noise_t``, ``Q = process_noise_t`` (Memory by Design,
arXiv 2605.31163)::

    P^- = a^2 P_{t-1} + Q I                   predict (P^- = p I when reset)
    u   = P^- k_t                             write direction, steered by uncertainty
    s   = k_t . u + r                         innovation variance
    M_t = a M_{t-1} + u (v_t - (a M_{t-1})^T k_t)^T / s
    P_t = P^- - u u^T / s
    o_t = scale * M_t^T q_t                   read-out (the predictive mean)
    var_t = q_t^T P_t q_t + r                 predictive variance of q_t^T W

Everything runs in fp32 (fp64 for fp64 inputs). Keep this file short and literal.
"""

from __future__ import annotations

from typing import Optional

import torch

from .inputs import FilterInputs, State, compute_dtype


def filter_step(
    M: torch.Tensor,
    P: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    r: torch.Tensor,
    Q: Optional[torch.Tensor],
    *,
    prior: float,
    reset: bool,
    scale: float,
    variance: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One step for N sequences; returns (o [N, H, V], var [N, H] or None without ``variance``, M_t, P_t).

    M: [N, H, K, V]; P: [N, H, K, K]; q, k: [N, H, K]; v: [N, H, V]; a (the decay, not its log),
    r, Q: [N, H] (Q may be None). All in the accumulation dtype.
    """
    col = lambda x: x[..., :, None]  # noqa: E731  [N, H, D] -> [N, H, D, 1]
    row = lambda x: x[..., None, :]  # noqa: E731  [N, H, D] -> [N, H, 1, D]
    if reset:
        P_prior = prior * torch.eye(k.shape[-1], dtype=P.dtype, device=P.device).expand_as(P)
    else:
        P_prior = col(col(a)) ** 2 * P
        if Q is not None:
            P_prior = P_prior + col(col(Q)) * torch.eye(k.shape[-1], dtype=P.dtype, device=P.device)
    u = (P_prior @ col(k))[..., 0]  # [N, H, K]
    s = (k * u).sum(-1) + r  # [N, H]
    M_prior = col(col(a)) * M
    e = v - (row(k) @ M_prior)[..., 0, :]  # innovation [N, H, V]
    M = M_prior + col(u) * row(e) / col(col(s))
    P = P_prior - col(u) * row(u) / col(col(s))
    o = scale * (row(q) @ M)[..., 0, :]
    var = (row(q) @ P @ col(q))[..., 0, 0] + r if variance else None
    return o, var, M, P


def _scan(q, k, v, a, r, Q, M, P, prior, reset, scale, variance):
    """Run the filter over T for a batch; every input already in the accumulation dtype. The variances are
    computed only with ``variance`` (else None)."""
    outputs, variances = [], []
    for t in range(q.shape[1]):
        o, var, M, P = filter_step(
            M, P, q[:, t], k[:, t], v[:, t], a[:, t], r[:, t], None if Q is None else Q[:, t],
            prior=prior, reset=reset, scale=scale, variance=variance,
        )
        outputs.append(o)
        variances.append(var)
    var = (torch.stack(variances, 1) if outputs else q.new_zeros(q.shape[:3])) if variance else None
    if not outputs:
        return q.new_zeros(*q.shape[:3], v.shape[-1]), var, M, P
    return torch.stack(outputs, 1), var, M, P


def initial_belief(inputs: FilterInputs, n: int, count: int, dtype: torch.dtype) -> State:
    """(M, P) of sequences n .. n + count - 1: the given state with P read as its symmetric part
    (P + P^T) / 2, or the prior M = 0, P = p I."""
    q, v = inputs.q, inputs.v
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    if inputs.initial_state is None:
        eye = torch.eye(K, dtype=dtype, device=q.device)
        return q.new_zeros(count, H, K, V, dtype=dtype), inputs.prior * eye.expand(count, H, K, K)
    M0, P0 = (x[n : n + count].to(dtype) for x in inputs.initial_state)
    return M0, 0.5 * (P0 + P0.transpose(-1, -2))


def reference_filter(inputs: FilterInputs) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[State]]:
    """Token-loop backend of :func:`linmem.ops.bayes_filter` (inputs already validated)."""
    acc = compute_dtype(inputs.q)
    cast = lambda t: None if t is None else t.to(acc)  # noqa: E731
    q, k, v, r, Q = map(cast, (inputs.q, inputs.k, inputs.v, inputs.obs_noise, inputs.process_noise))
    a = torch.exp(inputs.log_decay.to(acc))
    run = lambda part, n, count: _scan(  # noqa: E731
        part(q), part(k), part(v), part(a), part(r), None if Q is None else part(Q),
        *initial_belief(inputs, n, count, acc), inputs.prior, inputs.reset, inputs.scale, inputs.return_variance,
    )
    if inputs.cu_seqlens is None:
        o, var, M, P = run(lambda t: t, 0, q.shape[0])
    else:  # variable length: each sequence runs alone from its own initial belief
        bounds = inputs.cu_seqlens.tolist()
        pieces = [run(lambda t, s=start, e=end: t[:, s:e], n, 1)
                  for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))]
        o, var, M, P = (None if parts[0] is None else torch.cat(parts, dim=1 if i < 2 else 0)
                        for i, parts in enumerate(zip(*pieces)))
    return (
        o.to(inputs.q.dtype),
        var if inputs.return_variance else None,
        (M, P) if inputs.output_final_state else None,
    )


def information_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor,
    obs_noise: torch.Tensor,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The information-form memory whose read-out ignores its precision: the additive family.

    Per head the information vector ``eta: [K, V]`` and the precision ``Lambda: [K, K]`` grow by
    the evidence of each token, both decayed by ``a_t = exp(log_decay_t)``::

        eta_t    = a_t eta_{t-1}    + k_t v_t^T / r_t
        Lambda_t = a_t Lambda_{t-1} + k_t k_t^T / r_t
        o_t      = scale * eta_t^T q_t

    The read-out is linear attention / GLA / Mamba-2 with keys ``k / r`` (the posterior mean would
    be ``Lambda^-1 eta``). q, k: ``[B, T, H, K]``, v: ``[B, T, H, V]``, log_decay, obs_noise:
    ``[B, T, H]``; computed in fp64. Returns ``(o [B, T, H, V], eta [B, H, K, V], Lambda [B, H, K, K])``.

    Example:
        >>> B, T, H, K = 1, 5, 2, 4
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        >>> o, eta, Lam = information_form(q, k, v, log_decay=torch.zeros(B, T, H), obs_noise=torch.ones(B, T, H))
        >>> torch.allclose(Lam, torch.einsum("bthi,bthj->bhij", k, k).double())
        True
    """
    q, k, v, g, r = (x.double() for x in (q, k, v, log_decay, obs_noise))
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    eta = q.new_zeros(B, H, K, v.shape[-1])
    Lam = q.new_zeros(B, H, K, K)
    outputs = []
    for t in range(T):
        a = torch.exp(g[:, t])[..., None, None]
        kr = k[:, t] / r[:, t, :, None]
        eta = a * eta + kr[..., :, None] * v[:, t, :, None, :]
        Lam = a * Lam + kr[..., :, None] * k[:, t, :, None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", eta, q[:, t]))
    return torch.stack(outputs, 1), eta, Lam
