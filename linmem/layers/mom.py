"""Mixture of Memories (Du et al. 2025, "MoM: Linear Sequence Modeling with Mixture-of-Memories",
arXiv 2502.13685) over the update rules of the unified recurrence.

    p_t = softmax(W_r x_t)                       router over M memories; top-k, weights renormalised
    memory m: its own key, value and gate projections; its state S^m changes only on its tokens
    o_t = sum_{m in top-k(t)} w_{t,m} q_t S^m_t  (+ q_t S^shared_t: one more memory every token writes)
    y_t = the rule's output stage (norm, output gate, o_proj) applied to o_t

The rule is one of the memory mixers (``mom_memory``): MoM builds it once and replaces the
projections the rule declares in ``memory_projections`` by :class:`MemoryLinear` (one weight per
memory, stacked), computes them per memory and hands their outputs to the rule
(``recurrence_inputs(..., projected=...)``); the query, the convolution weights, decay constants and
the output stage stay shared, computed by the rule's own code. Mixing the read-outs before the output
stage reads the mixed memory ``sum_m w_m S^m``, as the paper defines it (for normalised linear
attention the numerators and the normaliser are mixed alike). Tensors the rule hands from its inputs
to its output stage (Mamba-2's x and z) are mixed with the same weights.

Routing (:mod:`linmem.ops.routing`): every token gets k + 1 slots (its top-k memories and the shared
one), the (token, slot) assignments are sorted by (memory, sequence, time), and the runs of every
(memory, sequence) pair are one varlen batch: the per-memory projections run as one grouped GEMM
over it, the rule's short convolutions see each memory's own token stream, and the recurrence runs
once with ``cu_seqlens`` over all pairs. With a cache, each pair keeps its state and its last
``conv_size - 1`` inputs (``history``), which are put in front of the pair's new tokens so the
convolutions continue exactly; only the pairs that receive tokens are computed and written, the
others stay bit-identical.

Rules left out (they declare no memory projections): retention (its rotary positions would restart
on every memory's stream), RWKV-6/7 (their per-memory parts are LoRA token-shift mixes, and RWKV-7's
output stage reads q, k, v).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.routing import (
    Dispatch,
    RouterStats,
    combine,
    dispatch,
    grouped_linear,
    router_logits,
    router_stats,
    segment_context,
    segment_tails,
    top_k_routing,
)
from ..ops.varlen import sequence_ids
from .base import (
    MIXERS,
    LayerState,
    Mixer,
    MixerArgs,
    build_mixer,
    check_bool,
    check_cache_and_varlen,
    check_choice,
    check_float,
    check_int,
    register_mixer,
)
from .conv import ShortConvolution
from .recurrent import MemoryMixer, RecurrenceArgs, activation_dtype


def mom_rules() -> list[str]:
    """The memory mixers a mixture of memories can use as its rule: those that declare memory projections."""
    return sorted(name for name, cls in MIXERS.items()
                  if issubclass(cls, MemoryMixer) and cls.memory_projections)


@dataclass
class MoMArgs(MixerArgs):
    """:class:`MixerArgs` plus the mixture's own fields."""

    mom_memory: str = "gated_deltanet"  # update rule of every memory: one of mom_rules()
    num_memories: int = 4  # routed memories M
    top_k: int = 2  # memories each token is routed to
    shared_memory: bool = True  # one more memory that every token writes (weight 1)
    aux_loss_coef: float = 0.01  # weight of the balancing loss (mean over the layers) in a model's loss

    @classmethod
    def of(cls, args: MixerArgs) -> "MoMArgs":
        """``args`` itself if it is MoMArgs, else its fields with the mixture's defaults."""
        if isinstance(args, MoMArgs):
            return args
        return cls(**{name: getattr(args, name) for name in MixerArgs.field_names()})

    def rule_args(self) -> MixerArgs:
        """The arguments of the rule's mixer (the MixerArgs fields)."""
        return MixerArgs(**{name: getattr(self, name) for name in MixerArgs.field_names()})

    def validate(self, owner: str = "mom") -> None:
        """Refuse an unknown rule or a top_k outside [1, num_memories], naming the valid choices."""
        super().validate(owner)
        self.validate_options(owner)

    def validate_options(self, owner: str = "mom") -> None:
        """Check the mixture's own fields only (those :class:`MixerArgs` lacks)."""
        check_choice(owner, "mom_memory", self.mom_memory, mom_rules())
        check_int(owner, "num_memories", self.num_memories, minimum=1)
        check_int(owner, "top_k", self.top_k, minimum=1)
        if self.top_k > self.num_memories:
            raise ValueError(f"{owner}: `top_k` = {self.top_k} must lie in [1, num_memories = {self.num_memories}]")
        check_bool(owner, "shared_memory", self.shared_memory)
        check_float(owner, "aux_loss_coef", self.aux_loss_coef, minimum=0.0, inclusive=True)


