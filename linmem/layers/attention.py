"""Softmax-attention mixers of hybrid models: full (``softmax``), sliding-window (``swa``) and
the Forgetting Transformer (``fox``, Lin et al. 2025, "Forgetting Transformer: Softmax Attention
with a Forget Gate", arXiv 2503.02130).

    o_i = sum_{j <= i, i - W < j} softmax_j(q_i . k_j / sqrt(D) + c_i - c_j) v_j,    c_i = sum_{l <= i} log f_l

``softmax`` and ``swa`` use RoPE and no forget gate (c = 0); FoX has no RoPE. ``rope``
(``MixerArgs.rope``: None keeps these defaults, True or False forces it) gives any of them RoPE or
takes it away, for the FoX paper's Table 3 ablations (FoX + RoPE, a Transformer without RoPE). ``window`` W
(``MixerArgs.window``) makes any of them local; ``swa`` requires it. FoX's forget gate
(``MixerArgs.forget_gate``, the variants of the paper's Fig. 7):

    data_dependent     f_t = sigmoid(w_h^T x_t + b_h)          (the default)
    data_independent   f_t = sigmoid(b_h), b_h learnt per head
    fixed              f_t = sigmoid(b_h), b_h fixed per head

The per-head constants start at (and, fixed, stay at) b_h = -log(exp(1 / t_h) - 1), so that
-1 / log f_h = t_h: decay times t_h spread log-uniformly over :data:`DECAY_TIME_RANGE` tokens.

FoX's ``prune_tolerance`` eps (``MixerArgs.prune_tolerance``, None: off) turns on adaptive computation
pruning (:func:`~linmem.ops.attention.forgetting_attention`): in a call that attends over its own keys
only (training, a prefill into an empty cache without padding) the pairs whose forget bias lies below a
bound are dropped, so that each query's dropped softmax weights sum to less than eps; the decoding calls
over a cache (:func:`~linmem.ops.attention.cached_attention`) attend over every cached key.

The FoX paper's "Pro" block options apply to every attention mixer (the paper's "Transformer
(Pro)" baseline is ``softmax`` with them): ``qk_norm`` (per-head RMSNorm of q and k, before RoPE),
``kv_shift`` (k~_t = a_t k_{t-1} + (1 - a_t) k_t with a_t = sigmoid(W_s x_t) per KV head, the same
for v with its own gate), ``output_norm`` (per-head RMSNorm of o) and ``output_gate``
(o * sigmoid(W_g x)).

Decoding cache (a :class:`LayerState`), preallocated buffers, batch-first: ``k [B, S, Hkv, D]``,
``v [B, S, Hkv, Dv]``, ``key_mask [B, S]`` (False at padding and at empty slots) and for FoX
``cum_forget [B, S, H]`` with ``forget_last [B, H]`` (fp32). The token at position p lives in slot
``p % S``: with a window the buffers are a ring of S = ``window`` slots (fewer when a static
cache's capacity is smaller), without one S covers every position: a static state's ``capacity``,
or a dynamic state's buffers that grow by whole blocks of :data:`GROW_SLOTS`. A call writes its
keys in place (:func:`update_kv_cache`); ``cache.seen_tokens`` counts every token of every
call (padding included): the position of the next token. FoX's cumulative forget values are carried:
a call continues from ``forget_last``, and since any offset common to a row cancels in the softmax,
the buffers are re-based on the newest token (:func:`rebase_forget`) every :data:`REBASE_EVERY`
tokens only, which keeps the values of recent keys small however long decoding runs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops import parallel
from ..ops.attention import cached_attention, cumulative_forget, forgetting_attention
from ..ops.fused import gated_rms_norm
from ..ops.varlen import positions_in_sequence
from .base import LayerState, Mixer, MixerArgs, check_cache_and_varlen, register_mixer
from .norms import RMSNorm
from .rotary import RotaryEmbedding

#: FoX's data-independent and fixed gates: decay times (tokens) of the first and the last head at init
DECAY_TIME_RANGE = (2.0, 128.0)


def decay_time_logits(num_heads: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """[H] gate logits b_h with -1 / log(sigmoid(b_h)) = t_h, t_h log-spaced over :data:`DECAY_TIME_RANGE`."""
    low, high = (math.log(t) for t in DECAY_TIME_RANGE)
    times = torch.exp(torch.linspace(low, high, num_heads, device=device))
    return -torch.log(torch.expm1(1.0 / times))


def previous_real_token(
    x: torch.Tensor,
    token_mask: Optional[torch.Tensor],
    *,
    history: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token, the features of the closest earlier real (unpadded) token.

    Args:
        x: ``[B, T, C]``.
        token_mask: ``[B, T]`` bool, False at padding (skipped), or None.
        history: ``[B, 1, C]`` the last real token of the previous call (zeros when None).
        cu_seqlens: ``[N + 1]``; at a sequence start the previous token is zeros, except that the first
            sequence continues ``history`` (under sequence parallelism it began on an earlier rank).

    Returns:
        ``(previous [B, T, C], newest [B, 1, C])``: newest is the last real token of
        ``x``, or ``history`` when the call has none (the next call's history).

    Example:
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1)
        >>> prev, last = previous_real_token(x, torch.tensor([[True, False, True, False]]))
        >>> prev.flatten().tolist(), last.flatten().tolist()
        ([0.0, 1.0, 1.0, 3.0], [3.0])
    """
    B, T, C = x.shape
    start = history if history is not None else x.new_zeros(B, 1, C)
    timeline = torch.cat([start.to(x.dtype), x], dim=1)  # [B, T + 1, C]; index 0 = before the call
    real = torch.ones(B, T + 1, dtype=torch.bool, device=x.device)
    if token_mask is not None:
        real[:, 1:] = token_mask
    index = torch.arange(T + 1, device=x.device).expand(B, -1)
    newest = torch.where(real, index, 0).cummax(dim=1).values  # [B, T + 1] newest real index so far
    before = newest[:, :-1]  # token t (timeline index t + 1) looks at timeline indices <= t
    if cu_seqlens is not None:  # timeline index of each token's sequence start
        first = 1 + torch.arange(T, device=x.device) - positions_in_sequence(T, cu_seqlens, x.device)
        # before a sequence start: zeros (index T + 1), but the first sequence continues `history`
        before = torch.where(before >= first, before, torch.where(first > 1, T + 1, 0))
        timeline = torch.cat([timeline, timeline.new_zeros(B, 1, C)], dim=1)
    gather = lambda idx: timeline.gather(1, idx[..., None].expand(-1, -1, C))  # noqa: E731
    return gather(before), gather(newest[:, -1:])


