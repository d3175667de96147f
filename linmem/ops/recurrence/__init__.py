"""The unified linear recurrence: one entry point that validates its inputs, chooses a backend and calls
it (the backends and their registry: :mod:`.backends`)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import parallel
from .backends import (
    Backend,
    StepKernel,
    available_backends,
    choose_backend,
    choose_step_kernel,
    logger,
    register_backend,
    register_step_kernel,
)
from .inputs import RecurrenceInputs, compute_dtype, validate
from .reference import per_step_decay, recurrence_step

__all__ = [
    "linear_recurrence",
    "linear_recurrence_step",
    "Backend",
    "StepKernel",
    "RecurrenceInputs",
    "register_backend",
    "register_step_kernel",
    "available_backends",
]


def linear_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    bonus: Optional[torch.Tensor] = None,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The unified linear recurrence of linear attention, GLA, Mamba-2, RWKV and delta rules.

    Per step, with the per-head state ``S: [K, V]``::

        S' = diag(exp(log_decay_t)) S_{t-1}
        S' = S' + a_t^T (b_t S_{t-1})                 if a, b are given
        S_t = S' + beta_t k_t^T (v_t - k_t S')        if beta is given (delta rule)
        S_t = S' + k_t^T v_t                          otherwise (additive)
        o_t = scale * q_t S_t

    With ``bonus`` (RWKV-6 ``u``) the read-out uses the previous state:
    ``o_t = scale * (q_t S_{t-1} + (q_t . (u * k_t)) v_t)``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, all of one floating dtype.
        log_decay: natural-log decay in ``[-inf, 0]`` (``-inf`` forgets everything; NaN is refused),
            fp32 recommended: ``None``, ``[H]`` (constant per head), ``[B, T, H]`` (scalar per
            token), ``[B, T, H, K]`` (per key channel) or ``[B, T, H, K, V]`` (full; reference and
            chunk only).
        beta: ``[B, T, H]`` delta-rule write strength in ``[0, 2]`` (above 1: negative eigenvalues).
        bonus: ``[H, K]`` RWKV-6 bonus ``u``.
        a, b: ``[B, T, H, K]`` diagonal-plus-low-rank transition (RWKV-7); not with ``beta``.
        scale: read-out scale, a finite number > 0; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``, N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the final state ``[N, H, K, V]`` (fp32; fp64 for fp64 inputs).
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of N sequences packed along T (B == 1).
        backend: ``"auto"``, ``"reference"``, ``"chunk"`` (and ``"triton"`` when installed).
            A backend that cannot serve the inputs falls back to ``"chunk"`` (logged at debug level).

    Value checks (the ranges of ``log_decay`` and ``beta``, ``cu_seqlens``) run on CPU tensors,
    and on GPU tensors with debug checks on (``LINMEM_DEBUG=1`` or :func:`linmem.ops.set_debug_checks`).

    Limits, in every backend: the delta rule is stable while ``beta * |k|^2 <= 2`` (each step's
    ``I - beta k^T k`` then has no eigenvalue below -1), so unnormalised keys of large norm diverge
    (L2-normalise them, as the DeltaNet layers do). The chunked backends ("chunk", "triton") give
    ``log_decay`` gradients with an absolute error near 1e-7 (fp32 cumulative sums), so their error
    ratio stays below 1e-4 only for moderate gates (per-token log decay above about -5, where
    those gradients are larger than about 1e-3). A NaN or Inf in one token's k, v, beta, a or b
    makes the outputs from that token on non-finite in the reference, and every output of its
    64-token chunk in the chunked backends; the outputs of earlier chunks stay finite.

    Returns:
        ``(o, final_state)``: ``o: [B, T, H, V]`` in the dtype of ``q``; ``final_state`` or None.

    Example:
        >>> import torch
        >>> from linmem.ops import linear_recurrence
        >>> q, k = torch.randn(2, 16, 4, 32), torch.randn(2, 16, 4, 32)
        >>> v = torch.randn(2, 16, 4, 64)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(2, 16, 4))  # Mamba-2-style decay
        >>> o, S = linear_recurrence(q, k, v, log_decay=g, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([2, 16, 4, 64]), torch.Size([2, 4, 32, 64]))
    """
    inputs = validate(
        q, k, v, log_decay=log_decay, beta=beta, bonus=bonus, a=a, b=b, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )
    if (handler := parallel.sequence_handler()) is not None:  # the sequences are split over ranks
        return handler.linear_recurrence(q, k, v, log_decay=log_decay, beta=beta, bonus=bonus, a=a, b=b, scale=scale,
                                         initial_state=initial_state, output_final_state=output_final_state,
                                         cu_seqlens=cu_seqlens, backend=backend)
    return choose_backend(backend, inputs).fn(inputs)


