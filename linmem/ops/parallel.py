"""Where the ops look for a sequence-parallel handler.

Model code is written for one device. When a batch's sequences are split over several
ranks (sequence parallelism), :mod:`linmem.distributed` installs a handler here for the
duration of a training step, and the ops that mix tokens across time hand their call to
it. The ops know nothing of ranks or process groups: they only ask
:func:`sequence_handler` and, when it answers, call one of its methods::

    handler = parallel.sequence_handler()
    if handler is not None:
        return handler.linear_recurrence(q, k, v, log_decay=..., cu_seqlens=..., ...)

A handler computes its part with the same ops; inside it the ops see no handler
(:func:`local_ops`), so they run on the local piece as usual.

Example:
    >>> from linmem.ops import parallel
    >>> parallel.sequence_handler() is None          # nothing installed: every op is local
    True
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Protocol

import torch

__all__ = ["SequenceHandler", "sequence_handler", "sequence_parallel", "local_ops"]


class SequenceHandler(Protocol):
    """The sequence-parallel versions of the ops that mix tokens across time.

    Every tensor is this rank's contiguous piece of the batch along time: ``[B, T, ...]``
    with ``T`` the local length; ``cu_seqlens`` are the local boundaries.
    """

    def linear_recurrence(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:func:`linmem.ops.linear_recurrence` over the whole sequences; same arguments and results."""

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        log_forget: Optional[torch.Tensor],
        window: Optional[int],
        scale: Optional[float],
        cu_seqlens: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """:func:`linmem.ops.attention.forgetting_attention` over the whole sequences."""

    def bayes_filter(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """:func:`linmem.ops.bayes_filter` over the whole sequences; same arguments and results."""

    def halo(self, x: torch.Tensor, size: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """The ``size`` tokens before this piece in the same sequence: x ``[B, T, C]`` -> ``[B, size, C]``
        (zeros before a sequence start); what a short convolution or a token shift reads as history."""


_handler: Optional[SequenceHandler] = None
_local_depth = 0  # > 0 while a handler computes with the local ops


def sequence_handler() -> Optional[SequenceHandler]:
    """The installed handler, or None (no sequence parallelism, or the handler's own local calls)."""
    return None if _local_depth else _handler


@contextmanager
def sequence_parallel(handler: SequenceHandler) -> Iterator[SequenceHandler]:
    """Install ``handler`` for the ops of the ``with`` body; it must cover the backward pass too when
    activations are recomputed there. A module-level switch (not a context variable), so autograd's
    worker threads see it."""
    global _handler
    if _handler is not None:
        raise RuntimeError("sequence_parallel: a sequence handler is already installed; they do not nest")
    _handler = handler
    try:
        yield handler
    finally:
        _handler = None


@contextmanager
def local_ops() -> Iterator[None]:
    """Run the ops of the ``with`` body on the local piece only (what a handler uses inside)."""
    global _local_depth
    _local_depth += 1
    try:
        yield
    finally:
        _local_depth -= 1
