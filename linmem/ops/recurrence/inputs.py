"""Validation and normalisation of the inputs of the unified linear recurrence.

Every backend receives a :class:`RecurrenceInputs` that has passed these checks, so
backends never re-validate. Shape and dtype checks always run; checks of values
(``log_decay`` in [-inf, 0] and not NaN, ``beta`` in [0, 2], ``cu_seqlens`` monotone) run on
CPU tensors, and on GPU tensors only when debug checks are on (``LINMEM_DEBUG=1`` or
:func:`linmem.ops.set_debug_checks`), so the hot path never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..checks import (
    check_cu_seqlens,
    check_device,
    check_float,
    check_qkv_heads,
    check_shape,
    resolve_scale,
    values_checkable,
)

OP = "linear_recurrence"

#: the decay kinds, named by the shape of ``log_decay``
DECAY_KINDS = ("none", "constant", "scalar", "vector", "full")

#: The chunked backends clamp each token's log decay to at least this value before the cumulative sums.
#: Without it, one ``-inf`` (RWKV-6's ``-exp(d)`` for d > 88.7, bf16 ``log(sigmoid(x))`` for x <= -100) makes
#: a cumulative sum ``-inf`` and a difference of two of them NaN, and a finite gate near -3e38 overflows the
#: sum. The clamp changes no result: exp(x) rounds to exactly 0 in fp32 for every x < -103.98 (below half the
#: smallest subnormal, 2**-150), so a gate at or below the floor already erased the state, and so does the floor; the
#: margin of 6 keeps a cumulative difference across a floored token below -104 after its fp32 rounding (at most
#: ~0.03 for sums over a 64-token chunk). Gates above the floor are untouched, and the gradient of a clamped
#: gate is 0, as the reference's exp(g) * dS is at a gate whose exp is 0. (With fp64 accumulation exp(-110)
#: is 1.7e-48 rather than 0: 32 orders of magnitude below fp64's resolution of the state it multiplies.)
LOG_DECAY_FLOOR = -110.0

#: the documented range of the delta rule's write strength ``beta``; (1, 2] gives negative eigenvalues
BETA_RANGE = (0.0, 2.0)


@dataclass
class RecurrenceInputs:
    """Validated inputs of :func:`linmem.ops.linear_recurrence` (see its docstring)."""

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, H, V]
    log_decay: Optional[torch.Tensor]  # as given; its kind is in `decay_kind`
    decay_kind: str  # one of DECAY_KINDS
    beta: Optional[torch.Tensor]  # [B, T, H]
    bonus: Optional[torch.Tensor]  # [H, K]
    a: Optional[torch.Tensor]  # [B, T, H, K]
    b: Optional[torch.Tensor]  # [B, T, H, K]
    scale: float
    initial_state: Optional[torch.Tensor]  # [N, H, K, V]
    output_final_state: bool
    cu_seqlens: Optional[torch.Tensor]  # [N + 1]

    @property
    def num_sequences(self) -> int:
        if self.cu_seqlens is not None:
            return self.cu_seqlens.shape[0] - 1
        return self.q.shape[0]

    @property
    def rule(self) -> str:
        """'delta', 'dplr' or 'additive'."""
        if self.beta is not None:
            return "delta"
        if self.a is not None:
            return "dplr"
        return "additive"

    @property
    def records_grad(self) -> bool:
        """Whether autograd records this call (grad mode on and some input requires a gradient)."""
        tensors = (self.q, self.k, self.v, self.log_decay, self.beta, self.bonus, self.a, self.b, self.initial_state)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decay_kind_of(log_decay: Optional[torch.Tensor], B: int, T: int, H: int, K: int, V: int) -> str:
    """Classify ``log_decay`` by its shape; raise a ValueError naming every accepted shape."""
    if log_decay is None:
        return "none"
    shapes = {
        "constant": [H],
        "scalar": [B, T, H],
        "vector": [B, T, H, K],
        "full": [B, T, H, K, V],
    }
    for kind, shape in shapes.items():
        if list(log_decay.shape) == shape:
            return kind
    raise ValueError(
        "linear_recurrence: `log_decay` must be None or have shape [H] = "
        f"{shapes['constant']}, [B, T, H] = {shapes['scalar']}, [B, T, H, K] = "
        f"{shapes['vector']} or [B, T, H, K, V] = {shapes['full']}; got {list(log_decay.shape)}"
    )


def _check_range(name: str, t: torch.Tensor, low: float, high: float, meaning: str) -> None:
    """Values of t in [low, high] (NaN is outside), checked where values are checkable."""
    if not t.numel() or not values_checkable(t):
        return
    t = t.detach()
    outside = ~((t >= low) & (t <= high))
    if bool(outside.any()):
        bad = t[outside]
        if bool(bad.isnan().any()):
            worst = "NaN"
        elif bool((bad > high).any()):
            worst = f"a maximum of {float(bad.max()):g}"
        else:
            worst = f"a minimum of {float(bad.min()):g}"
        raise ValueError(f"linear_recurrence: `{name}` must be {meaning}; got {int(outside.sum())} value(s) "
                         f"outside, {worst}")


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: Optional[torch.Tensor],
    beta: Optional[torch.Tensor],
    bonus: Optional[torch.Tensor],
    a: Optional[torch.Tensor],
    b: Optional[torch.Tensor],
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
) -> RecurrenceInputs:
    """Check every argument of ``linear_recurrence``; return the normalised inputs."""
    B, T, H, K, V = check_qkv_heads(OP, q, k, v)
    for name, t in (("log_decay", log_decay), ("beta", beta), ("bonus", bonus), ("a", a), ("b", b),
                    ("initial_state", initial_state)):
        if t is not None:
            check_float(OP, name, t)
            check_device(OP, name, t, q.device)

    kind = decay_kind_of(log_decay, B, T, H, K, V)
    if log_decay is not None:
        _check_range("log_decay", log_decay, float("-inf"), 0.0,
                     "<= 0 and not NaN: in [-inf, 0] (a decay in [0, 1] in log space; -inf forgets everything)")

    if beta is not None:
        check_shape(OP, "beta", beta, [B, T, H], "[B, T, H]")
        _check_range("beta", beta, *BETA_RANGE, "in [0, 2] (values above 1 give negative eigenvalues)")
    if bonus is not None:
        check_shape(OP, "bonus", bonus, [H, K], "[H, K]")
    if (a is None) != (b is None):
        raise ValueError("linear_recurrence: `a` and `b` (the low-rank transition a^T b) must be given together")
    if a is not None:
        check_shape(OP, "a", a, [B, T, H, K], "[B, T, H, K]")
        check_shape(OP, "b", b, [B, T, H, K], "[B, T, H, K]")
        if beta is not None:
            raise ValueError(
                "linear_recurrence: `beta` (delta rule) and `a`, `b` (low-rank transition) are mutually "
                "exclusive; the delta rule is the low-rank case a = -beta k, b = k exp(g)"
            )

    N = B if cu_seqlens is None else check_cu_seqlens(OP, cu_seqlens, B, T, q.device)
    if initial_state is not None:
        check_shape(OP, "initial_state", initial_state, [N, H, K, V], "[N, H, K, V] (N = number of sequences)")
    scale = resolve_scale(OP, scale, K)

    return RecurrenceInputs(
        q=q, k=k, v=v, log_decay=log_decay, decay_kind=kind, beta=beta, bonus=bonus, a=a, b=b,
        scale=scale, initial_state=initial_state, output_final_state=bool(output_final_state),
        cu_seqlens=cu_seqlens,
    )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the PyTorch backends: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
