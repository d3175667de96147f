"""Sequence parallelism for the Bayesian memory: the filter over sequences split between ranks, exact.

The unified recurrence's pieces combine after the fact because every rule is affine in the state a piece
starts from (:mod:`linmem.distributed.sequence`: LASP-2's gather of ``(S, P)``). The Kalman filter's
covariance update is not: ``P_t = P^- - u u^T / s`` with ``u = P^- k_t`` and ``s = k_t . u + r`` is a rational
function of the covariance it starts from, and the mean's update depends on it through the gain. So the state
``(M, P)`` a piece starts from must be known before the piece runs:

    rank r receives the end state of rank r - 1's last segment, filters its piece from it and sends its own
    last segment's end state on to rank r + 1; the backward pass sends each start state's gradient back.

The result is the one-process run's (outputs, variances, final states and every gradient) to rounding; the
pieces run one after another, so this divides the activations' memory over the ranks, not the time.

Example (on every rank of a sequence-parallel group, each with its piece of T tokens)::

    o, var, (M, P) = sp_bayes_filter(q, k, v, group=sp_group, log_decay=g, obs_noise=r, output_final_state=True)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..ops import bayes_filter, parallel
from .collectives import group_rank, group_size, tie
from .sequence import PieceLayout

__all__ = ["sp_bayes_filter"]

State = tuple[torch.Tensor, torch.Tensor]


class _Receive(torch.autograd.Function):
    """The start state ``(M, P)`` from the previous rank; its gradient goes back there in the backward pass.

    ``anchor`` (any input of the piece that requires a gradient) puts the receipt in the autograd graph."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, like_M: torch.Tensor, like_P: torch.Tensor, src: int,
                group: ProcessGroup) -> State:  # noqa: D102
        ctx.src, ctx.group = src, group
        M, P = torch.empty_like(like_M), torch.empty_like(like_P)
        dist.recv(M, src, group=group)
        dist.recv(P, src, group=group)
        return M, P

    @staticmethod
    def backward(ctx, dM: torch.Tensor, dP: torch.Tensor):  # noqa: D102
        for grad in (dM, dP):
            dist.send(grad.contiguous(), ctx.src, group=ctx.group)
        return None, None, None, None, None


class _Send(torch.autograd.Function):
    """Sends ``(M, P)`` to the next rank; returns a token whose backward receives their gradient from there."""

    @staticmethod
    def forward(ctx, M: torch.Tensor, P: torch.Tensor, dst: int, group: ProcessGroup) -> torch.Tensor:  # noqa: D102
        ctx.dst, ctx.group = dst, group
        ctx.save_for_backward(M, P)
        dist.send(M.contiguous(), dst, group=group)
        dist.send(P.contiguous(), dst, group=group)
        return M.new_zeros(())

    @staticmethod
    def backward(ctx, token_grad: torch.Tensor):  # noqa: D102
        M, P = ctx.saved_tensors
        dM, dP = torch.empty_like(M), torch.empty_like(P)
        dist.recv(dM, ctx.dst, group=ctx.group)
        dist.recv(dP, ctx.dst, group=ctx.group)
        return dM, dP, None, None


def _prior(rows: int, H: int, K: int, V: int, prior: float, like: torch.Tensor) -> State:
    """A fresh sequence's belief: ``M = 0``, ``P = prior * I``, in the filter's state dtype."""
    acc = torch.float64 if like.dtype == torch.float64 else torch.float32
    M = torch.zeros(rows, H, K, V, dtype=acc, device=like.device)
    P = prior * torch.eye(K, dtype=acc, device=like.device).expand(rows, H, K, K).clone()
    return M, P


def sp_bayes_filter(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup,
    prefix_length: Optional[int] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    prior: float = 1.0,
    layout: Optional[PieceLayout] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[State]]:
    """:func:`linmem.ops.bayes_filter` of sequences split along time over the ranks of ``group``.

    Every rank calls it with its own contiguous piece (all pieces of one length ``T``); the result on each rank is
    its piece of what one process computes on the whole sequences.

    Args:
        q, k, v: this rank's piece: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``; ``kwargs`` (``log_decay``,
            ``obs_noise``, ``process_noise``, ``reset``, ``scale``, ``return_variance``, ``backend``) as in
            ``bayes_filter``, per-token tensors as this rank's piece.
        group: the sequence-parallel process group; pieces follow the ranks' order in it.
        prefix_length: with ``cu_seqlens``, the tokens of this rank's first sequence that earlier ranks hold (0
            when it starts here). Without ``cu_seqlens`` every rank after the first continues every row.
        initial_state: ``(M [N, H, K, V], P [N, H, K, K])`` for the N local sequences; a row is used only for a
            sequence that starts on this rank.
        output_final_state: also return the true state at the end of each local segment.
        cu_seqlens: ``[N + 1]`` local boundaries of the packed segments (B == 1).
        prior: the prior variance of a sequence that starts without an initial state.
        layout: the :class:`PieceLayout` when the caller already has it.

    Returns:
        ``(o [B, T, H, V], var or None, (M, P) or None)`` as ``bayes_filter``.
    """
    op = "sp_bayes_filter"
    if group is None:
        raise TypeError(f"{op}: `group` must be a process group (the sequence-parallel ranks), got None")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if layout is None:
        layout = PieceLayout.of(group, T, B, cu_seqlens, prefix_length, op)
    rank, world = group_rank(group), group_size(group)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    rows = B if not layout.varlen else 1  # the segment(s) that cross into the next rank

    start, received = initial_state, None
    if rank > 0:  # every rank but the first receives, also when its first segment starts here
        anchor = next((x for x in (k, q, v) if x.requires_grad), k)
        received = _Receive.apply(anchor, *_prior(rows, H, K, V, prior, q), dist.get_global_rank(group, rank - 1),
                                  group)
        if layout.continues:  # the first segment(s) start from what arrived, the others as given
            fresh = initial_state if initial_state is not None else _prior(N, H, K, V, prior, q)
            start = tuple(torch.cat([r.to(f.dtype), f[rows:]]) for r, f in zip(received, fresh))
    with parallel.local_ops():
        o, var, final = bayes_filter(q, k, v, prior=prior, initial_state=start, output_final_state=True,
                                     cu_seqlens=cu_seqlens, **kwargs)
    if received is not None and not layout.continues:  # unused, but its backward answers the previous rank
        o = tie(o, *received)
    if rank < world - 1:
        o = tie(o, _Send.apply(final[0][-rows:], final[1][-rows:], dist.get_global_rank(group, rank + 1), group))
    return o, var, (final if output_final_state else None)
