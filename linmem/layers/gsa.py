"""Gated Slot Attention (Zhang et al. 2024, arXiv 2409.07146) as a mixer: the maths, two gated recurrences with a
softmax over M memory slots between them, is :func:`linmem.ops.gsa.gated_slot_attention`.

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

from ..ops.gsa import gated_slot_attention, gated_slot_attention_step
from .base import LayerState, Mixer, MixerArgs, check_cache_and_varlen, check_int, register_mixer
from .conv import ShortConvs
from .init import Linear, xavier_init
from .norms import RMSNorm
from .recurrent import activation_dtype

#: GSA divides its log-sigmoid slot gate by this (decays start close to 1)
GATE_LOGIT_NORMALIZER = 8
#: gain of the xavier-uniform init of every linear map (as GLA's)
XAVIER_GAIN = 2 ** -2.5


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
        a = self.args
        conv = dict(cache=cache, cu_seqlens=cu_seqlens)
        q = self.convs("q", self.q_proj(hidden), **conv)
        k = self.convs("k", self.k_proj(hidden), **conv)
        v = self.convs("v", self.v_proj(hidden), **conv)
        q, k = (rearrange(x, "b t (h d) -> b t h d", d=a.key_dim) for x in (q, k))
        v = rearrange(v, "b t (h d) -> b t h d", d=a.value_dim)
        f = rearrange(self.f_proj(hidden), "b t (h d) -> b t h d", d=a.slots)
        H, Hkv = q.shape[2], k.shape[2]  # all heads, or a tensor-parallel share
        q, k = q * torch.sigmoid(q), k * torch.sigmoid(k)  # swish feature map
        v = F.silu(v)
        log_decay = F.logsigmoid(f.float()) / GATE_LOGIT_NORMALIZER  # [B, T, Hkv, M]
        if Hkv != H:
            k, v, log_decay = (repeat(x, "b t h d -> b t (h g) d", g=H // Hkv) for x in (k, v, log_decay))
        dtype = activation_dtype(hidden)
        o = slot_attention_with_cache(q.to(dtype), k.to(dtype), v.to(dtype), log_decay, scale=1.0, cache=cache,
                                      token_mask=token_mask, cu_seqlens=cu_seqlens, backend=self.args.backend)
        return self.o_proj(self.o_norm(F.silu(rearrange(o, "b t h d -> b t (h d)"))))
