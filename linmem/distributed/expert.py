"""Expert parallelism for the MoE feed-forwards, and routing statistics over the global batch.

:func:`expert_parallel` turns a :class:`~linmem.layers.moe.MoEFeedForward` into an
:class:`ExpertParallelMoE` in place (same parameters, same state-dict keys). With ``ep`` ranks
each holds ``E / ep`` consecutive experts (``gate_up``, ``down`` become DTensors sharded on the
expert dim over the expert-parallel mesh). Every rank routes its own tokens, then (dropless)::

    counts [E]        tokens this rank sends to each expert (sorted by expert = by owner rank)
    all-to-all        of the counts: what each rank receives from every other, per local expert
    all-to-all        of the token rows (variable sizes), regrouped by local expert
    grouped GEMM      of the local experts (``grouped_linear``)
    all-to-all back   and the weighted combine of every token's k results

The router's balancing loss ``E * sum_e f_e P_e`` and z-loss are taken over the tokens of all
ranks of the data group (one all-reduce of the per-expert counts, probability sums and
log-sum-exp squares), so they equal the one-process values for the global batch; the all-reduce's
backward sums the ranks' gradients, which the data-parallel mean of gradients turns into the
exact gradient of the global loss. Expert gradients arrive through the all-to-all's backward as
sums over the ranks' tokens; FSDP divides them by the whole data world like every other gradient.
Without expert parallelism a ``capacity_factor`` caps every expert at its share of this rank's tokens, as
the layer does on one process for each of its micro-batches.

Under tensor parallelism (``tp_group``, set by :mod:`linmem.distributed.tensor`) every expert's hidden units are
split over the ``tp`` ranks, which route the same tokens alike: the experts' outputs are partial sums, summed
once over ``tp`` with the shared experts' (the rows and the routing weights enter with their gradients summed).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..layers.moe import MoEFeedForward
from ..ops.routing import (
    RouterStats,
    capacity_of,
    combine,
    dispatch,
    grouped_linear,
    limit_capacity,
    router_logits,
    router_stats,
    top_k_routing,
)
from .collectives import all_reduce_sum, all_to_all, exchange_counts, group_size, sum_gradients, sum_partials

__all__ = ["ExpertParallelMoE", "expert_parallel", "global_router_stats", "stats_reduction"]


def global_router_stats(
    logits: torch.Tensor,
    probs: torch.Tensor,
    groups: torch.Tensor,
    valid: Optional[torch.Tensor],
    group: Optional[ProcessGroup],
    kind: str = "moe",
) -> RouterStats:
    """:func:`linmem.ops.routing.router_stats` over the real tokens of every rank of ``group``.

    logits, probs ``[N, E]``; groups ``[N, k]``; valid ``[N]`` bool or None. ``group=None``: this rank only.
    """
    return router_stats(kind, logits, probs, groups, valid, reduce=stats_reduction(group))


def stats_reduction(group: Optional[ProcessGroup]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The ``reduce`` of :func:`linmem.ops.routing.router_stats` over ``group``: a differentiable all-reduce
    (its backward sums the ranks' gradients); None for None."""
    return None if group is None else partial(all_reduce_sum, group=group)


