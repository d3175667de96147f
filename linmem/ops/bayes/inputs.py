"""Validation of the inputs of the Bayesian filter (:func:`linmem.ops.bayes_filter`).

Every backend receives a :class:`FilterInputs` that has passed these checks. Shape and dtype
checks always run; checks of values (``log_decay <= 0``, ``obs_noise > 0``,
``process_noise`` finite and >= 0, ``cu_seqlens`` monotone, the initial covariance positive semi-definite and the
innovation's conditioning within what the backends serve: :mod:`.conditioning`) run on CPU tensors, and on GPU
tensors only with debug checks on (``LINMEM_DEBUG=1`` or :func:`linmem.ops.set_debug_checks`), as for
``linear_recurrence``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..checks import (
    check_cu_seqlens,
    check_device,
    check_float,
    check_positive,
    check_qkv_heads,
    check_shape,
    resolve_scale,
    values_checkable,
)
from .conditioning import check_conditioning, check_covariance

State = tuple[torch.Tensor, torch.Tensor]

OP = "bayes_filter"


@dataclass
class FilterInputs:
    """Validated inputs of :func:`linmem.ops.bayes_filter` (see its docstring)."""

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, H, V]
    log_decay: torch.Tensor  # [B, T, H], <= 0
    obs_noise: torch.Tensor  # [B, T, H], > 0 (r)
    process_noise: Optional[torch.Tensor]  # [B, T, H], >= 0 (Q = process_noise * I), or None
    prior: float  # p: a fresh sequence starts from M = 0, P = p I
    reset: bool  # P^- := p I at every step (the delta-rule reduction)
    scale: float  # read-out scale
    initial_state: Optional[State]  # (M [N, H, K, V], P [N, H, K, K])
    output_final_state: bool
    cu_seqlens: Optional[torch.Tensor]  # [N + 1]
    return_variance: bool
    condition: Optional[float]  # max_t kappa_t (conditioning.py); None where values are not checked or with reset

    @property
    def num_sequences(self) -> int:
        return self.q.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    @property
    def records_grad(self) -> bool:
        """Whether autograd records this call (grad mode on and some input requires a gradient)."""
        tensors = [self.q, self.k, self.v, self.log_decay, self.obs_noise, self.process_noise]
        if self.initial_state is not None:
            tensors += list(self.initial_state)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fail(message: str) -> ValueError:
    return ValueError(f"bayes_filter: {message}")


def _check_values(name: str, t: torch.Tensor, bad, rule: str) -> None:
    """Raise when ``bad(t)`` holds anywhere (values checked as in the module docstring)."""
    if t.numel() and values_checkable(t):
        mask = bad(t.detach())
        if bool(mask.any()):
            raise _fail(f"`{name}` must be {rule}; got {float(t.detach()[mask][0]):g}")


def _check_state(initial_state, N: int, H: int, K: int, V: int, device: torch.device) -> State:
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise TypeError(
            "bayes_filter: `initial_state` must be a pair (M [N, H, K, V], P [N, H, K, K]), got "
            f"{type(initial_state).__name__}"
        )
    M, P = initial_state
    for name, t in (("initial_state[0] (M)", M), ("initial_state[1] (P)", P)):
        check_float(OP, name, t)
        check_device(OP, name, t, device)
    check_shape(OP, "initial_state[0] (M)", M, [N, H, K, V], "[N, H, K, V] (N = number of sequences)")
    check_shape(OP, "initial_state[1] (P)", P, [N, H, K, K], "[N, H, K, K] (N = number of sequences)")
    return M, P


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor,
    obs_noise: torch.Tensor,
    process_noise: Optional[torch.Tensor],
    prior: float,
    reset: bool,
    scale: Optional[float],
    initial_state: Optional[State],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    return_variance: bool,
) -> FilterInputs:
    """Check every argument of ``bayes_filter``; return the normalised inputs."""
    B, T, H, K, V = check_qkv_heads(OP, q, k, v)

    gates = (("log_decay", log_decay), ("obs_noise", obs_noise), ("process_noise", process_noise))
    for name, t in gates:
        if t is None and name != "process_noise":
            raise TypeError(f"bayes_filter: `{name}` is required ([B, T, H] = {[B, T, H]}), got None")
        if t is not None:
            check_float(OP, name, t)
            check_shape(OP, name, t, [B, T, H], "[B, T, H]")
            check_device(OP, name, t, q.device)
    _check_values("log_decay", log_decay, lambda t: ~(t <= 0), "<= 0 (a decay in (0, 1] in log space)")
    _check_values("obs_noise", obs_noise, lambda t: ~(t > 0), "> 0 (an observation-noise variance)")
    if process_noise is not None:
        _check_values("process_noise", process_noise, lambda t: ~((t >= 0) & t.isfinite()),
                      ">= 0 and finite (a process-noise variance)")

    prior = check_positive(OP, "prior", prior, " (the prior variance p of P = p I)")
    if not isinstance(reset, bool):
        raise TypeError(f"bayes_filter: `reset` must be a bool, got {type(reset).__name__}")
    scale = resolve_scale(OP, scale, K)

    N = B if cu_seqlens is None else check_cu_seqlens(OP, cu_seqlens, B, T, q.device)
    if initial_state is not None:
        initial_state = _check_state(initial_state, N, H, K, V, q.device)
        check_covariance("initial_state[1] (P)", initial_state[1])
    condition = None
    if not reset:
        condition = check_conditioning(k, log_decay, obs_noise, process_noise, cu_seqlens, prior=prior,
                                       covariance=None if initial_state is None else initial_state[1])

    return FilterInputs(
        q=q, k=k, v=v, log_decay=log_decay, obs_noise=obs_noise, process_noise=process_noise, prior=prior,
        reset=reset, scale=scale, initial_state=initial_state, output_final_state=bool(output_final_state),
        cu_seqlens=cu_seqlens, return_variance=bool(return_variance), condition=condition,
    )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the PyTorch backends and of the state: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
