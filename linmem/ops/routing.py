"""Routing of tokens to experts or memories: top-k choice, sort by group, gather, grouped GEMM, scatter back,
and the router's balancing losses (docs/architecture.md, "The other memories": mixture of memories and of experts).

Shared by the MoE feed-forward (:mod:`linmem.layers.moe`) and the mixture of memories
(:mod:`linmem.layers.mom`). Tokens are flattened to ``N`` rows; each chooses ``S`` slots (its
top-k groups, plus for MoM the shared memory). A :class:`Dispatch` lists the kept (token, slot)
assignments sorted by (group, segment, token), so that

* the rows of one group are contiguous (one GEMM per group, or one grouped GEMM), and
* inside a group the rows of one segment (a sequence) are contiguous and in time order, so the
  (group, segment) runs form a varlen batch whose boundaries are ``Dispatch.cu_seqlens``.

Example:
    >>> import torch
    >>> logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 1.0]])
    >>> weights, groups, probs = top_k_routing(logits, 2)
    >>> d = dispatch(groups, num_groups=3)
    >>> d.token.tolist(), d.group_sizes.tolist()
    ([0, 1, 0, 1], [1, 1, 2])
    >>> rows = torch.randn(4, 5)                              # one result per sorted assignment
    >>> combine(rows, d, weights).shape                       # back to the tokens, weighted
    torch.Size([2, 5])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

#: valid values of ``top_k_routing(kind=...)``
ROUTERS = ("softmax", "sigmoid")
#: valid values of ``grouped_linear(backend=...)``
GROUPED_BACKENDS = ("auto", "grouped_mm", "loop")


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32 whatever the autocast state: x ``[N, D]``, weight ``[E, D]`` -> ``[N, E]``."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


def top_k_routing(
    logits: torch.Tensor, k: int, kind: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick the top-k groups of every token and renormalise their weights to sum to 1.

    ``kind="softmax"``: scores ``softmax(logits)``; ``kind="sigmoid"``: scores ``sigmoid(logits)``
    (DeepSeek-V3 style), whose normalised form ``s / sum(s)`` stands in for the probabilities.

    Args:
        logits: ``[N, E]`` router logits (fp32 recommended).
        k: groups per token, ``1 <= k <= E``.
        kind: one of :data:`ROUTERS`.

    Returns:
        ``(weights [N, k], groups [N, k] int64, probs [N, E])``; ``probs`` (rows summing to 1)
        feed the load-balancing loss.

    Example:
        >>> w, g, p = top_k_routing(torch.tensor([[0.0, 1.0, 2.0]]), 2)
        >>> g.tolist(), round(float(w.sum()), 6)
        ([[2, 1]], 1.0)
    """
    if kind not in ROUTERS:
        raise ValueError(f"top_k_routing: unknown `kind` {kind!r}; valid: {', '.join(ROUTERS)}")
    E = logits.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"top_k_routing: `k` must lie in [1, {E}] (the number of groups), got {k}")
    if kind == "softmax":
        scores = logits.softmax(dim=-1)
        probs = scores
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    weights, groups = scores.topk(k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), groups, probs


@dataclass
class Dispatch:
    """Kept (token, slot) assignments sorted by (group, segment, token).

    ``A`` assignments, ``G`` groups, ``S`` segments, tokens choose ``slots`` groups each.
    """

    token: torch.Tensor  # [A] int64: the token of each sorted assignment
    slot: torch.Tensor  # [A] int64: its index in the flattened [N * slots] assignment array
    group_sizes: torch.Tensor  # [G] int64: assignments per group
    cu_seqlens: torch.Tensor  # [G * S + 1] int64: boundaries of the (group, segment) runs
    num_tokens: int  # N
    slots: int  # groups chosen per token