def linear_recurrence_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    *,
    log_decay: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    bonus: Optional[torch.Tensor] = None,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of :func:`linear_recurrence` against a state.

    Shapes are those of ``linear_recurrence`` without the time axis: q, k, a, b
    ``[B, H, K]``, v ``[B, H, V]``, beta ``[B, H]``, log_decay ``None``, ``[H]``,
    ``[B, H]``, ``[B, H, K]`` or ``[B, H, K, V]``; ``state: [B, H, K, V]`` fp32.

    Returns ``(o [B, H, V], state)``. When no gradient is being recorded the state
    is updated in place and the same tensor is returned; otherwise a new tensor is
    returned and ``state`` is left untouched.

    Example:
        >>> import torch
        >>> from linmem.ops import linear_recurrence_step
        >>> S = torch.zeros(1, 2, 8, 8)
        >>> o, S = linear_recurrence_step(torch.randn(1, 2, 8), torch.randn(1, 2, 8),
        ...                               torch.randn(1, 2, 8), S, log_decay=torch.full((2,), -0.1))
        >>> o.shape
        torch.Size([1, 2, 8])
    """
    add_time = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(f"linear_recurrence_step: `{name}` must be 3-D [B, H, D], got shape {list(t.shape)}")
    if not isinstance(state, torch.Tensor) or not state.is_floating_point():
        raise TypeError(f"linear_recurrence_step: `state` must be a torch.Tensor of floating point [B, H, K, V], got "
                        f"{getattr(state, 'dtype', type(state).__name__)}")
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == v.dim() == 3:
        expected = [q.shape[0], q.shape[1], q.shape[2], v.shape[2]]
        if list(state.shape) != expected:
            raise ValueError(f"linear_recurrence_step: `state` must have shape [B, H, K, V] = {expected}, "
                             f"got {list(state.shape)}")
    g = log_decay
    if g is not None and isinstance(g, torch.Tensor) and g.dim() >= 2:
        g = g.unsqueeze(1)
    inputs = validate(
        add_time(q), add_time(k), add_time(v), log_decay=g, beta=add_time(beta), bonus=bonus,
        a=add_time(a), b=add_time(b), scale=scale, initial_state=state, output_final_state=True,
        cu_seqlens=None,
    )
    acc = compute_dtype(q)
    if state.dtype != acc:
        raise TypeError(f"linear_recurrence_step: `state` must be {acc} for {q.dtype} inputs, got {state.dtype}")
    if not inputs.records_grad:  # the state is inputs.initial_state
        kernel = choose_step_kernel(inputs, state)
        if kernel is not None:
            return kernel.fn(inputs, state), state
    decay = per_step_decay(inputs.log_decay, inputs.decay_kind, q.shape[0], 1)
    cast = lambda t: None if t is None else t.to(acc)  # noqa: E731
    o, new_state = recurrence_step(
        state, cast(q), cast(k), cast(v),
        log_decay=None if decay is None else cast(decay[:, 0]),
        beta=cast(beta), bonus=cast(bonus), a=cast(a), b=cast(b), scale=inputs.scale,
    )
    if torch.is_grad_enabled() and (new_state.requires_grad or o.requires_grad):
        return o.to(q.dtype), new_state
    state.copy_(new_state)
    return o.to(q.dtype), state


try:  # registers the "triton" backend and its decoding kernel
    from . import triton as _triton  # noqa: E402,F401
except ImportError as error:
    logger.debug("linear_recurrence: no triton backend (%s)", error)
