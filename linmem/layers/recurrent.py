"""The base of every memory mixer: projections in, the unified recurrence, projections out.

A memory mixer only says how it turns ``hidden`` into the arguments of
:func:`linmem.ops.linear_recurrence` (:meth:`MemoryMixer.recurrence_inputs`) and how
it turns the read-out back into ``hidden`` (:meth:`MemoryMixer.output`). This base
does the rest the same way for all of them: padding masks, the recurrent state in
the cache, one-token decoding with :func:`linmem.ops.linear_recurrence_step`.

A memory whose state is not the one matrix of the unified recurrence (the Bayesian
memory's mean and covariance) overrides the state hooks: :attr:`state_names`,
:meth:`fresh_state`, :meth:`run_memory` and :meth:`step_memory`; the base and the
mixture of memories reach the state only through them.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Optional

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


State = tuple[torch.Tensor, ...]
#: run_memory(args, state or None, *, cu_seqlens, output_final_state) -> (o [B, T, H, V], final state or None)
RunMemory = Callable[..., tuple[torch.Tensor, Optional[State]]]
#: step_memory(one token per row, state) -> (o [N, H, V], state)
StepMemory = Callable[[RecurrenceArgs, State], tuple[torch.Tensor, State]]


def run_recurrence(
    args: RecurrenceArgs, state: Optional[State], *, cu_seqlens: Optional[torch.Tensor], output_final_state: bool,
    backend: str,
) -> tuple[torch.Tensor, Optional[State]]:
    """:func:`linear_recurrence` of ``args`` from ``state`` (``(S [N, H, K, V],)``; None: fresh):
    ``(o [B, T, H, V], (final S,) or None)``."""
    o, final = linear_recurrence(args.q, args.k, args.v, **args.op_kwargs(),
                                 initial_state=None if state is None else state[0],
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend)
    return o, (None if final is None else (final,))


def step_recurrence(step: RecurrenceArgs, state: State) -> tuple[torch.Tensor, State]:
    """:func:`linear_recurrence_step` of one token per row (``step`` as :meth:`RecurrenceArgs.as_steps` gives
    it) from ``(S,)``: ``(o [N, H, V], (S,))``, S updated in place when no gradient is recorded."""
    o, S = linear_recurrence_step(step.q, step.k, step.v, state[0], **step.op_kwargs())
    return o, (S,)


def memory_with_cache(
    args: RecurrenceArgs,
    *,
    cache: Optional[LayerState],
    token_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    state_names: tuple[str, ...],
    run_memory: RunMemory,
    step_memory: StepMemory,
) -> torch.Tensor:
    """A memory over one call: padded tokens (``token_mask`` False) masked, the state continued from and
    written back to ``cache[state_names]``, one token of a cached call with no gradient run as a decoding
    step. ``args`` shaped as :func:`linear_recurrence` takes them; returns o [B, T, H, V].

    Example:
        >>> args = RecurrenceArgs(q=torch.randn(1, 3, 2, 4), k=torch.randn(1, 3, 2, 4), v=torch.randn(1, 3, 2, 4))
        >>> cache = LayerState()
        >>> memory_with_cache(args, cache=cache, token_mask=None, cu_seqlens=None, state_names=("recurrent",),
        ...                   run_memory=lambda *a, **kw: run_recurrence(*a, **kw, backend="auto"),
        ...                   step_memory=step_recurrence).shape, cache.get("recurrent").shape
        (torch.Size([1, 3, 2, 4]), torch.Size([1, 2, 4, 4]))
    """
    run = args.masked(token_mask) if token_mask is not None else args
    state = None
    if cache is not None and state_names[0] in cache:
        state = tuple(cache.get(name) for name in state_names)
    if state is not None and run.q.shape[1] == 1 and not torch.is_grad_enabled():
        o, state = step_memory(run.as_steps(), state)
        o = o[:, None]
    else:
        o, state = run_memory(run, state, cu_seqlens=cu_seqlens, output_final_state=cache is not None)
    if cache is not None:
        for name, tensor in zip(state_names, state):
            cache.set(name, tensor)
    return o


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

    def convolved_qkv(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]],
        **conv: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, T, H, d]``: the ``q_proj``, ``k_proj`` and ``v_proj`` outputs (k and v through
        :meth:`project`) through their short convolutions ``self.convs`` (``conv``: its keyword arguments, e.g.
        ``activation``), split into heads (as many as the values' width holds: all, or a tensor-parallel share)."""
        inputs = (("q", self.q_proj(hidden)), ("k", self.project("k_proj", hidden, projected)),
                  ("v", self.project("v_proj", hidden, projected)))
        q, k, v = (self.convs(n, x, cache=cache, cu_seqlens=cu_seqlens, **conv) for n, x in inputs)
        heads = v.shape[-1] // self.args.value_dim
        return tuple(x.unflatten(-1, (heads, -1)) for x in (q, k, v))

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
        o = memory_with_cache(args, cache=cache, token_mask=token_mask, cu_seqlens=cu_seqlens,
                              state_names=self.state_names, run_memory=self.run_memory, step_memory=self.step_memory)
        return self.output(o, hidden, args)

    # ---------------------------------------------------------------- the state hooks

    #: the cache names of the state's tensors (batch-first), in the order the hooks take them
    state_names: ClassVar[tuple[str, ...]] = ("recurrent",)

    def fresh_state(self, rows: int, args: RecurrenceArgs) -> tuple[torch.Tensor, ...]:
        """The state of ``rows`` sequences that have seen nothing: ``(S [rows, H, K, V],)`` zeros (fp32)."""
        H, K, V = args.q.shape[2], args.q.shape[3], args.v.shape[3]
        acc = torch.promote_types(args.q.dtype, torch.float32)
        return (torch.zeros(rows, H, K, V, dtype=acc, device=args.q.device),)

    def run_memory(
        self,
        args: RecurrenceArgs,
        state: Optional[tuple[torch.Tensor, ...]],
        *,
        cu_seqlens: Optional[torch.Tensor],
        output_final_state: bool,
    ) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, ...]]]:
        """The memory over a sequence: ``(o [B, T, H, V], final state or None)`` from ``state`` (None: fresh)."""
        return run_recurrence(args, state, cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                              backend=self.args.backend)

    def step_memory(
        self, step: RecurrenceArgs, state: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One token per row (``step`` as :meth:`RecurrenceArgs.as_steps` gives it) -> ``(o [N, H, V], state)``;
        the state is updated in place when no gradient is recorded."""
        return step_recurrence(step, state)
