"""The conditioning of the Bayesian filter: the inputs on which its backends are exact, and the checks that
refuse the rest.

A step's covariance update ``P = P^- - u u^T / s`` (``u = P^- k``, ``s = k^T u + r``) subtracts two matrices of
the size of ``P^-``. Along a key observed with little noise the difference is about ``r / |k|^2`` (the variance
left in a direction that was just measured), while rounding leaves an error of about ``eps ||P^-||``; that
direction's relative error, and through the next gains the mean's and the read-out's, is about ``eps`` times the
condition of the innovation::

    kappa_t = |k_t|^2 rho_t / r_t   >= (s_t - r_t) / r_t,     rho_t >= ||P^-_t||

with ``eps`` the unit roundoff of the arithmetic (:func:`unit_roundoff`). A covariance held as a dense matrix in
that precision holds its small eigenvalues to ``eps ||P||`` at best, so no rearrangement of the update (the
Joseph form, symmetrisation) lifts the limit: it is the representation's. ``rho_t`` comes from the inputs
without running the filter: an observation never increases the covariance, so ``||P^-_t|| <= rho_t`` with::

    rho_0 = ||P_0||_inf (largest absolute row sum, >= ||P_0||_2 for a symmetric P_0), or the prior p
    rho_t = a_t^2 rho_{t-1} + w_t = exp(G_t) (rho_0 + sum_{l <= t} w_l exp(-G_l)),   G_t = 2 sum_{l <= t} log a_l

computed in log space (``logcumsumexp``), one sequence of ``cu_seqlens`` at a time. Each token's update errs by
about ``eps kappa`` relative to the state; a memory that forgets (``a < 1``) or gains process noise loses old
errors as it loses old evidence, while one that does neither adds them up over the sequence, as recursive least
squares without forgetting does: the stated bound (:func:`error_bound`) carries a factor T for that worst case.
A backend that factors C tokens at once ("chunk", "chunk_triton") meets C times the condition
(:func:`amplification`); beyond its bound ``bayes_filter`` hands the inputs to a token-loop backend. With the
covariance reset (``reset=True``) the mean is the gated delta rule, whose write ``beta |k|^2 <= 1`` is well
conditioned for any kappa, so the check does not apply there.

The checks read values, so they run where ``linear_recurrence``'s value checks run: on CPU tensors, and on GPU
tensors only with debug checks on (``LINMEM_DEBUG=1`` or :func:`linmem.ops.set_debug_checks`), never under
``torch.compile``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..checks import values_checkable
from ..recurrence.inputs import LOG_DECAY_FLOOR

#: tokens per chunk of the "chunk" backend (:mod:`linmem.ops.bayes.chunk`)
CHUNK_SIZE = 64
#: tokens per chunk of the "chunk_triton" backend, at most: what its backward's shared memory holds on Hopper at
#: K = V = 128 (``dev/kernels/bayes_chunk_resources.py``)
FUSED_CHUNK_SIZE = 32
#: the largest ``eps * A * kappa`` a backend serves (A: :func:`amplification`)
TOLERANCE = 1e-2
#: the constant of the stated error bound ``ERROR_FACTOR * eps * (K + A * kappa * T)`` (:func:`error_bound`)
ERROR_FACTOR = 4.0

F64 = torch.float64


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the filter's arithmetic for inputs of ``dtype``: fp64 for fp64 inputs (the reference
    and chunk backends), fp32 for every other dtype (all backends accumulate in fp32)."""
    return 2.0 ** -53 if dtype == F64 else 2.0 ** -24


def amplification(backend: str, T: int) -> int:
    """How much more a backend's error grows with kappa than the token loop's on sequences of T tokens: 1 for
    "reference" and "triton" (one key a step), the chunk length ``min(C, T)`` for "chunk" (C = CHUNK_SIZE) and
    "chunk_triton" (C = FUSED_CHUNK_SIZE): a C x C innovation matrix has condition up to C kappa."""
    size = {"chunk": CHUNK_SIZE, "chunk_triton": FUSED_CHUNK_SIZE}.get(backend)
    return 1 if size is None else max(1, min(size, T))