class MemoryLinear(nn.Module):
    """One linear map per memory, applied to rows sorted by memory with one grouped GEMM.

    ``weight: [M, out, in]`` (and ``bias: [M, out]``) stack the given ``nn.Linear`` layers, and start
    as they do: ``init`` (a :class:`~linmem.layers.init.Linear`'s) for every memory, else torch's
    default. x ``[A, in]`` (rows sorted by memory, ``group_sizes: [M]`` rows each) -> ``[A, out]``.
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.init = getattr(linears[0], "init", None)
        self.weight = nn.Parameter(torch.stack([linear.weight.detach() for linear in linears]))
        has_bias = linears[0].bias is not None
        self.bias = nn.Parameter(torch.stack([linear.bias.detach() for linear in linears])) if has_bias else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for m in range(self.weight.shape[0]):
            if self.init is not None:
                self.init(self.weight[m])
                if self.bias is not None:
                    nn.init.zeros_(self.bias[m])
                continue
            nn.init.kaiming_uniform_(self.weight[m], a=math.sqrt(5))  # as nn.Linear.reset_parameters
            if self.bias is not None:
                bound = 1 / math.sqrt(self.weight.shape[2])
                nn.init.uniform_(self.bias[m], -bound, bound)

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        y = grouped_linear(x, self.weight, group_sizes)
        if self.bias is not None:
            y = y + torch.repeat_interleave(self.bias, group_sizes, dim=0, output_size=x.shape[0]).to(y.dtype)
        return y

    def per_memory_parameters(self) -> int:
        """Parameters of one memory's map."""
        return self.weight[0].numel() + (self.bias[0].numel() if self.bias is not None else 0)


def stack_memories(modules: Sequence[nn.Module]) -> nn.Module:
    """One module per memory -> their stack: ``nn.Linear`` -> :class:`MemoryLinear`, ``nn.Sequential`` of
    linear maps -> ``nn.Sequential`` of stacks."""
    first = modules[0]
    if isinstance(first, nn.Linear):
        return MemoryLinear(modules)
    if isinstance(first, nn.Sequential) and all(isinstance(layer, nn.Linear) for layer in first):
        return nn.Sequential(*(MemoryLinear([m[i] for m in modules]) for i in range(len(first))))
    raise TypeError(f"a memory projection must be nn.Linear or nn.Sequential of nn.Linear, got {type(first).__name__}")


