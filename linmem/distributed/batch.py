"""Each rank's share of a global batch, and the loss over the global batch.

* Data parallel: a step's global batch is ``dp`` consecutive batches of the one batch source;
  data-parallel rank d trains on the d-th (:class:`DataParallelBatches`). Every rank draws the
  same batches, so the source's state (hence exact resume) is the same on all of them, and one
  process with ``dp`` accumulated micro-batches sees the same data.
* Sequence parallel: every sequence-parallel rank takes a contiguous piece of the time axis of
  its batch (:func:`shard_sequence`), with local ``cu_seqlens`` for packed rows, the number of
  tokens of its first sequence held by earlier ranks, and global position ids (for RoPE).
* Loss: the labels are shifted before the split (the last token of a piece predicts the first
  token of the next), and :func:`global_lm_loss` scales each rank's sum so that the mean over
  ranks, which FSDP takes of the gradients, is the mean over all target tokens of the global batch.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..ops.varlen import positions_in_sequence
from .sequence import PieceLayout

__all__ = ["DataParallelBatches", "shard_sequence", "split_packing", "next_token_targets", "global_lm_loss"]

IGNORE_INDEX = -100


class DataParallelBatches:
    """The batches of data-parallel rank ``rank`` of ``size``: batch ``step * size + rank`` of ``source``.

    Wraps a batch source (iterable, with ``state_dict`` and ``load_state_dict``); its state is the
    source's, identical on every rank.

    Example:
        >>> from linmem.data.batches import ExampleBatches
        >>> x = torch.arange(16).view(8, 2)
        >>> mine = DataParallelBatches(ExampleBatches(x, x, 2, seed=0), rank=1, size=2)
        >>> next(mine)["input_ids"].shape
        torch.Size([2, 2])
    """

    def __init__(self, source, *, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"DataParallelBatches: `rank` must lie in [0, size = {size}), got {rank}")
        self.source, self.rank, self.size = source, rank, size
        self.batches = iter(source)  # a source may be iterable (a round robin) rather than an iterator

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batches = [next(self.batches) for _ in range(self.size)]
        return batches[self.rank]

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)


def next_token_targets(labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The label each position predicts: ``targets[:, t] = labels[:, t + 1]``, ignored (-100) at the
    last token of every sequence. labels ``[B, T]`` -> ``[B, T]`` (what ``causal_lm_loss`` uses, unshifted).

    Example:
        >>> next_token_targets(torch.tensor([[5, 6, 7, 8]]), torch.tensor([0, 2, 4])).tolist()
        [[6, -100, 8, -100]]
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        ends = cu_seqlens[1:].long() - 1
        targets[:, ends[ends >= 0]] = IGNORE_INDEX
    return targets


def split_packing(cu_seqlens: torch.Tensor, T: int, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """The local boundaries of piece ``rank`` of ``size`` of a packed row, and its ``prefix_length``.

    Args:
        cu_seqlens: ``[N + 1]`` boundaries of the whole row (T tokens); empty sequences are dropped.
        T: tokens of the row, a multiple of ``size``.

    Returns:
        ``(local cu_seqlens [n + 1] int32, prefix_length)``: prefix_length counts the tokens of the
        piece's first sequence that lie before the piece (0 when it starts there).

    Example:
        >>> cu, prefix = split_packing(torch.tensor([0, 3, 8]), 8, 1, 2)   # piece 1 = tokens 4..7
        >>> cu.tolist(), prefix
        ([0, 4], 1)
    """
    if T % size:
        raise ValueError(f"split_packing: the row's {T} tokens do not split into {size} equal pieces")
    length = T // size
    lo, hi = rank * length, (rank + 1) * length
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"split_packing: `cu_seqlens` must run from 0 to T = {T}, got {bounds}")
    local, prefix = [0], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= lo or start >= hi or end == start:
            continue
        if start < lo:
            prefix = lo - start
        local.append(min(end, hi) - lo)
    return torch.tensor(local, dtype=torch.int32, device=cu_seqlens.device), prefix


def shard_sequence(
    batch: dict[str, torch.Tensor], rank: int, size: int
) -> tuple[dict[str, torch.Tensor], PieceLayout]:
    """Piece ``rank`` of ``size`` of a batch along time, for sequence parallelism.

    Args:
        batch: ``{"input_ids": [B, T], "labels": [B, T]}`` (labels aligned with the inputs, as the
            model takes them), plus ``"cu_seqlens": [N + 1]`` for a packed row (B == 1).
        rank, size: this rank's place in the sequence-parallel group; ``size`` divides T.

    Returns:
        ``(piece, layout)``: ``piece`` has ``input_ids``, ``targets`` (the next-token labels, already
        shifted: no further shift), ``position_ids`` (positions in the whole sequence) of shape
        ``[B, T / size]`` and, for a packed row, the local ``cu_seqlens``; ``layout`` is the
        :class:`~linmem.distributed.sequence.PieceLayout` the sequence-parallel ops need.

    Example:
        >>> ids = torch.arange(8)[None]
        >>> piece, layout = shard_sequence({"input_ids": ids, "labels": ids}, 1, 2)
        >>> piece["input_ids"].tolist(), piece["targets"].tolist(), layout.prefix_length
        ([[4, 5, 6, 7]], [[5, 6, 7, -100]], 4)
    """
    ids, labels = batch["input_ids"], batch["labels"]
    cu = batch.get("cu_seqlens")
    B, T = ids.shape
    if T % size:
        raise ValueError(f"shard_sequence: the sequence length {T} must be a multiple of the {size} "
                         "sequence-parallel ranks")
    if cu is not None and B != 1:
        raise ValueError(f"shard_sequence: a packed batch (with cu_seqlens) has B == 1, got B = {B}")
    length = T // size
    window = slice(rank * length, (rank + 1) * length)
    positions = positions_in_sequence(T, cu, ids.device)[None].expand(B, T)
    piece = {"input_ids": ids[:, window], "targets": next_token_targets(labels, cu)[:, window],
             "position_ids": positions[:, window]}
    if cu is None:
        return piece, PieceLayout(prefix_length=rank * length, num_segments=B, first_length=length, last_start=0,
                                  varlen=False)
    local, prefix = split_packing(cu, T, rank, size)
    piece["cu_seqlens"] = local
    bounds = local.tolist()
    return piece, PieceLayout(prefix_length=prefix, num_segments=len(bounds) - 1, first_length=bounds[1],
                              last_start=bounds[-2], varlen=True)


def global_lm_loss(logits: torch.Tensor, targets: torch.Tensor, group: Optional[ProcessGroup], *,
                   num_targets: Optional[float] = None) -> torch.Tensor:
    """This rank's share of the mean next-token cross-entropy over the global batch.

    Returns ``world * sum(local CE) / (target tokens over all ranks of group)``: its mean over the
    ranks is the global mean, and so is the mean of its gradients (FSDP's reduction).
    logits ``[B, T, vocab]``, targets ``[B, T]`` (-100 = ignore), group: every rank of the run;
    ``num_targets``: the target tokens over all ranks when the caller counted them already (default:
    this call counts them, one all-reduce).

    Example (one process):
        >>> logits, targets = torch.zeros(1, 3, 4), torch.tensor([[1, 2, -100]])
        >>> round(float(global_lm_loss(logits, targets, None)), 4)  # log(4): uniform over 4 tokens
        1.3863
    """
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    world = dist.get_world_size(group) if group is not None else 1
    if num_targets is not None:
        return loss_sum * world / max(num_targets, 1)
    count = (targets != IGNORE_INDEX).sum().to(torch.float32)
    if group is not None:
        dist.all_reduce(count, group=group)
    return loss_sum * world / count.clamp_min(1)