#: FoX: the cached cumulative forget values are re-based on the newest token every this many tokens
REBASE_EVERY = 1024
#: a dynamic KV cache grows by whole blocks of this many slots
GROW_SLOTS = 256


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _slots(cache: LayerState, window: Optional[int], needed: int) -> int:
    """How many slots the layer's buffers need for ``needed`` tokens (a ring of ``window`` slots with a window)."""
    if cache.static:
        if needed > cache.capacity:
            raise ValueError(f"the static cache holds {cache.capacity} tokens per row; this call would make it "
                             f"{needed}: build it with a larger `max_cache_len`")
        return cache.capacity if window is None else min(window, cache.capacity)
    return window if window is not None else _round_up(needed, GROW_SLOTS)


def _ensure_buffers(cache: LayerState, new: dict[str, torch.Tensor], window: Optional[int]) -> int:
    """Allocate the buffers (zeros: no key anywhere) or grow a dynamic cache's, so the call's tokens fit;
    returns the slots S. ``new`` gives each entry's shape (with T tokens) and dtype."""
    n, T = cache.seen_tokens, new["k"].shape[1]
    S = _slots(cache, window, n + T)
    current = cache.get("k")
    if current is not None and current.shape[1] >= S:
        return current.shape[1]
    for name, x in new.items():
        buffer = x.new_zeros(x.shape[0], S, *x.shape[2:])
        if current is not None:  # a dynamic cache without a window grows: keep its n tokens
            buffer[:, :n] = cache.get(name)[:, :n]
        cache.tensors[name] = buffer
    if "cum_forget" in new and "forget_last" not in cache:
        cache.set("forget_last", new["cum_forget"].new_zeros(new["cum_forget"].shape[0], new["cum_forget"].shape[2]))
    return S


