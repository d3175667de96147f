"""The backends of the unified recurrence: what they are, how they are registered and chosen.

A backend is a function of one validated :class:`RecurrenceInputs` that returns
``(o, final_state)``, plus a ``refusal`` that says why it cannot serve some inputs (None when
it can). ``"auto"`` tries the registered backends fastest first; a named backend that refuses
falls back to ``"chunk"``, which serves every input. Decoding has its own list of fused
step kernels, tried in order, with the PyTorch step of the reference as the fallback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .chunk import chunk_recurrence
from .inputs import RecurrenceInputs
from .reference import reference_recurrence

logger = logging.getLogger("linmem.ops")

Result = tuple[torch.Tensor, Optional[torch.Tensor]]  # (o [B, T, H, V], final state [N, H, K, V] or None)


@dataclass(frozen=True)
class Backend:
    """A way to compute the recurrence: ``fn(inputs) -> (o, final_state)``; ``refusal(inputs)`` returns
    None when the backend can serve the inputs, else the reason."""

    name: str
    fn: Callable[[RecurrenceInputs], Result]
    refusal: Callable[[RecurrenceInputs], Optional[str]]


@dataclass(frozen=True)
class StepKernel:
    """A fused kernel for one decoding step: ``fn(inputs, state) -> o [B, H, V]`` updates ``state`` in place;
    ``refusal(inputs, state)`` returns None when it can serve the step, else the reason."""

    name: str
    fn: Callable[[RecurrenceInputs, torch.Tensor], torch.Tensor]
    refusal: Callable[[RecurrenceInputs, torch.Tensor], Optional[str]]


_BACKENDS: dict[str, Backend] = {}
_AUTO_ORDER: list[str] = []  # the order in which "auto" tries backends: fastest first
_STEP_KERNELS: list[StepKernel] = []
FALLBACK = "chunk"  # serves every input


def register_backend(backend: Backend, *, auto_priority: Optional[int] = None) -> None:
    """Add a backend; with ``auto_priority`` it takes part in "auto" (0 = tried first)."""
    _BACKENDS[backend.name] = backend
    if auto_priority is not None:
        if backend.name in _AUTO_ORDER:
            _AUTO_ORDER.remove(backend.name)
        _AUTO_ORDER.insert(auto_priority, backend.name)


def register_step_kernel(kernel: StepKernel) -> None:
    """Add a decoding kernel; ``linear_recurrence_step`` tries them in order when no gradient is recorded."""
    _STEP_KERNELS.append(kernel)


def available_backends() -> list[str]:
    """Names accepted by ``backend=``."""
    return ["auto", *_BACKENDS]


def choose_backend(backend: str, inputs: RecurrenceInputs) -> Backend:
    """The backend that computes ``inputs``: the named one, or the first of "auto" that serves them; a
    refusal is logged at debug level and the next candidate (finally ``"chunk"``) is tried."""
    if backend != "auto" and backend not in _BACKENDS:
        raise ValueError(
            f"linear_recurrence: unknown `backend` {backend!r}; valid: {', '.join(available_backends())}"
        )
    wanted = list(_AUTO_ORDER) if backend == "auto" else [backend]
    for name in wanted:
        reason = _BACKENDS[name].refusal(inputs)
        if reason is None:
            return _BACKENDS[name]
        logger.debug("linear_recurrence: backend %r cannot serve these inputs (%s); trying the next", name, reason)
    return _BACKENDS[FALLBACK]


def choose_step_kernel(inputs: RecurrenceInputs, state: torch.Tensor) -> Optional[StepKernel]:
    """The first fused decoding kernel that serves this step, or None (the PyTorch step then runs)."""
    for kernel in _STEP_KERNELS:
        reason = kernel.refusal(inputs, state)
        if reason is None:
            return kernel
        logger.debug("linear_recurrence_step: kernel %r cannot serve this step (%s)", kernel.name, reason)
    return None


register_backend(Backend("reference", reference_recurrence, lambda inputs: None))
register_backend(Backend(FALLBACK, chunk_recurrence, lambda inputs: None), auto_priority=0)