def error_bound(kappa: float, K: int, T: int, dtype: torch.dtype, amplification: int = 1) -> float:
    """The stated bound ``ERROR_FACTOR * eps * (K + A * kappa * T)`` of a backend's error against the exact filter
    on sequences of at most T tokens of condition ``kappa`` (served while ``eps * A * kappa <= TOLERANCE``), key
    head dim K and input ``dtype``, A its :func:`amplification`. The error of the state (M, P) is the error ratio
    ``rms(x - exact) / rms(exact)``; a read-out's is relative to the scale of its terms, ``|o_t - o*_t| /
    (scale |q_t| ||M_t||_F)`` and ``|var_t - var*_t| / (|q_t|^2 ||P_t||_F + r_t)`` (a read-out is a dot product
    with the state, so where q_t is nearly orthogonal to it its own rounding dominates). The T term is the
    worst case, memories that neither forget nor gain process noise; docs/bayes.md has what was measured."""
    return ERROR_FACTOR * unit_roundoff(dtype) * (K + amplification * kappa * T)


def chunk_refusal(condition: Optional[float], dtype: torch.dtype, T: int, backend: str = "chunk") -> Optional[str]:
    """Why a chunked backend ("chunk", "chunk_triton") does not serve inputs of condition ``condition`` (the inputs'
    largest kappa, None where unchecked), ``dtype`` and length ``T``: its ``eps * A * kappa`` is beyond
    :data:`TOLERANCE`; else None."""
    A = amplification(backend, T)
    if condition is None or unit_roundoff(dtype) * A * condition <= TOLERANCE:
        return None
    return (f"the innovation's condition {condition:.3g} times the chunk length {A} is beyond "
            f"{TOLERANCE / unit_roundoff(dtype):.3g}, where its C x C factorisation stays exact")


def _fail(message: str) -> ValueError:
    return ValueError(f"bayes_filter: {message}")


def covariance_norm(P: torch.Tensor) -> torch.Tensor:
    """``||(P + P^T) / 2||_inf`` of ``P [..., K, K]`` (fp64, ``[...]``): an upper bound of the spectral norm of
    the symmetric part, the covariance the filter reads."""
    S = P.detach().to(F64)
    return (0.5 * (S + S.transpose(-1, -2))).abs().sum(-1).amax(-1)


def check_covariance(name: str, P: torch.Tensor) -> None:
    """Refuse a covariance ``P [N, H, K, K]`` whose symmetric part ``(P + P^T) / 2`` is not positive semi-definite
    beyond the rounding of its dtype (eigenvalues below ``-K eps ||P||_inf``)."""
    if not (P.numel() and values_checkable(P)):
        return
    K = P.shape[-1]
    S = P.detach().to(F64)
    S = 0.5 * (S + S.transpose(-1, -2))
    slack = (K * unit_roundoff(P.dtype) * covariance_norm(S)).clamp_min(torch.finfo(F64).tiny)  # P = 0 passes
    if not bool(torch.isfinite(slack).all()):
        raise _fail(f"`{name}` must be finite (a covariance), got a non-finite entry")
    eye = torch.eye(K, dtype=F64, device=P.device)
    if bool((torch.linalg.cholesky_ex(S + slack[..., None, None] * eye).info == 0).all()):
        return
    lowest = torch.linalg.eigvalsh(S)[..., 0]
    n, h = divmod(int(lowest.flatten().argmin()), P.shape[1])
    raise _fail(
        f"`{name}` must be a covariance: symmetric positive semi-definite (its symmetric part is used); sequence "
        f"{n}, head {h} has the eigenvalue {float(lowest[n, h]):.3g} (down to -{float(slack[n, h]):.3g} passes as "
        "rounding)"
    )