def dispatch(
    groups: torch.Tensor,
    *,
    num_groups: int,
    segments: Optional[torch.Tensor] = None,
    num_segments: int = 1,
    keep: Optional[torch.Tensor] = None,
) -> Dispatch:
    """Sort the assignments ``groups [N, slots]`` by (group, segment, token).

    Args:
        groups: ``[N, slots]`` int group of every (token, slot), values in ``[0, num_groups)``.
        num_groups: G.
        segments: ``[N]`` int segment (sequence) of every token, non-decreasing within a
            sequence's tokens; None = one segment.
        num_segments: S.
        keep: ``[N, slots]`` bool; False drops the assignment (padding). None keeps all.

    Returns:
        The :class:`Dispatch`; run ``g * S + s`` of ``cu_seqlens`` holds the tokens of segment
        ``s`` sent to group ``g``, in token (time) order.

    Example:
        >>> d = dispatch(torch.tensor([[1], [0], [1]]), num_groups=2, segments=torch.tensor([0, 0, 1]),
        ...              num_segments=2)
        >>> d.token.tolist(), d.cu_seqlens.tolist()
        ([1, 0, 2], [0, 1, 1, 2, 3])
    """
    N, slots = groups.shape
    slot = torch.arange(N * slots, device=groups.device)
    segment = torch.zeros_like(slot) if segments is None else segments.long().repeat_interleave(slots)
    key = groups.reshape(-1).long() * num_segments + segment
    if keep is not None:
        slot, key = slot[keep.reshape(-1)], key[keep.reshape(-1)]
    order = torch.sort(key, stable=True).indices  # stable: token order survives inside every run
    counts = torch.bincount(key, minlength=num_groups * num_segments)
    slot = slot[order]
    return Dispatch(
        token=slot // slots, slot=slot, group_sizes=counts.view(num_groups, num_segments).sum(1),
        cu_seqlens=F.pad(counts.cumsum(0), (1, 0)), num_tokens=N, slots=slots,
    )


def limit_capacity(d: Dispatch, capacity: int) -> Dispatch:
    """Keep at most ``capacity`` assignments per group, the earliest tokens first (one segment only).

    Example:
        >>> d = limit_capacity(dispatch(torch.tensor([[0], [0], [1]]), num_groups=2), 1)
        >>> d.token.tolist(), d.group_sizes.tolist()
        ([0, 2], [1, 1])
    """
    if d.cu_seqlens.numel() != d.group_sizes.numel() + 1:
        raise ValueError("limit_capacity: the dispatch must have one segment per group (segments=None)")
    group = torch.repeat_interleave(torch.arange(d.group_sizes.numel(), device=d.token.device), d.group_sizes,
                                    output_size=d.token.numel())
    position = torch.arange(d.token.numel(), device=d.token.device) - d.cu_seqlens[group]
    kept = position < capacity
    sizes = d.group_sizes.clamp(max=capacity)
    return Dispatch(token=d.token[kept], slot=d.slot[kept], group_sizes=sizes,
                    cu_seqlens=F.pad(sizes.cumsum(0), (1, 0)), num_tokens=d.num_tokens, slots=d.slots)


def capacity_of(num_tokens: int, k: int, num_groups: int, factor: float) -> int:
    """Assignments one group may take: ``ceil(factor * num_tokens * k / num_groups)``."""
    return math.ceil(factor * num_tokens * k / num_groups)


