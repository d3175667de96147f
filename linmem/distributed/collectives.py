"""Collectives that autograd differentiates, for the sequence-, expert- and tensor-parallel layers.

Each is an ``autograd.Function`` whose backward is the transposed collective:

* all-gather (every rank gets every rank's tensor) -> reduce-scatter of the gradients
  (each rank gets the sum over ranks of the gradient of its own tensor);
* all-to-all with variable row counts -> the all-to-all with the counts swapped;
* all-reduce (sum) -> all-reduce (sum) of the gradients: every rank's copy of the sum
  feeds that rank's loss, so the gradient of an input is the sum of all of them.

Tensor parallelism uses the two halves of the last (Megatron's f and g): :func:`sum_gradients` leaves a
replicated tensor unchanged and sums its gradients over the ranks, which each computed from their own heads;
:func:`sum_partials` sums the ranks' partial outputs and passes the gradient, the same on every rank, back
unchanged.

They run on any backend with these collectives (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: Optional[ProcessGroup]) -> int:
    return dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    return dist.get_rank(group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty(group_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[0] // group_size(ctx.group), *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: ``[*S]`` -> ``[world, *S]``; differentiable.

    Example (on every rank of a 2-rank group):
        >>> all_gather(torch.full((3,), float(rank)), group)  # doctest: +SKIP
        tensor([[0., 0., 0.], [1., 1., 1.]])
    """
    flat = x.reshape(1, -1) if x.dim() == 0 else x.reshape(1, *x.shape)
    return _AllGather.apply(flat, group).view(group_size(group), *x.shape)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:  # noqa: D102
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        out = grad.new_empty(sum(ctx.input_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(
    x: torch.Tensor, group: ProcessGroup, *, output_splits: Sequence[int], input_splits: Sequence[int]
) -> torch.Tensor:
    """Rows ``x[sum(input_splits[:j]) : ...]`` go to rank j; the rows from rank i arrive in block i.

    x: ``[sum(input_splits), ...]`` -> ``[sum(output_splits), ...]``; differentiable.
    """
    return _AllToAll.apply(x, group, list(map(int, output_splits)), list(map(int, input_splits)))


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over the ranks, on every rank; differentiable (see the module docstring)."""
    return _AllReduceSum.apply(x, group)


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


def sum_gradients(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x`` unchanged; in the backward pass its gradient is summed over the ranks of ``group`` (Megatron's f).

    For a tensor every rank holds alike (a layer's input, a replicated weight) that each rank uses for its own
    share of the heads: each rank's gradient is a part, their sum the whole.
    """
    return _SumGradients.apply(x, group)


class _SumPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # noqa: D102
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


def sum_partials(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum over the ranks of ``group`` of their partial results ``x`` (Megatron's g); the gradient, the same
    on every rank, passes back unchanged.

    Example (on every rank of a 2-rank group):
        >>> sum_partials(torch.full((2,), float(rank + 1)), group)  # doctest: +SKIP
        tensor([3., 3.])
    """
    return _SumPartials.apply(x, group)


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


def tie(x: torch.Tensor, *others: Optional[torch.Tensor]) -> torch.Tensor:
    """``x`` unchanged, with ``others`` (results of collectives this rank does not use) in its backward
    graph at zero gradient: a collective's backward must run on every rank, including those that
    ignore its result."""
    used = [o for o in others if o is not None and o.requires_grad]
    return _Tie.apply(x, *used) if used and torch.is_grad_enabled() else x


def exchange_counts(counts: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-to-all of equal blocks of integers: ``counts [world * n]`` -> ``[world * n]`` where block i
    holds what rank i sent to this rank (no gradient)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