def _write(cache: LayerState, new: dict[str, torch.Tensor], first: int | torch.Tensor, S: int) -> None:
    """Write the call's entries in place, token at position p into slot p % S (the last S of them when
    there are more). ``first``: the position of the call's first token, a host int or a device tensor [1]."""
    T = new["k"].shape[1]
    keep = min(T, S)
    start = first + (T - keep)
    if isinstance(start, int) and start % S + keep <= S:  # contiguous slots
        at = start % S
        for name, x in new.items():
            cache.get(name)[:, at:at + keep] = x[:, T - keep:]
        return
    index = (torch.arange(keep, device=new["k"].device) + start) % S
    for name, x in new.items():
        buffer = cache.get(name)
        buffer.index_copy_(1, index, x[:, T - keep:].to(buffer.dtype))


def _time_ordered(buffer: torch.Tensor, n: int, S: int) -> torch.Tensor:
    """The cached entries of the last min(n, S) positions, oldest first."""
    return buffer[:, :n] if n <= S else buffer.roll(-(n % S), dims=1)


def rebase_forget(cache: LayerState) -> None:
    """Subtract the newest token's cumulative forget value from every cached one (FoX; nothing otherwise).
    Each row's keys move by the same offset, which the softmax cancels."""
    last = cache.get("forget_last")
    if last is not None:
        cache.get("cum_forget").sub_(last[:, None])
        last.zero_()


def update_kv_cache(
    cache: LayerState, new: dict[str, torch.Tensor], window: Optional[int]
) -> tuple[dict[str, torch.Tensor], Optional[int]]:
    """Write the call's keys into the cache's buffers (a ring of ``window`` slots with a window); the keys
    to attend over and the window to apply.

    ``new`` holds the call's ``k``, ``v``, ``key_mask`` and (FoX) ``cum_forget`` counted from the
    call's first token (``[B, T, ...]``). One token (a decoding step) is written at the device
    position of a static cache and reads the whole buffers, contiguous and of a fixed size, so the
    step can be replayed from a CUDA graph: empty slots are masked, and a ring in slot order needs
    no window, as every key it holds is inside it. A longer call reads the first ``n + T`` slots,
    or, when it wraps the ring, the ring in time order followed by its own keys.
    """
    n, T = cache.seen_tokens, new["k"].shape[1]
    S = _ensure_buffers(cache, new, window)
    if "cum_forget" in new:  # continue the row's cumulative forget sum
        last = cache.get("forget_last")
        new = {**new, "cum_forget": last[:, None] + new["cum_forget"]}
        last.copy_(new["cum_forget"][:, -1])
    if T == 1:
        _write(cache, new, cache.position if cache.static else n, S)
        return {name: cache.get(name) for name in new}, None
    if n + T <= S:
        _write(cache, new, n, S)
        return {name: cache.get(name)[:, :n + T] for name in new}, window
    keys = {name: torch.cat([_time_ordered(cache.get(name), n, S).to(x.dtype), x], 1) for name, x in new.items()}
    _write(cache, new, n, S)
    return keys, window


def attend_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_forget: Optional[torch.Tensor],
    *,
    window: Optional[int],
    cache: Optional[LayerState],
    token_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    prune_tolerance: Optional[float] = None,
) -> torch.Tensor:
    """The attention of a call's queries q [B, T, H, K] over the cached and its new keys k, v
    [B, T, Hkv, K or V], with FoX's log forget gates [B, T, H] fp32 or None: o [B, T, H, V].

    A call whose keys are all its own and all present (no cache or an empty one, no padding) is plain
    causal attention (:func:`forgetting_attention`, flash kernels or SDPA at any length, pruned with
    ``prune_tolerance``, see there); otherwise
    the keys carry a mask and FoX's cumulative forget values into :func:`cached_attention`, and the
    cache's buffers grow or are a ring of ``window`` slots (:func:`update_kv_cache`).
    """
    fresh = token_mask is None and (cache is None or cache.seen_tokens == 0)
    if cache is None and fresh:
        return forgetting_attention(q, k, v, log_forget=log_forget, window=window, cu_seqlens=cu_seqlens,
                                    prune_tolerance=prune_tolerance)
    B, T = q.shape[:2]
    present = token_mask if token_mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    keys = {"k": k, "v": v, "key_mask": present}
    if log_forget is not None:  # padded tokens do not forget
        gates = log_forget if token_mask is None else log_forget * present[..., None]
        keys["cum_forget"] = cumulative_forget(gates, cu_seqlens=cu_seqlens)
    read_window = window
    if cache is not None:
        n = cache.seen_tokens
        keys, read_window = update_kv_cache(cache, keys, window)
    if fresh:
        o = forgetting_attention(q, k, v, log_forget=log_forget, window=window, prune_tolerance=prune_tolerance)
    else:
        o = cached_attention(q, keys["k"], keys["v"], key_mask=keys["key_mask"], cum_forget=keys.get("cum_forget"),
                             window=read_window, cu_seqlens=cu_seqlens)
    if cache is not None and not cache.static and "cum_forget" in keys and \
            (n + T) // REBASE_EVERY > n // REBASE_EVERY:
        rebase_forget(cache)  # a static cache re-bases in its host-side step (outside any graph)
    return o


