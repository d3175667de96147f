"""Packed variable-length batches: which sequence every token belongs to, and where inside it.

A packed batch is ``cu_seqlens: [N + 1]`` (0 first, non-decreasing, T last) over ``T`` tokens. These index maps
are written as a scatter and a running maximum rather than ``torch.searchsorted``: the same function, but one that
every ``torch.compile`` backend lowers (inductor's GPU lowering of a search over a sliced boundary tensor fails in
torch 2.11), with no host synchronisation and no data-dependent shape.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["count_at_or_below", "sequence_ids", "positions_in_sequence"]


def count_at_or_below(boundaries: torch.Tensor, n: int) -> torch.Tensor:
    """``out[p] = #{m : boundaries[m] <= p}`` for p in [0, n): boundaries [M] (sorted, >= 0) -> [n] int64.

    Equals ``torch.searchsorted(boundaries, torch.arange(n), right=True)``.

    Example:
        >>> count_at_or_below(torch.tensor([2, 2, 5]), 6).tolist()
        [0, 0, 2, 2, 2, 3]
    """
    M = boundaries.numel()
    b = boundaries.to(torch.int64)
    rank = torch.arange(1, M + 1, device=b.device)
    # Only the last of equal boundaries writes, and only inside [0, n): the writes land on distinct slots (slot n
    # takes the rest, all zeros), so the map needs no accumulating scatter.
    last = torch.ones_like(b, dtype=torch.bool)
    last[:-1] = b[:-1] != b[1:]
    writes = last & (b < n)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=b.device)
    counts = counts.index_put((torch.where(writes, b, n),), torch.where(writes, rank, 0))
    return counts[:n].cummax(0).values


def sequence_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] index of the packed sequence every token belongs to (empty sequences own no token).

    Example:
        >>> sequence_ids(torch.tensor([0, 2, 2, 5]), 5).tolist()
        [0, 0, 2, 2, 2]
    """
    return count_at_or_below(cu_seqlens[1:], T)


def positions_in_sequence(T: int, cu_seqlens: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[T] position of every packed token inside its own sequence (``arange(T)`` without cu_seqlens).

    Example:
        >>> positions_in_sequence(5, torch.tensor([0, 2, 5]), torch.device("cpu")).tolist()
        [0, 1, 0, 1, 2]
    """
    steps = torch.arange(T, device=device)
    if cu_seqlens is None:
        return steps
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    return steps - starts[sequence_ids(starts, T)]