def _prior_bound(log_decay: torch.Tensor, process_noise: Optional[torch.Tensor], rho0: torch.Tensor) -> torch.Tensor:
    """log rho_t [B, T, H] for gates [B, T, H] (fp64) from rho_0 [B, H]; see the module docstring."""
    G = 2 * log_decay.clamp_min(LOG_DECAY_FLOOR).cumsum(1)
    log_rho = G + rho0.log()[:, None]
    if process_noise is None:
        return log_rho
    return torch.logaddexp(log_rho, G + torch.logcumsumexp(process_noise.log() - G, dim=1))


def innovation_condition(k: torch.Tensor, log_decay: torch.Tensor, obs_noise: torch.Tensor,
                         process_noise: Optional[torch.Tensor], rho0: torch.Tensor,
                         cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """kappa_t = |k_t|^2 rho_t / r_t ``[B, T, H]`` (fp64) for k ``[B, T, H, K]``, the gates ``[B, T, H]`` and
    ``rho0 = ||P_0|| [N, H]``; each sequence of ``cu_seqlens`` from its own ``rho0``."""
    k, g, r = (x.detach().to(F64) for x in (k, log_decay, obs_noise))
    w = None if process_noise is None else process_noise.detach().to(F64)
    if cu_seqlens is None:
        log_rho = _prior_bound(g, w, rho0)
    else:
        bounds = cu_seqlens.tolist()
        log_rho = torch.cat([
            _prior_bound(g[:, s:e], None if w is None else w[:, s:e], rho0[n:n + 1])
            for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))
        ], dim=1)
    return (k * k).sum(-1) * log_rho.exp() / r


def check_conditioning(k: torch.Tensor, log_decay: torch.Tensor, obs_noise: torch.Tensor,
                       process_noise: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], *, prior: float,
                       covariance: Optional[torch.Tensor]) -> Optional[float]:
    """The largest kappa_t of the inputs, or None where values are not checked; refuse it beyond
    ``TOLERANCE / eps``, which no backend serves. Arguments as :func:`innovation_condition`, with
    rho_0 = ``||covariance||`` (the initial P ``[N, H, K, K]``), or ``prior`` without one."""
    if not values_checkable(k):
        return None
    if not k.numel():
        return 0.0
    eps = unit_roundoff(k.dtype)
    N, H = (k.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1), k.shape[2]
    rho0 = (torch.full((N, H), prior, dtype=F64, device=k.device) if covariance is None
            else covariance_norm(covariance))
    kappa = innovation_condition(k, log_decay, obs_noise, process_noise, rho0, cu_seqlens)
    bt, h = divmod(int(kappa.flatten().argmax()), kappa.shape[2])
    b, t = divmod(bt, kappa.shape[1])
    worst = float(kappa[b, t, h])
    if not worst * eps > TOLERANCE:
        return worst
    precision = "float64" if k.dtype == F64 else "float32"
    source = "`prior`" if covariance is None else "`initial_state`'s P"
    wider = k.dtype != F64 and worst * unit_roundoff(F64) <= TOLERANCE
    raise _fail(
        f"the innovation s = k^T P k + `obs_noise` is too ill-conditioned for {precision} arithmetic: at token {t} "
        f"(batch {b}, head {h}) |k|^2 ||P^-|| / obs_noise = {worst:.3g} with `obs_noise` = "
        f"{float(obs_noise[b, t, h]):.3g}, |`k`|^2 = {float(k[b, t, h].double().pow(2).sum()):.3g}; the filter is "
        f"exact only up to {TOLERANCE / eps:.3g} (= {TOLERANCE:g} / the unit roundoff {eps:.3g}). Raise `obs_noise`, "
        f"shrink the keys `k` or {source}"
        + (", or pass float64 inputs (reference and chunk backends)" if wider else "")
    )