def default_positions(
    hidden: torch.Tensor, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
) -> torch.Tensor:
    """[B, T] positions of hidden [B, T, D]: tokens seen before the call + the index in the call (per sequence)."""
    B, T = hidden.shape[:2]
    seen = cache.seen_tokens if cache is not None else 0
    return (seen + positions_in_sequence(T, cu_seqlens, hidden.device)).expand(B, T)


class _Attention(Mixer):
    """Causal softmax attention with q/k/v/o projections (no bias), GQA, an optional window and the
    "Pro" options; subclasses choose the forget gate and whether RoPE is on by default."""

    kind = "attention"
    #: rotate q, k by position unless ``MixerArgs.rope`` says otherwise (softmax, swa)
    rope_by_default: bool = True
    #: has a forget gate (fox)
    forgets: bool = False

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        Hkv = args.num_kv_heads if args.num_kv_heads is not None else H
        self.num_kv_heads = Hkv
        self.window = args.window
        self.rotary = args.rope if args.rope is not None else self.rope_by_default
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, Hkv * K, bias=False)
        self.v_proj = nn.Linear(D, Hkv * V, bias=False)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        if self.rotary:
            self.rope = RotaryEmbedding(K, theta=args.rope_theta)
        if args.qk_norm:
            self.q_norm = RMSNorm(K, eps=args.norm_eps, num_heads=H)
            self.k_norm = RMSNorm(K, eps=args.norm_eps, num_heads=Hkv)
        if args.kv_shift:
            self.k_shift_proj = nn.Linear(D, Hkv, bias=False)
            self.v_shift_proj = nn.Linear(D, Hkv, bias=False)
        if args.output_norm:
            self.o_norm = RMSNorm(V, eps=args.norm_eps, num_heads=H)
        if args.output_gate:
            self.g_proj = nn.Linear(D, H * V, bias=False)

    @classmethod
    def validate_args(cls, args: MixerArgs) -> None:
        super().validate_args(args)
        if args.forget_gate != "data_dependent" and not cls.forgets:
            raise ValueError(f"{cls.name}: has no forget gate, so `forget_gate` = {args.forget_gate!r} would be "
                             f"ignored; forget gates belong to fox")
        if args.prune_tolerance is not None and not cls.forgets:
            raise ValueError(f"{cls.name}: has no forget gate, so `prune_tolerance` = {args.prune_tolerance} would "
                             f"prune nothing; pruning belongs to fox")

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
        q, k, v = self.project(hidden, cache=cache, token_mask=token_mask, position_ids=position_ids,
                               cu_seqlens=cu_seqlens)
        o = self.attend(q, k, v, self.log_forget(hidden), cache=cache, token_mask=token_mask,
                        cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.seen_tokens += hidden.shape[1]
        return self.output(o, hidden)

    def project(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        token_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        cu_seqlens: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [B, T, D] -> q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V]."""
        K, V = self.args.key_dim, self.args.value_dim
        k, v = self.k_proj(hidden), self.v_proj(hidden)
        if self.args.kv_shift:
            shift = dict(cache=cache, token_mask=token_mask, cu_seqlens=cu_seqlens)
            k = self.shift(k, self.k_shift_proj(hidden), "shift_k", **shift)
            v = self.shift(v, self.v_shift_proj(hidden), "shift_v", **shift)
        q, k = (rearrange(x, "b t (h d) -> b t h d", d=K) for x in (self.q_proj(hidden), k))
        v = rearrange(v, "b t (h d) -> b t h d", d=V)
        if self.args.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            if position_ids is None:
                position_ids = default_positions(hidden, cache, cu_seqlens)
            q, k = self.rope.pair(q, k, position_ids)
        return q, k, v

    def log_forget(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """[B, T, H] fp32 log forget gates, or None (no forget gate)."""
        return None

    def shift(
        self,
        x: torch.Tensor,
        gate_logit: torch.Tensor,
        key: str,
        *,
        cache: Optional[LayerState],
        token_mask: Optional[torch.Tensor],
        cu_seqlens: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """KV-shift: x [B, T, Hkv * d], gate_logit [B, T, Hkv] -> a x_{t-1} + (1 - a) x_t.

        x_{t-1} is the previous real token of the same sequence (``cache[key]`` across calls).
        """
        history = cache.get(key) if cache is not None else None
        if cache is None and (handler := parallel.sequence_handler()) is not None:  # the previous rank's last token
            history = handler.halo(x, 1, cu_seqlens)
        previous, newest = previous_real_token(x, token_mask, history=history, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.set(key, newest.detach())
        a = torch.sigmoid(gate_logit.float())[..., None]  # [B, T, Hkv, 1]
        split = lambda t: rearrange(t.float(), "b t (h d) -> b t h d", h=gate_logit.shape[-1])  # noqa: E731
        mixed = a * split(previous) + (1 - a) * split(x)
        return rearrange(mixed, "b t h d -> b t (h d)").to(x.dtype)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_forget: Optional[torch.Tensor],
        *,
        cache: Optional[LayerState],
        token_mask: Optional[torch.Tensor],
        cu_seqlens: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """:func:`attend_with_cache` with this layer's window: o [B, T, H, V]."""
        return attend_with_cache(q, k, v, log_forget, window=self.window, cache=cache, token_mask=token_mask,
                                 cu_seqlens=cu_seqlens, prune_tolerance=self.args.prune_tolerance)

    def output(self, o: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, V] -> [B, T, D]."""
        gate = None
        if self.args.output_gate:
            gate = rearrange(self.g_proj(hidden), "b t (h d) -> b t h d", d=self.args.value_dim)
        if self.args.output_norm and gate is not None:  # one fused pass: RMSNorm(o) * sigmoid(gate)
            o = gated_rms_norm(o, gate, self.o_norm.weight, self.o_norm.eps, activation="sigmoid")
        elif self.args.output_norm:
            o = self.o_norm(o)
        elif gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))


@register_mixer("softmax")
class SoftmaxAttention(_Attention):
    """Causal multi-head (or grouped-query) softmax attention with RoPE; a growing KV cache, or a ring
    of ``window`` slots when ``window`` is set."""


@register_mixer("swa")
class SlidingWindowAttention(_Attention):
    """Sliding-window attention with RoPE: query i sees keys i - window < j <= i; its KV cache
    is a ring of ``window`` slots."""

    @classmethod
    def validate_args(cls, args: MixerArgs) -> None:
        super().validate_args(args)
        if args.window is None:
            raise ValueError("swa: `window` must be set (an integer >= 1, the number of keys a query sees)")


@register_mixer("fox")
class ForgettingAttention(_Attention):
    """Forgetting Transformer: softmax attention biased by cumulative log forget gates, no RoPE by default."""

    rope_by_default = False
    forgets = True

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        H = args.num_heads
        if args.forget_gate == "data_dependent":
            self.f_proj = nn.Linear(args.hidden_size, H, bias=True)
        elif args.forget_gate == "data_independent":
            self.f_bias = nn.Parameter(torch.empty(H))
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.args.forget_gate == "data_independent":
            self.f_bias.copy_(decay_time_logits(self.args.num_heads, self.f_bias.device))

    def log_forget(self, hidden: torch.Tensor) -> torch.Tensor:
        B, T = hidden.shape[:2]
        gate = self.args.forget_gate
        if gate == "data_dependent":
            logits = self.f_proj(hidden).float()  # [B, T, H]
        else:
            bias = self.f_bias if gate == "data_independent" else \
                decay_time_logits(self.args.num_heads, hidden.device)[self.heads]
            logits = bias.float().expand(B, T, -1)
        return F.logsigmoid(logits)