def combine(values: torch.Tensor, d: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's results: values ``[A, ...]`` (sorted) -> ``[N, ...]``.

    ``weights: [N, slots]``; dropped assignments contribute zero. Deterministic (no atomics).
    """
    buffer = values.new_zeros(d.num_tokens * d.slots, *values.shape[1:])
    buffer[d.slot] = values
    buffer = buffer.view(d.num_tokens, d.slots, *values.shape[1:])
    w = weights.to(values.dtype).view(d.num_tokens, d.slots, *([1] * (values.dim() - 1)))
    return (buffer * w).sum(dim=1)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """One linear map per group over rows sorted by group: ``y[rows of g] = x[rows of g] @ weight[g].T``.

    Args:
        x: ``[A, in]`` rows, group by group; ``sum(group_sizes) == A``.
        weight: ``[G, out, in]`` (the ``nn.Linear`` layout, stacked).
        group_sizes: ``[G]`` int rows per group.
        backend: ``"grouped_mm"`` (``torch._grouped_mm``: CUDA, compute capability >= 9.0, bf16,
            in/out multiples of 8), ``"loop"`` (one matmul per group: any device and dtype) or
            ``"auto"`` (``grouped_mm`` where it applies, else ``loop``).

    Returns:
        ``[A, out]`` in the autocast dtype where autocast is on, else in ``x.dtype``.

    Example:
        >>> y = grouped_linear(torch.randn(5, 4), torch.randn(2, 3, 4), torch.tensor([2, 3]))
        >>> y.shape
        torch.Size([5, 3])
    """
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"grouped_linear: unknown `backend` {backend!r}; valid: {', '.join(GROUPED_BACKENDS)}")
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_linear: expected x [A, in] and weight [G, out, in], got {list(x.shape)} "
                         f"and {list(weight.shape)}")
    if group_sizes.shape != (weight.shape[0],):
        raise ValueError(f"grouped_linear: `group_sizes` must have shape [{weight.shape[0]}], got "
                         f"{list(group_sizes.shape)}")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x, weight = x.to(dtype), weight.to(dtype)
    applies = grouped_mm_applies(x, weight)
    if backend == "grouped_mm" and not applies:
        raise ValueError("grouped_linear: backend 'grouped_mm' needs torch._grouped_mm, a CUDA device of compute "
                         "capability >= 9.0, bf16 inputs and in/out sizes that are multiples of 8; got "
                         f"{x.device}, {x.dtype}, in {x.shape[1]}, out {weight.shape[1]}; use 'loop' or 'auto'")
    if backend != "loop" and applies:
        offsets = group_sizes.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    parts = x.split(group_sizes.tolist())
    return torch.cat([part @ w.T for part, w in zip(parts, weight)])


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` serves ``x [A, in] @ weight[g].T``: a CUDA device of compute
    capability >= 9.0 (its fast kernels; older GPUs and the CPU get the loop), bf16, and rows of
    16-byte multiples (in and out multiples of 8), in a torch that has the op."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.shape[1] % 8 == 0
        and weight.shape[1] % 8 == 0
    )


def segment_context(
    rows: torch.Tensor, cu_seqlens: torch.Tensor, context: torch.Tensor, context_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put the newest ``context_len[p]`` rows of ``context[p]`` in front of every segment p.

    Args:
        rows: ``[A, ...]`` packed segments; cu_seqlens: ``[P + 1]`` their boundaries.
        context: ``[P, W, ...]`` the rows that came before each segment, oldest first.
        context_len: ``[P]`` int, how many of the last rows of ``context[p]`` are real (<= W).

    Returns:
        ``(packed [A + sum(context_len), ...], cu_seqlens [P + 1], index [A])``: the longer packed
        batch, its boundaries and where the original rows went.

    Example:
        >>> packed, cu, index = segment_context(torch.tensor([[1.], [2.], [3.]]), torch.tensor([0, 2, 3]),
        ...                                     torch.tensor([[[8.], [9.]], [[0.], [7.]]]), torch.tensor([1, 1]))
        >>> packed.flatten().tolist(), cu.tolist(), index.tolist()
        ([9.0, 1.0, 2.0, 7.0, 3.0], [0, 3, 5], [1, 2, 4])
    """
    P, W = context.shape[:2]
    lengths = cu_seqlens.diff()
    starts = F.pad((lengths + context_len).cumsum(0), (1, 0))
    segment = torch.repeat_interleave(torch.arange(P, device=rows.device), lengths, output_size=rows.shape[0])
    index = torch.arange(rows.shape[0], device=rows.device) - cu_seqlens[segment] + starts[segment] + \
        context_len[segment]
    lag = torch.arange(W, device=rows.device) - (W - context_len[:, None])  # [P, W], < 0: not real
    real = lag >= 0
    packed = rows.new_empty(int(starts[-1]), *rows.shape[1:])
    packed[index] = rows
    packed[(starts[:-1, None] + lag)[real]] = context[real].to(rows.dtype)
    return packed, starts, index


def segment_tails(rows: torch.Tensor, cu_seqlens: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last W rows of every segment, zero-filled in front when a segment is shorter.

    rows ``[A, ...]``, cu_seqlens ``[P + 1]`` -> ``(tails [P, W, ...], lengths [P])`` with
    ``lengths = min(W, segment length)``, ready to be the ``context`` of :func:`segment_context`.
    """
    lengths = cu_seqlens.diff().clamp(max=W)
    position = cu_seqlens[1:, None] - W + torch.arange(W, device=rows.device)  # [P, W]
    real = torch.arange(W, device=rows.device) >= W - lengths[:, None]
    tails = rows[position.clamp(min=0)]
    mask = real.view(*real.shape, *([1] * (rows.dim() - 1)))
    return torch.where(mask, tails, torch.zeros_like(tails)), lengths


@dataclass
class RouterStats:
    """What one routed layer reports to the model: losses for training, load for the metrics."""

    kind: str  # "moe" (experts) or "mom" (memories)
    logits: torch.Tensor  # [N, E] router logits of every token (padding included), fp32
    balance_loss: torch.Tensor  # [] E * sum_e f_e P_e over the real tokens
    z_loss: torch.Tensor  # [] mean over the real tokens of logsumexp(logits)^2
    load: torch.Tensor  # [E] fraction of the real tokens routed to each group (sums to k), detached


def router_stats(
    kind: str,
    logits: torch.Tensor,
    probs: torch.Tensor,
    groups: torch.Tensor,
    valid: Optional[torch.Tensor] = None,
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> RouterStats:
    """Balancing loss, z-loss and load of one routed layer (see :class:`RouterStats`).

    The balancing loss is Switch's ``E * sum_e f_e P_e``: ``f_e`` the fraction of the real tokens that chose group
    e among their top k (no gradient; ``sum_e f_e = k`` as in transformers' ``load_balancing_loss_func``, so the
    loss is k when the load is uniform), ``P_e`` their mean router probability of e. The z-loss is ST-MoE's mean of
    ``logsumexp(logits)^2`` over the real tokens.

    logits, probs ``[N, E]``; groups ``[N, k]``; valid ``[N]`` bool or None. ``reduce`` (None: these tokens
    only) sums a tensor over the ranks whose tokens form the global batch, differentiably (the data-parallel
    group's all-reduce): the per-group counts, the token count, the probability sums and the z-loss's sum go
    through it in one call, so that the losses are those of the global batch.

    Example:
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> w, g, p = top_k_routing(logits, 1)
        >>> router_stats("moe", logits, p, g).load.tolist()
        [0.5, 0.5]
    """
    E = probs.shape[-1]
    if valid is not None:
        probs, groups, real_logits = probs[valid], groups[valid], logits[valid]
    else:
        real_logits = logits
    counts = torch.bincount(groups.reshape(-1), minlength=E).to(probs.dtype)
    z = torch.logsumexp(real_logits.float(), dim=-1).square().sum()
    tokens = probs.new_full((1,), float(groups.shape[0]))
    totals = torch.cat([counts, tokens, probs.sum(0), z[None]])  # one reduction for every sum
    if reduce is not None:
        totals = reduce(totals)
    counts, tokens, prob_sum, z = totals[:E].detach(), totals[E].detach(), totals[E + 1: 2 * E + 1], totals[-1]
    n = tokens.clamp_min(1)
    load = counts / n  # fraction of the tokens that chose each group (sums to k)
    return RouterStats(kind=kind, logits=logits, balance_loss=E * (load * prob_sum / n).sum(), z_loss=z / n,
                       load=load.detach())


def load_summary(stats: Sequence[RouterStats]) -> dict[str, torch.Tensor]:
    """Per kind, the most and least loaded group relative to a uniform load (1 = balanced, 0 = unused),
    averaged over layers: ``{"moe_load_max": ..., "moe_load_min": ..., "mom_load_max": ...}``."""
    summary: dict[str, torch.Tensor] = {}
    for kind in sorted({s.kind for s in stats}):
        ratios = [s.load / s.load.mean().clamp_min(1e-12) for s in stats if s.kind == kind]
        summary[f"{kind}_load_max"] = torch.stack([r.max() for r in ratios]).mean()
        summary[f"{kind}_load_min"] = torch.stack([r.min() for r in ratios]).mean()
    return summary