def apply_per_memory(stack: nn.Module, rows: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """A stack of :func:`stack_memories` on rows ``[A, in]`` sorted by memory -> ``[A, out]``."""
    for layer in (stack if isinstance(stack, nn.Sequential) else [stack]):
        rows = layer(rows, group_sizes)
    return rows


@register_mixer("mom")
class MixtureOfMemories(Mixer):
    """MoM over any rule of :func:`mom_rules`: hidden ``[B, T, D]`` -> ``[B, T, D]``.

    The cache holds per (sequence, memory) the rule's state tensors (its ``state_names``: ``recurrent:
    [B, M', H, K, V]`` fp32 for the unified recurrence; the Bayesian memory adds its covariance), and when
    the rule has short convolutions ``history: [B, M', conv_size - 1, D]`` with ``history_len: [B, M']``;
    M' = M (+ 1 with the shared memory). After each call ``router_stats`` holds the router's
    :class:`~linmem.ops.routing.RouterStats`.

    Example:
        >>> from linmem.layers import build_mixer
        >>> from linmem.layers.mom import MoMArgs
        >>> mom = build_mixer("mom", MoMArgs(hidden_size=32, num_heads=2, mom_memory="gla", num_memories=4))
        >>> mom(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    kind = "memory"
    args_class = MoMArgs

    def __init__(self, args: MixerArgs) -> None:
        args = MoMArgs.of(args)
        super().__init__(args)
        self.num_states = args.num_memories + int(args.shared_memory)  # M'
        rule_args = args.rule_args()
        self.memory = build_mixer(args.mom_memory, rule_args)
        others = [build_mixer(args.mom_memory, rule_args) for _ in range(self.num_states - 1)]
        for name in self.memory.memory_projections:
            self.memory.set_submodule(name, stack_memories([m.get_submodule(name) for m in (self.memory, *others)]))
        self.router = nn.Linear(args.hidden_size, args.num_memories, bias=False)
        convs = [m.size for m in self.memory.modules() if isinstance(m, ShortConvolution)]
        self.context = max(convs, default=1) - 1  # past inputs a memory's convolutions read
        self.router_stats: Optional[RouterStats] = None
        # sums the routing statistics over the global batch's ranks (set under data parallelism); None: these tokens
        self.stats_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

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
        weights, memories, valid = self.route(hidden, token_mask)
        return self.mix_memories(hidden, weights, memories, valid, cu_seqlens=cu_seqlens, cache=cache)

    def route(
        self, hidden: torch.Tensor, token_mask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The router's choice for hidden ``[B, T, D]`` (N = B * T tokens): weights ``[N, S]``, memories ``[N, S]``
        (S = k, + 1 with the shared memory, last) and valid ``[N]`` (None without ``token_mask``); sets
        ``router_stats``."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = router_logits(flat, self.router.weight)
        weights, memories, probs = top_k_routing(logits, self.args.top_k)
        valid = None if token_mask is None else token_mask.reshape(-1)
        self.router_stats = router_stats("mom", logits, probs, memories, valid, self.stats_reduce)
        if self.args.shared_memory:
            memories = torch.cat([memories, torch.full_like(memories[:, :1], self.args.num_memories)], dim=1)
            weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
        return weights, memories, valid

    def mix_memories(
        self,
        hidden: torch.Tensor,
        weights: torch.Tensor,
        memories: torch.Tensor,
        valid: Optional[torch.Tensor],
        *,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[LayerState] = None,
    ) -> torch.Tensor:
        """hidden ``[B, T, D]`` through the memories :meth:`route` chose (``weights``, ``memories``: ``[B * T, S]``,
        ``valid``: ``[B * T]`` or None), their read-outs mixed by ``weights``, then the rule's output stage ->
        ``[B, T, D]``."""
        B, T, D = hidden.shape
        flat = hidden.reshape(B * T, D)
        segments, num_segments = _sequence_of_tokens(B, T, cu_seqlens, hidden.device)
        d = dispatch(memories, num_groups=self.num_states, segments=segments, num_segments=num_segments,
                     keep=None if valid is None else valid[:, None].expand_as(memories))
        if cache is None:
            args = self._recurrence_inputs(flat[d.token], d.cu_seqlens, d.group_sizes)
            o, _ = self.memory.run_memory(args, None, cu_seqlens=d.cu_seqlens, output_final_state=False)
        else:
            args, o = self._cached(flat, d, B, cache)
        return self._mix(o, args, d, weights, hidden)

    def _recurrence_inputs(
        self, rows: torch.Tensor, cu_seqlens: torch.Tensor, group_sizes: torch.Tensor
    ) -> RecurrenceArgs:
        """The rule's inputs on packed rows ``[A, D]`` sorted by memory (``group_sizes: [M']`` rows each)."""
        projected = {name: apply_per_memory(self.memory.get_submodule(name), rows, group_sizes)[None]
                     for name in self.memory.memory_projections}
        args = self.memory.recurrence_inputs(rows[None], cache=None, cu_seqlens=cu_seqlens, projected=projected)
        return args.cast(activation_dtype(rows))

    def _cached(
        self, flat: torch.Tensor, d: Dispatch, B: int, cache: LayerState
    ) -> tuple[RecurrenceArgs, torch.Tensor]:
        """Run only the (memory, sequence) pairs that receive tokens, from their cached states and histories."""
        counts = d.cu_seqlens.diff()
        pairs = torch.nonzero(counts).squeeze(1)  # pair = memory * B + sequence
        b, m = pairs % B, pairs // B
        cu = F.pad(counts[pairs].cumsum(0), (1, 0))
        rows, packed_cu, index = self._after_history(flat[d.token], cu, b, m, B, cache)
        sizes = torch.zeros(self.num_states, dtype=torch.long, device=flat.device).index_add_(0, m, packed_cu.diff())
        args = self._recurrence_inputs(rows, packed_cu, sizes)
        if index is not None:
            args = _take_rows(args, index)
        return args, self._continue_states(args, cu, b, m, B, cache)

    def _after_history(
        self, rows: torch.Tensor, cu: torch.Tensor, b: torch.Tensor, m: torch.Tensor, B: int, cache: LayerState
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Put each pair's cached last inputs before its new rows (for the convolutions), and cache the new
        last inputs. Returns (rows, their cu_seqlens, where the new rows went) or, without convolutions,
        (rows, cu, None)."""
        if not self.context:
            return rows, cu, None
        shape = (B, self.num_states, self.context, rows.shape[1])
        history = _cached_tensor(cache, "history", shape, rows.dtype, rows.device)
        length = _cached_tensor(cache, "history_len", shape[:2], torch.long, rows.device)
        rows, packed_cu, index = segment_context(rows, cu, history[b, m], length[b, m])
        tails, tail_len = segment_tails(rows.detach(), packed_cu, self.context)
        _write_pairs(cache, "history", b, m, tails)
        _write_pairs(cache, "history_len", b, m, tail_len)
        return rows, packed_cu, index

    def _continue_states(
        self, args: RecurrenceArgs, cu: torch.Tensor, b: torch.Tensor, m: torch.Tensor, B: int, cache: LayerState
    ) -> torch.Tensor:
        """The recurrence of the pairs (b, m) from their cached states; the new states go back to the cache."""
        names = self.memory.state_names
        if names[0] not in cache:  # the first call: every (sequence, memory) pair starts from the rule's fresh state
            for name, fresh in zip(names, self.memory.fresh_state(B * self.num_states, args)):
                cache.set(name, fresh.unflatten(0, (B, self.num_states)))
        state = tuple(cache.get(name)[b, m] for name in names)
        pairs = b.numel()
        if args.q.shape[1] == pairs and not torch.is_grad_enabled():  # one token per pair: a decoding step
            o, state = self.memory.step_memory(args.as_steps(), state)
            o = o[None]
        else:
            o, state = self.memory.run_memory(args, state, cu_seqlens=cu, output_final_state=True)
        for name, tensor in zip(names, state):
            _write_pairs(cache, name, b, m, tensor)
        return o

    def _mix(
        self, o: torch.Tensor, args: RecurrenceArgs, d: Dispatch, weights: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of each token's read-outs (and per-row extras), then the rule's output stage."""
        B, T = hidden.shape[:2]
        A = d.token.numel()
        mix = lambda x: combine(x[0], d, weights).view(B, T, *x.shape[2:])  # noqa: E731
        extras = {name: mix(x) if _per_row(x, A) else x for name, x in args.extras.items()}
        return self.memory.output(mix(o), hidden, replace(args, extras=extras))

    def inactive_parameter_count(self) -> int:
        """Parameters of the memories a token is not routed to: (M - k) memories' own projections."""
        idle = self.args.num_memories - self.args.top_k
        return idle * sum(m.per_memory_parameters() for m in self.memory.modules() if isinstance(m, MemoryLinear))


def _sequence_of_tokens(
    B: int, T: int, cu_seqlens: Optional[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, int]:
    """The sequence of each flattened token ``[B * T]`` and the number of sequences."""
    if cu_seqlens is None:
        return torch.arange(B, device=device).repeat_interleave(T), B
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    return sequence_ids(starts, T), starts.numel() - 1


def _per_row(x: object, rows: int) -> bool:
    """Whether x is a per-token tensor ``[1, rows, ...]`` of a packed batch (not a per-head constant)."""
    return isinstance(x, torch.Tensor) and x.dim() >= 3 and tuple(x.shape[:2]) == (1, rows)


def _take_rows(args: RecurrenceArgs, index: torch.Tensor) -> RecurrenceArgs:
    """Keep the packed rows ``index`` of every per-token tensor of ``args``."""
    rows = args.q.shape[1]
    take = lambda x: x[:, index] if _per_row(x, rows) else x  # noqa: E731
    per_token = {f.name: take(getattr(args, f.name)) for f in fields(args) if f.name not in ("scale", "extras")}
    return replace(args, **per_token, extras={name: take(x) for name, x in args.extras.items()})


def _cached_tensor(
    cache: LayerState, name: str, shape: tuple, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``cache[name]``, created as zeros of ``shape`` on first use."""
    if name not in cache:
        cache.set(name, torch.zeros(shape, dtype=dtype, device=device))
    return cache.get(name)


def _write_pairs(cache: LayerState, name: str, b: torch.Tensor, m: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[name][b, m] = values``; in place when no gradient is recorded, else out of place."""
    current = cache.get(name)
    if torch.is_grad_enabled():
        cache.set(name, current.index_put((b, m), values.to(current.dtype)))
    else:
        current.index_put_((b, m), values.to(current.dtype))
