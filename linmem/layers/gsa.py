"""Gated Slot Attention (Zhang et al. 2024, "Gated Slot Attention for Efficient Linear-Time Sequence
Modeling", arXiv 2409.07146): two gated recurrences with a softmax over M memory slots between them.

Per head, with the slot gate alpha_t in (0, 1)^M and the write strength s_t = 1 - alpha_t::

    K~_t = K~_{t-1} diag(alpha_t) + k_t^T s_t            [K, M]   slot keys (decay over the slots)
    V~_t = diag(alpha_t) V~_{t-1} + s_t^T v_t            [M, V]   slot values
    o_t  = softmax(scale * q_t K~_t) V~_t                          read: attend over the M slots

Both are the unified recurrence (:func:`linmem.ops.linear_recurrence`): the first writes s_t as its
"value" with a decay that acts on the value (slot) axis, which makes each slot a recurrence of its
own with a scalar decay (the slots run as heads); the second reads with the slot weights as its
query and decays its key (slot) axis. Because every
slot forgets exactly what it is written (alpha + s = 1), each slot holds a weighted average of
keys and values, and the slot scores keep the scale of the attention logits q . k.

The mixer (as flash-linear-attention's ``gsa`` layer)::

    q, k = swish(W_q x), swish(W_k x);  v = silu(W_v x);  log alpha_t = logsigmoid(W_f x) / 8
    y = W_o RMSNorm(silu(o))                              (the norm over all heads' outputs together)

with scale 1, GQA (``num_kv_heads``: k, v and the gate per KV head), an optional short convolution
on q, k, v (off by default) and ``num_slots`` slots per head (default: the head dim). Every linear
map starts xavier-uniform with gain 2^-2.5, as GLA's. GSA cannot be a rule of a mixture of
memories: its read-out is a softmax of one memory, so mixed memories are not a mixed read-out.

Decoding cache: ``slot_keys [B, H, K, M]`` and ``recurrent [B, H, M, V]`` (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from ..ops import linear_recurrence, linear_recurrence_step
from .base import LayerState, Mixer, MixerArgs, check_cache_and_varlen, check_int, register_mixer
from .modules import Linear, RMSNorm, ShortConvs, xavier_init
from .recurrent import activation_dtype

#: GSA divides its log-sigmoid slot gate by this (decays start close to 1)
GATE_LOGIT_NORMALIZER = 8
#: gain of the xavier-uniform init of every linear map (as GLA's)
XAVIER_GAIN = 2 ** -2.5


def _check_gsa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                      time_axis: bool) -> None:
    rank = 4 if time_axis else 3
    lead = "[B, T, H, " if time_axis else "[B, H, "
    for name, x in (("q", q), ("k", k), ("v", v), ("log_decay", log_decay)):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            raise ValueError(f"gated_slot_attention: `{name}` must be a {rank}-D tensor {lead}...], "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    if q.shape != k.shape:
        raise ValueError(f"gated_slot_attention: `k` must have the shape of `q` {list(q.shape)}, got {list(k.shape)}")
    if v.shape[:-1] != q.shape[:-1] or log_decay.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"gated_slot_attention: `v` and `log_decay` must be {lead}D] with the leading axes of `q` "
                         f"{list(q.shape[:-1])}, got {list(v.shape)} and {list(log_decay.shape)}")


def gated_slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """Gated slot attention (see the module docstring) as two calls of the unified recurrence.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, one floating dtype.
        log_decay: ``[B, T, H, M]`` log slot gates log alpha (<= 0), fp32 recommended; a token whose
            log gate is 0 everywhere leaves both states untouched (s = 0), which is how padding is masked.
        scale: slot-score scale, default ``K ** -0.5``.
        initial_state: ``(slot_keys [N, H, K, M], slot_values [N, H, M, V])`` or None.
        output_final_state: also return the final ``(slot_keys, slot_values)`` (fp32).
        cu_seqlens: ``[N + 1]`` boundaries of N packed sequences (B == 1).
        backend: the backend of :func:`linmem.ops.linear_recurrence`.

    Returns:
        ``(o [B, T, H, V], final_state or None)``.

    Example:
        >>> q, k, v = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(2, 9, 2, 4))
        >>> o, (keys, values) = gated_slot_attention(q, k, v, g, output_final_state=True)
        >>> o.shape, keys.shape, values.shape
        (torch.Size([2, 9, 2, 8]), torch.Size([2, 2, 8, 4]), torch.Size([2, 2, 4, 8]))
    """
    _check_gsa_inputs(q, k, v, log_decay, time_axis=True)
    M = log_decay.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)  # gates and slot scores: fp32 (fp64 for fp64 inputs)
    log_decay = log_decay.to(acc)
    write = -torch.expm1(log_decay)  # s = 1 - alpha  [B, T, H, M]
    keys0, values0 = initial_state if initial_state is not None else (None, None)
    # The slot keys decay along their value (slot) axis: each slot m is a recurrence of its own with a
    # scalar decay and a one-dimensional value s[m], so the M slots become M heads per head.
    slots = lambda x: repeat(x, "b t h d -> b t (h m) d", m=M)  # noqa: E731
    if keys0 is not None:
        keys0 = rearrange(keys0, "n h k m -> n (h m) k")[..., None]
    scores, keys = linear_recurrence(slots(q), slots(k), rearrange(write.to(q.dtype), "b t h m -> b t (h m)")[..., None],
                                     log_decay=rearrange(log_decay, "b t h m -> b t (h m)"), scale=scale,
                                     initial_state=keys0, output_final_state=output_final_state,
                                     cu_seqlens=cu_seqlens, backend=backend)
    scores = rearrange(scores, "b t (h m) 1 -> b t h m", m=M)
    if keys is not None:
        keys = rearrange(keys[..., 0], "n (h m) k -> n h k m", m=M)
    weights = torch.softmax(scores.to(acc), dim=-1).to(v.dtype)
    o, values = linear_recurrence(weights, write.to(v.dtype), v, log_decay=log_decay, scale=1.0,
                                  initial_state=values0, output_final_state=output_final_state,
                                  cu_seqlens=cu_seqlens, backend=backend)
    return o, ((keys, values) if output_final_state else None)


def gated_slot_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    *,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding step of :func:`gated_slot_attention`: q, k ``[B, H, K]``, v ``[B, H, V]``, log_decay
    ``[B, H, M]``, state ``(slot_keys [B, H, K, M], slot_values [B, H, M, V])`` -> ``(o [B, H, V], state)``.

    Example:
        >>> state = (torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 4, 8))
        >>> o, state = gated_slot_attention_step(torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8),
        ...                                      torch.full((1, 2, 4), -0.1), state)
        >>> o.shape
        torch.Size([1, 2, 8])
    """
    _check_gsa_inputs(q, k, v, log_decay, time_axis=False)
    acc = torch.promote_types(q.dtype, torch.float32)
    log_decay = log_decay.to(acc)
    write = -torch.expm1(log_decay)
    keys, values = state
    slot_decay = log_decay[:, :, None, :].expand(*q.shape, log_decay.shape[-1])  # [B, H, K, M]
    scores, keys = linear_recurrence_step(q, k, write.to(q.dtype), keys, log_decay=slot_decay, scale=scale)
    weights = torch.softmax(scores.to(acc), dim=-1).to(v.dtype)
    o, values = linear_recurrence_step(weights, write.to(v.dtype), v, values, log_decay=log_decay, scale=1.0)
    return o, (keys, values)


