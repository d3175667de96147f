"""The sequence-parallel handler the ops consult (see :mod:`linmem.ops.parallel`).

For one training step the trainer installs a :class:`SequenceParallel` built from the step's
piece of the batch; while it is installed, the memory layers' recurrences (the Bayesian memory's
filter too), the attention layers and the short convolutions' history run over the whole sequences
although every rank holds one piece. The model code does not change.

Example (on every rank of the sequence-parallel group)::

    piece, layout = shard_sequence(batch, mesh.sp.get_local_rank(), mesh.sp.size())
    with sequence_parallel(SequenceParallel(mesh.sp.get_group(), layout, piece.get("cu_seqlens"))):
        out = model(piece["input_ids"], position_ids=piece["position_ids"], cu_seqlens=piece.get("cu_seqlens"))
        loss = global_lm_loss(out.logits, piece["targets"], mesh.data.get_group())
        loss.backward()
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed import ProcessGroup

from ..ops.parallel import sequence_parallel
from .attention import sp_attention
from .bayes import sp_bayes_filter
from .sequence import PieceLayout, sp_halo, sp_linear_recurrence

__all__ = ["SequenceParallel", "sequence_parallel"]


class SequenceParallel:
    """Sequence-parallel versions of the ops for one batch piece (implements ``SequenceHandler``).

    Args:
        group: the sequence-parallel process group.
        layout: where this rank's piece sits in its sequences (from :func:`shard_sequence`).
        cu_seqlens: the local ``cu_seqlens`` tensor the model receives (None for fixed-length rows);
            an op called with other boundaries (a mixture of memories' routed segments) is refused.
    """

    def __init__(self, group: ProcessGroup, layout: PieceLayout, cu_seqlens: Optional[torch.Tensor]) -> None:
        if group is None:
            raise TypeError("SequenceParallel: `group` must be a process group (the sequence-parallel ranks)")
        if layout.varlen != (cu_seqlens is not None):
            raise ValueError("SequenceParallel: `cu_seqlens` must be given exactly for a packed layout")
        self.group, self.layout, self.cu_seqlens = group, layout, cu_seqlens

    def _check(self, op: str, T: int, cu_seqlens: Optional[torch.Tensor]) -> None:
        """The op must run over this batch's own tokens: the piece's length and boundaries."""
        length = self.layout.first_length if not self.layout.varlen else None
        same = cu_seqlens is self.cu_seqlens or (
            cu_seqlens is not None and self.cu_seqlens is not None and cu_seqlens.shape == self.cu_seqlens.shape
            and torch.equal(cu_seqlens.cpu(), self.cu_seqlens.cpu()))
        if not same or (length is not None and T != length):
            raise ValueError(
                f"sequence-parallel {op}: called over tokens that are not this batch piece (T = {T}, cu_seqlens "
                f"{'given' if cu_seqlens is not None else 'None'}); sequence parallelism serves layers whose "
                "recurrence runs over the batch's own time axis (a mixture of memories' routed segments does not)"
            )

    def linear_recurrence(self, q, k, v, **kwargs):  # noqa: D102 (SequenceHandler)
        self._check("linear_recurrence", q.shape[1], kwargs.get("cu_seqlens"))
        return sp_linear_recurrence(q, k, v, group=self.group, layout=self.layout, **kwargs)

    def bayes_filter(self, q, k, v, **kwargs):  # noqa: D102 (SequenceHandler)
        self._check("bayes_filter", q.shape[1], kwargs.get("cu_seqlens"))
        return sp_bayes_filter(q, k, v, group=self.group, layout=self.layout, **kwargs)

    def attention(self, q, k, v, *, log_forget, window, scale, cu_seqlens):  # noqa: D102
        self._check("attention", q.shape[1], cu_seqlens)
        return sp_attention(q, k, v, group=self.group, log_forget=log_forget, window=window, scale=scale,
                            cu_seqlens=cu_seqlens, layout=self.layout)

    def halo(self, x, size, cu_seqlens):  # noqa: D102
        self._check("halo", x.shape[1], cu_seqlens)
        return sp_halo(x, self.group, size, cu_seqlens=cu_seqlens, layout=self.layout)
