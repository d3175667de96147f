"""The base of every memory mixer: projections in, the unified recurrence, projections out.

A memory mixer only says how it turns ``hidden`` into the arguments of
:func:`linmem.ops.linear_recurrence` (:meth:`MemoryMixer.recurrence_inputs`) and how
it turns the read-out back into ``hidden`` (:meth:`MemoryMixer.output`). This base
does the rest the same way for all of them: padding masks, the recurrent state in
the cache, one-token decoding with :func:`linmem.ops.linear_recurrence_step`.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional

import torch

from ..ops import linear_recurrence, linear_recurrence_step
from .base import LayerState, Mixer, check_cache_and_varlen


@dataclass
class RecurrenceArgs:
    """Arguments of one call of the recurrence (shapes as in ``linear_recurrence``)."""

    q: torch.Tensor  # [B, T, H, K]
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, H, V]
    log_decay: Optional[torch.Tensor] = None  # None, [H], [B, T, H], [B, T, H, K] or [B, T, H, K, V]
    beta: Optional[torch.Tensor] = None  # [B, T, H]
    bonus: Optional[torch.Tensor] = None  # [H, K]
    a: Optional[torch.Tensor] = None  # [B, T, H, K]
    b: Optional[torch.Tensor] = None  # [B, T, H, K]
    scale: Optional[float] = None
    extras: dict[str, Any] = field(default_factory=dict)  # what `output` needs besides o

    def cast(self, dtype: torch.dtype) -> "RecurrenceArgs":
        """q, k, v (and a, b) in one activation dtype, as the op requires; gates keep their fp32."""
        to = lambda x: None if x is None else x.to(dtype)  # noqa: E731
        return replace(self, q=to(self.q), k=to(self.k), v=to(self.v), a=to(self.a), b=to(self.b))

    def masked(self, token_mask: torch.Tensor) -> "RecurrenceArgs":
        """Padded tokens (token_mask False) neither decay nor write the state."""
        B, T = token_mask.shape
        m = token_mask.to(self.k.dtype)
        per_token = lambda x, extra: None if x is None else x * m.view(B, T, *([1] * extra)).to(x.dtype)  # noqa: E731
        log_decay = self.log_decay
        if log_decay is not None:
            if log_decay.dim() == 1:  # constant [H] -> one value per token
                log_decay = log_decay.expand(B, T, -1)
            log_decay = per_token(log_decay, log_decay.dim() - 2)
        return RecurrenceArgs(
            q=self.q, k=per_token(self.k, 2), v=per_token(self.v, 2), log_decay=log_decay,
            beta=per_token(self.beta, 1), bonus=self.bonus, a=per_token(self.a, 2), b=self.b,
            scale=self.scale, extras=self.extras,
        )

    def op_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`linear_recurrence` / :func:`linear_recurrence_step` besides q, k, v."""
        return dict(log_decay=self.log_decay, beta=self.beta, bonus=self.bonus, a=self.a, b=self.b, scale=self.scale)

    def as_steps(self) -> "RecurrenceArgs":
        """One token per row without the time axis, the form of :func:`linear_recurrence_step`: every
        per-token tensor has its two leading axes merged (``[B, 1, ...]``: one token of B rows, or
        ``[1, N, ...]``: N packed one-token sequences -> ``[B or N, ...]``); per-head constants stay."""
        fold = lambda x: None if x is None else x.flatten(0, 1)  # noqa: E731
        constant_decay = self.log_decay is None or self.log_decay.dim() == 1
        return RecurrenceArgs(
            q=fold(self.q), k=fold(self.k), v=fold(self.v),
            log_decay=self.log_decay if constant_decay else fold(self.log_decay), beta=fold(self.beta),
            bonus=self.bonus, a=fold(self.a), b=fold(self.b), scale=self.scale, extras=self.extras,
        )


def activation_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the recurrence runs in: autocast's when autocast is on, else the layer input's.

    Inside a mixer some activations leave autocast in fp32 (norms, gates times values), so
    the arguments are brought to this one dtype before the op.
    """
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class MemoryMixer(Mixer):
    """A mixer whose state is the fixed-size matrix memory of the unified recurrence.

    :attr:`memory_projections` names the input projections (``nn.Linear``, or ``nn.Sequential`` of
    them, applied to ``hidden``) that each memory of a mixture of memories owns; the mixer reads them
    through :meth:`project`, so that :class:`~linmem.layers.mom.MixtureOfMemories` can hand it their
    outputs computed per memory. An empty tuple: the mixer cannot be a MoM rule.
    """

    kind = "memory"
    memory_projections: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        """hidden [B, T, D] -> the recurrence's arguments (convolutions read/write ``cache``).

        ``projected`` holds the outputs of :attr:`memory_projections` when a mixture computes them.
        """

    @abstractmethod
    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        """o [B, T, H, V] (the read-out) and the layer input -> [B, T, D]."""

    def project(self, name: str, hidden: torch.Tensor, projected: Optional[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The output of the input projection ``name``: ``projected[name]`` when a mixture of memories
        computed it per memory, else the mixer's own module ``name`` applied to ``hidden``."""
        if projected is not None and name in projected:
            return projected[name]
        return self.get_submodule(name)(hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[LayerState] = None,
        token_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        check_cache_and_varlen(cache, cu_seqlens)
        args = self.recurrence_inputs(hidden, cache=cache, cu_seqlens=cu_seqlens).cast(activation_dtype(hidden))
        run = args.masked(token_mask) if token_mask is not None else args
        state = cache.get("recurrent") if cache is not None else None
        if state is not None and hidden.shape[1] == 1 and not torch.is_grad_enabled():
            step = run.as_steps()
            o, state = linear_recurrence_step(step.q, step.k, step.v, state, **step.op_kwargs())
            o = o[:, None]
        else:
            o, state = linear_recurrence(run.q, run.k, run.v, **run.op_kwargs(), initial_state=state,
                                         output_final_state=cache is not None, cu_seqlens=cu_seqlens,
                                         backend=self.args.backend)
        if cache is not None:
            cache.set("recurrent", state)
        return self.output(o, hidden, args)