def slot_attention_with_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    scale: Optional[float],
    cache: Optional[LayerState],
    token_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    """:func:`gated_slot_attention` of a layer: padded tokens (``token_mask`` False) neither decay nor
    write, and the states continue from / go back to ``cache["slot_keys"]``, ``cache["recurrent"]``.
    Shapes as :func:`gated_slot_attention`; returns ``o [B, T, H, V]``."""
    if token_mask is not None:
        log_decay = log_decay * token_mask[:, :, None, None].to(log_decay.dtype)
    state = (cache.get("slot_keys"), cache.get("recurrent")) if cache is not None and "recurrent" in cache else None
    if state is not None and q.shape[1] == 1 and not torch.is_grad_enabled():
        o, state = gated_slot_attention_step(q[:, 0], k[:, 0], v[:, 0], log_decay[:, 0], state, scale=scale)
        o = o[:, None]
    else:
        o, state = gated_slot_attention(q, k, v, log_decay, scale=scale, initial_state=state,
                                        output_final_state=cache is not None, cu_seqlens=cu_seqlens, backend=backend)
    if cache is not None:
        cache.set("slot_keys", state[0])
        cache.set("recurrent", state[1])
    return o


@dataclass
class GSAArgs(MixerArgs):
    """:class:`MixerArgs` plus the number of slots."""

    num_slots: Optional[int] = None  # memory slots M per head; default the head dim

    @classmethod
    def of(cls, args: MixerArgs) -> "GSAArgs":
        """``args`` itself if it is GSAArgs, else its MixerArgs fields with the default slots."""
        if isinstance(args, GSAArgs):
            return args
        return cls(**{name: getattr(args, name) for name in MixerArgs.field_names()})

    @property
    def slots(self) -> int:
        return self.num_slots if self.num_slots is not None else self.key_dim

    def validate(self, owner: str = "gsa") -> None:
        super().validate(owner)
        self.validate_options(owner)

    def validate_options(self, owner: str = "gsa") -> None:
        """Check the slots only (the field :class:`MixerArgs` lacks)."""
        check_int(owner, "num_slots", self.num_slots, minimum=1, optional=True)


