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
from typing import Any, Optional

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


def activation_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the recurrence runs in: autocast's when autocast is on, else the layer input's.

    Inside a mixer some activations leave autocast in fp32 (norms, gates times values), so
    the arguments are brought to this one dtype before the op.
    """
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class MemoryMixer(Mixer):
    """A mixer whose state is the fixed-size matrix memory of the unified recurrence."""

    kind = "memory"

    @abstractmethod
    def recurrence_inputs(
        self, hidden: torch.Tensor, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
    ) -> RecurrenceArgs:
        """hidden [B, T, D] -> the recurrence's arguments (convolutions read/write ``cache``)."""

    @abstractmethod
    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        """o [B, T, H, V] (the read-out) and the layer input -> [B, T, D]."""

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
        kwargs = dict(log_decay=run.log_decay, beta=run.beta, bonus=run.bonus, a=run.a, b=run.b, scale=run.scale)
        if state is not None and hidden.shape[1] == 1 and not torch.is_grad_enabled():
            o, state = linear_recurrence_step(run.q[:, 0], run.k[:, 0], run.v[:, 0], state,
                                              **_drop_time(kwargs))
            o = o[:, None]
        else:
            o, state = linear_recurrence(run.q, run.k, run.v, **kwargs, initial_state=state,
                                         output_final_state=cache is not None, cu_seqlens=cu_seqlens,
                                         backend=self.args.backend)
        if cache is not None:
            cache.set("recurrent", state)
        return self.output(o, hidden, args)


def _drop_time(kwargs: dict) -> dict:
    """Per-token arguments of a one-token call without their time axis ([B, 1, ...] -> [B, ...])."""
    out = {}
    for name, x in kwargs.items():
        if isinstance(x, torch.Tensor) and name != "bonus" and not (name == "log_decay" and x.dim() == 1):
            x = x[:, 0]
        out[name] = x
    return out