class _Router(nn.Linear):
    """The router's linear map computed as the MoE layer computes it: fp32 logits whatever the autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return router_logits(x, self.weight)


class ExpertParallelMoE(MoEFeedForward):
    """A :class:`MoEFeedForward` whose experts are split over ``ep_group`` and whose routing statistics
    cover ``stats_group``; built by :func:`expert_parallel`, never directly.

    ``forward(x [B, T, D], token_mask [B, T] or None) -> [B, T, D]`` as the layer it replaces.
    """

    ep_group: Optional[ProcessGroup]  # experts split over these ranks (None: every rank holds all)
    stats_group: Optional[ProcessGroup]  # balancing statistics over the tokens of these ranks
    tp_group: Optional[ProcessGroup] = None  # every expert's hidden units split over these ranks (tensor parallel)

    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        a = self.args
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)  # a module call, so that FSDP gathers the router's weight here
        weights, experts, probs = top_k_routing(logits, a.num_experts_per_tok, a.router)
        valid = None if token_mask is None else token_mask.reshape(-1)
        self.router_stats = global_router_stats(logits, probs, experts, valid, self.stats_group)
        keep = None if valid is None else valid[:, None].expand_as(experts)
        d = dispatch(experts, num_groups=a.num_experts, keep=keep)
        if a.capacity_factor is not None:  # every expert on this rank (expert parallelism is dropless)
            tokens = flat.shape[0] if valid is None else int(valid.sum())
            d = limit_capacity(d, capacity_of(tokens, a.num_experts_per_tok, a.num_experts, a.capacity_factor))
        tp = self.tp_group
        if tp is not None:  # the routing is every rank's alike; the experts' outputs are partial sums over tp
            flat, weights = sum_gradients(flat, tp), sum_gradients(weights, tp)
        rows = flat[d.token]
        if self.ep_group is None:
            results = self.experts(rows, d.group_sizes)
        else:
            results = self._exchange(rows, d.group_sizes)
        y = combine(results, d, weights).to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(flat)
        if tp is not None:  # routed and shared experts' partial sums, summed once
            y = sum_partials(y, tp)
        return y.view_as(x)

    def experts(self, rows: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """The SwiGLU of this rank's experts on their rows (sorted by local expert): ``[A, D]`` -> ``[A, D]``."""
        local = lambda w: w.to_local() if isinstance(w, DTensor) else w  # noqa: E731
        backend = self.args.expert_backend
        gate, up = grouped_linear(rows, local(self.gate_up), group_sizes, backend).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, local(self.down), group_sizes, backend)

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send rows (sorted by global expert) to the experts' ranks, run them there, bring the results back."""
        ranks = group_size(self.ep_group)
        local_experts = self.args.num_experts // ranks
        received = exchange_counts(counts, self.ep_group).view(ranks, local_experts)  # [source rank, local expert]
        send = counts.view(ranks, local_experts).sum(1)
        splits = torch.stack([send, received.sum(1)]).tolist()  # the one host read an exchange needs
        got = all_to_all(rows, self.ep_group, output_splits=splits[1], input_splits=splits[0])
        # arrived ordered (source rank, local expert); the grouped GEMM wants (local expert, source rank)
        expert_of_block = torch.arange(local_experts, device=rows.device).repeat(ranks)
        order = torch.sort(torch.repeat_interleave(expert_of_block, received.reshape(-1),
                                                   output_size=got.shape[0]), stable=True).indices
        results = self.experts(got[order], received.sum(0))
        out = results.new_empty(results.shape)
        out[order] = results
        return all_to_all(out, self.ep_group, output_splits=splits[0], input_splits=splits[1])


def expert_parallel(
    moe: MoEFeedForward, ep_mesh: Optional[DeviceMesh], stats_group: Optional[ProcessGroup]
) -> ExpertParallelMoE:
    """Make ``moe`` expert-parallel over ``ep_mesh`` (in place) and its routing statistics global over
    ``stats_group``; returns the same module.

    Args:
        moe: a MoE feed-forward, identical on every rank (same initialisation).
        ep_mesh: 1-D mesh of the expert-parallel ranks, or None to keep every expert on every rank.
        stats_group: the ranks whose tokens form the global batch (every rank of the run), or None.

    Example (under ``torchrun --nproc-per-node 2``):
        >>> expert_parallel(model.model.layers[0].mlp, mesh.ep, mesh.data.get_group())  # doctest: +SKIP
    """
    if not isinstance(moe, MoEFeedForward):
        raise TypeError(f"expert_parallel: `moe` must be a MoEFeedForward, got {type(moe).__name__}")
    if isinstance(moe, ExpertParallelMoE):
        raise ValueError("expert_parallel: this layer is already expert-parallel")
    ranks = 1 if ep_mesh is None else ep_mesh.size()
    if moe.args.num_experts % ranks:
        raise ValueError(f"expert_parallel: {moe.args.num_experts} experts do not split over {ranks} ranks")
    if ranks > 1 and moe.args.capacity_factor is not None:
        raise ValueError("expert_parallel: expert parallelism is dropless; set moe.capacity_factor to None "
                         f"(got {moe.args.capacity_factor})")
    moe.__class__ = ExpertParallelMoE
    moe.router.__class__ = _Router
    moe.ep_group = ep_mesh.get_group() if ranks > 1 else None
    moe.stats_group = stats_group
    if ranks > 1:
        for name in ("gate_up", "down"):
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)])))
    return moe