@register_mixer("gsa")
class GatedSlotAttention(Mixer):
    """GSA with its own projections: hidden ``[B, T, D]`` -> ``[B, T, D]`` (see the module docstring).

    Example:
        >>> from linmem.layers import build_mixer
        >>> gsa = build_mixer("gsa", GSAArgs(hidden_size=32, num_heads=2, num_slots=8))
        >>> gsa(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    kind = "memory"
    args_class = GSAArgs

    def __init__(self, args: MixerArgs) -> None:
        args = GSAArgs.of(args)
        super().__init__(args)
        D, H, K, V, M = args.hidden_size, args.num_heads, args.key_dim, args.value_dim, args.slots
        Hkv = args.num_kv_heads if args.num_kv_heads is not None else H
        self.num_kv_heads = Hkv
        init = xavier_init(XAVIER_GAIN)
        self.q_proj = Linear(D, H * K, init=init)
        self.k_proj = Linear(D, Hkv * K, init=init)
        self.v_proj = Linear(D, Hkv * V, init=init)
        self.f_proj = Linear(D, Hkv * M, init=init)
        self.convs = ShortConvs({"q": H * K, "k": Hkv * K, "v": Hkv * V}, args)
        self.o_norm = RMSNorm(H * V, eps=args.norm_eps)
        self.o_proj = Linear(H * V, D, init=init)

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
        H, Hkv = self.args.num_heads, self.num_kv_heads
        conv = dict(cache=cache, cu_seqlens=cu_seqlens)
        q = self.convs("q", self.q_proj(hidden), **conv)
        k = self.convs("k", self.k_proj(hidden), **conv)
        v = self.convs("v", self.v_proj(hidden), **conv)
        q = rearrange(q, "b t (h d) -> b t h d", h=H)
        k, v, f = (rearrange(x, "b t (h d) -> b t h d", h=Hkv) for x in (k, v, self.f_proj(hidden)))
        q, k = q * torch.sigmoid(q), k * torch.sigmoid(k)  # swish feature map
        v = F.silu(v)
        log_decay = F.logsigmoid(f.float()) / GATE_LOGIT_NORMALIZER  # [B, T, Hkv, M]
        if Hkv != H:
            k, v, log_decay = (repeat(x, "b t h d -> b t (h g) d", g=H // Hkv) for x in (k, v, log_decay))
        dtype = activation_dtype(hidden)
        o = slot_attention_with_cache(q.to(dtype), k.to(dtype), v.to(dtype), log_decay, scale=1.0, cache=cache,
                                      token_mask=token_mask, cu_seqlens=cu_seqlens, backend=self.args.backend)
        return self.o_proj(self.o_norm(F.silu(rearrange(o, "b t h d -> b t (h d)"))))
