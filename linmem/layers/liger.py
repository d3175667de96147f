"""Liger Attention (Lan et al. 2025, "Liger: Linearizing Large Language Models to Gated Recurrent
Structures", arXiv 2503.01496) and the softmax attention of the pretrained models it converts.

``llama_attention`` is softmax attention laid out as Llama, Mistral, Qwen2 and Qwen3 lay it out:
q/k/v/o projections (q, k, v with biases for Qwen2, o with one for Llama's ``attention_bias``),
GQA, Qwen3's RMSNorm of q and k over the head dim with one weight shared by the heads
(``qk_norm``), RoPE with the checkpoint's frequency scaling (``rope_scaling_params``; ``rope=False``
leaves q and k unrotated, as the NoPE layers of some checkpoints), and an optional ``window`` (Mistral's
sliding window).

``liger`` turns those same projections into Liger Attention, with no parameter of its own::

    q, k, v = the projections of llama_attention (before RoPE)
    memory:  S_t = diag(alpha_t) S_{t-1} + phi(k_t)^T v_t,      o^mem_t = phi(q_t) S_t      (scale 1)
    window:  o^swa_t = sum_{t - W < j <= t} softmax_j(RoPE(q_t) . RoPE(k_j) / sqrt(d)) v_j
    y_t = W_o (w o^mem_t + (1 - w) o^swa_t)

with ``w = liger_memory_weight`` (0.5: the paper's equal weights) and ``W = liger_window`` (64). As in
Liger's code, the recurrence reads q and k before RoPE, the window after it; keys and values of a KV
head serve every query head of its group. phi is the softmax over the head dim
(``liger_feature_map="softmax"``). The gate alpha_t is pooled from the key (Liger Table 1): ``P_n(k)``
averages each KV head's key over n groups of consecutive channels (n = K: the key itself)::

    liger_memory      decay alpha_t (log, fp32)                        pooled to      key written
    gla               logsigmoid(P_K(k)) / 16                          per channel    phi(k)
    mamba2            -softplus(P_1(k))                                per head       phi(k)
    hgrn2             log(gamma + (1 - gamma) sigmoid(P_K(k)))         per channel    1 - alpha_t
    rwkv6             -exp(P_K(k))                                     per channel    phi(k)
    gated_retention   logsigmoid(P_1(k)) / 16                          per head       phi(k)
    mlstm             logsigmoid(P_1(k))                               per head       i_t phi(k), i_t = exp(P_1(k))
    gsa               logsigmoid(P_M(k)) / 16 over M slots             per slot       gated slot attention

mLSTM (xLSTM, Beck et al. 2024) has a sigmoid forget gate and an exponential input gate, each a
projection of the input; here both read the one pooled key g = P_1(k), as Liger's other gates do, so
f_t = sigmoid(g) and i_t = exp(g) = f_t / (1 - f_t). xLSTM's normaliser state and max-stabiliser are
left out (Liger's read-out has no normaliser); in their place i_t is capped at exp(g) <= 20 (the cap of
``rwkv6``'s exp), so the write stays finite whatever the pretrained keys hold.

``gate_logit_normalizer`` = 16 (:data:`GATE_LOGIT_NORMALIZER`) is the one of GLA, fla and Liger's code:
alpha = sigmoid(g)^(1/16), so decays sit near 1. For ``gla`` the gate and phi read the same key channel:
phi(k) = softmax(k) writes where k is large, where alpha ~ 1, so right after conversion the state forgets
little of what it holds and the memory read-out grows with position (docs/liger.md).
HGRN-2's lower bound gamma has no parameter here: it grows with depth, gamma = layer_idx / num_layers
(Liger's code uses 0 in every layer). GSA
(:mod:`linmem.layers.gsa`) reads q and k without phi, with the attention scale K^-0.5 on its slot
scores (a slot score is then a weighted average of attention logits). A log decay below
:data:`MIN_LOG_DECAY` is clamped to it: the state keeps at most e^-20 of itself, and the cumulative
sums of the recurrence keep their precision whatever the pretrained keys hold.

The ablations of Liger Table 6 are options: ``liger_gate="projection"`` takes the gate from a new,
randomly initialised linear map of the input instead of the pooled key; ``liger_feature_map=
"learnable"`` makes phi(x) = softmax(x W_h) with a per-head matrix W_h starting at the identity;
``liger_memory_weight=1`` drops the window branch (0 drops the memory). A branch of weight 0 is not
computed and keeps no cache.

Decoding cache: the memory's state ``recurrent [B, H, K, V]`` (GSA: ``slot_keys [B, H, K, M]`` and
``recurrent [B, H, M, V]``), and the window's KV ring (``k``, ``v``, ``key_mask``, W slots) as the
attention layers keep it (:func:`linmem.layers.attention.update_kv_cache`); ``llama_attention`` keeps a
growing KV cache, or a ring of ``window`` slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from .attention import attend_with_cache, default_positions
from .base import (
    LayerState,
    Mixer,
    MixerArgs,
    check_bool,
    check_cache_and_varlen,
    check_choice,
    check_float,
    check_int,
    register_mixer,
)
from .gsa import slot_attention_with_cache
from .init import Linear
from .norms import RMSNorm
from .recurrent import RecurrenceArgs, activation_dtype, memory_with_cache, run_recurrence, step_recurrence
from .rotary import RotaryEmbedding

#: the gated recurrences Liger Attention can build from a pretrained key (``liger_memory``)
LIGER_MEMORIES = ("gla", "mamba2", "hgrn2", "rwkv6", "gated_retention", "mlstm", "gsa")
#: where the gate comes from (``liger_gate``): the pooled key, or a new random projection (Table 6 ablation)
LIGER_GATES = ("pooled_key", "projection")
#: phi of q and k in the recurrence (``liger_feature_map``)
LIGER_FEATURE_MAPS = ("softmax", "learnable")
#: gate_logit_normalizer of GLA, fla and Liger's code: log alpha = logsigmoid(g) / 16 (GLA, gated retention, GSA)
GATE_LOGIT_NORMALIZER = 16
#: lower clamp of every Liger log decay
MIN_LOG_DECAY = -20.0
#: RoPE frequency scalings ``rope_scaling_params`` accepts, with the keys each needs
ROPE_SCALINGS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
#: the attention "Pro" options the pretrained layout has no place for (llama_attention refuses them)
_PRO_OPTIONS = ("output_gate", "output_norm", "kv_shift")


# ---------------------------------------------------------------- the RoPE scaling of a pretrained model


def check_rope_scaling(owner: str, params: Optional[dict]) -> None:
    """Refuse a RoPE scaling other than :data:`ROPE_SCALINGS` or one that lacks (or mistypes) a key."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"{owner}: `rope_scaling_params` must be a dict or None, got {params!r}")
    kind = params.get("rope_type", "default")
    check_choice(owner, "rope_scaling_params['rope_type']", kind, tuple(ROPE_SCALINGS))
    for key in ROPE_SCALINGS[kind]:
        check_float(owner, f"rope_scaling_params[{key!r}]", params.get(key), minimum=0.0)
    if kind == "llama3" and params["low_freq_factor"] >= params["high_freq_factor"]:
        raise ValueError(f"{owner}: llama3 RoPE scaling needs low_freq_factor < high_freq_factor, got "
                         f"{params['low_freq_factor']} and {params['high_freq_factor']}")


# ---------------------------------------------------------------- arguments


def _args_of(cls: type, args: MixerArgs) -> Any:
    """``args`` if it is a ``cls``, else a ``cls`` with the fields ``args`` has and defaults for the rest."""
    if isinstance(args, cls):
        return args
    names = {f.name for f in fields(cls)}
    return cls(**{f.name: getattr(args, f.name) for f in fields(args) if f.name in names})


@dataclass
class PretrainedAttentionArgs(MixerArgs):
    """:class:`MixerArgs` plus what a pretrained checkpoint's attention layout needs."""

    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias)
    rope_scaling_params: Optional[dict] = None  # RoPE frequency scaling: {"rope_type": "linear" | "llama3", ...}

    @classmethod
    def of(cls, args: MixerArgs) -> "PretrainedAttentionArgs":
        return _args_of(cls, args)

    def validate(self, owner: str = "llama_attention") -> None:
        super().validate(owner)
        PretrainedAttentionArgs.validate_options(self, owner)
        if self.key_dim % 2 and self.rope is not False:
            raise ValueError(f"{owner}: RoPE needs an even head dim, got {self.key_dim}")

    def validate_options(self, owner: str = "llama_attention") -> None:
        """Check the layout's own fields only (those :class:`MixerArgs` lacks)."""
        check_bool(owner, "qkv_bias", self.qkv_bias)
        check_bool(owner, "o_bias", self.o_bias)
        check_rope_scaling(owner, self.rope_scaling_params)


@dataclass
class LigerArgs(PretrainedAttentionArgs):
    """:class:`PretrainedAttentionArgs` plus Liger Attention's options."""

    liger_memory: str = "gla"  # the gated recurrence: one of LIGER_MEMORIES
    liger_memory_weight: float = 0.5  # w: weight of the memory read-out; the window read-out gets 1 - w
    liger_window: int = 64  # keys the window branch sees
    liger_gate: str = "pooled_key"  # pooled_key (Liger) or projection (a new random map: Table 6 ablation)
    liger_feature_map: str = "softmax"  # phi: softmax over the head dim, or learnable (Table 6 ablation)
    num_slots: Optional[int] = None  # liger_memory="gsa": slots M per head; default the head dim

    @classmethod
    def of(cls, args: MixerArgs) -> "LigerArgs":
        return _args_of(cls, args)

    @property
    def gate_size(self) -> int:
        """Values the gate has per KV head: K (per channel), 1 (per head) or M (GSA's slots)."""
        if self.liger_memory in ("mamba2", "gated_retention", "mlstm"):
            return 1
        if self.liger_memory == "gsa":
            return self.num_slots if self.num_slots is not None else self.key_dim
        return self.key_dim

    def validate(self, owner: str = "liger") -> None:
        super().validate(owner)
        self.validate_options(owner)
        if self.liger_gate == "pooled_key" and self.key_dim % self.gate_size:
            raise ValueError(f"{owner}: the key is pooled to `num_slots` = {self.gate_size} values per head, which "
                             f"must divide the head dim {self.key_dim}")

    def validate_options(self, owner: str = "liger") -> None:
        """Check Liger Attention's own fields only (those :class:`PretrainedAttentionArgs` lacks)."""
        check_choice(owner, "liger_memory", self.liger_memory, LIGER_MEMORIES)
        check_float(owner, "liger_memory_weight", self.liger_memory_weight, minimum=0.0, inclusive=True)
        if self.liger_memory_weight > 1:
            raise ValueError(f"{owner}: `liger_memory_weight` must lie in [0, 1], got {self.liger_memory_weight}")
        check_int(owner, "liger_window", self.liger_window, minimum=1)
        check_choice(owner, "liger_gate", self.liger_gate, LIGER_GATES)
        check_choice(owner, "liger_feature_map", self.liger_feature_map, LIGER_FEATURE_MAPS)
        check_int(owner, "num_slots", self.num_slots, minimum=1, optional=True)
        if self.liger_memory == "gsa" and self.liger_feature_map != "softmax":
            raise ValueError(f"{owner}: liger_memory='gsa' reads q and k without a feature map, so "
                             f"`liger_feature_map` = {self.liger_feature_map!r} would be ignored; keep 'softmax'")


# ---------------------------------------------------------------- the pretrained projections and softmax attention


class _PretrainedProjections(Mixer):
    """q/k/v/o projections, Qwen3's shared q/k norms, scaled RoPE and the (windowed) softmax attention
    over a KV cache, shared by ``llama_attention`` and ``liger``."""

    def __init__(self, args: PretrainedAttentionArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        Hkv = args.num_kv_heads if args.num_kv_heads is not None else H
        self.num_kv_heads = Hkv
        self.q_proj = Linear(D, H * K, bias=args.qkv_bias)
        self.k_proj = Linear(D, Hkv * K, bias=args.qkv_bias)
        self.v_proj = Linear(D, Hkv * V, bias=args.qkv_bias)
        self.o_proj = Linear(H * V, D, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(K, eps=args.norm_eps)
            self.k_norm = RMSNorm(K, eps=args.norm_eps)
        if args.rope is not False:
            self.rope = RotaryEmbedding(K, args.rope_theta, args.rope_scaling_params)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [B, T, D] -> q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V] (before RoPE)."""
        K, V = self.args.key_dim, self.args.value_dim
        q, k = (rearrange(p(hidden), "b t (h d) -> b t h d", d=K) for p in (self.q_proj, self.k_proj))
        v = rearrange(self.v_proj(hidden), "b t (h d) -> b t h d", d=V)
        if self.args.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def rotate(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor, cache: Optional[LayerState],
               position_ids: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q and k at ``position_ids`` (default: tokens seen before the call + the index in it);
        q and k as they are with ``rope=False``."""
        if self.args.rope is False:
            return q, k
        if position_ids is None:
            position_ids = default_positions(hidden, cache, cu_seqlens)
        return self.rope.pair(q, k, position_ids)

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: Optional[int],
               cache: Optional[LayerState], token_mask: Optional[torch.Tensor],
               cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """Softmax attention (no forget gate) of this call's queries over the cached and the new keys:
        o [B, T, H, V] (:func:`~linmem.layers.attention.attend_with_cache`)."""
        return attend_with_cache(q, k, v, None, window=window, cache=cache, token_mask=token_mask,
                                 cu_seqlens=cu_seqlens)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, V] -> [B, T, D]."""
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))


@register_mixer("llama_attention")
class PretrainedAttention(_PretrainedProjections):
    """Softmax attention in the layout of Llama / Mistral / Qwen2 / Qwen3 (see the module docstring).

    Example:
        >>> from linmem.layers import build_mixer
        >>> args = PretrainedAttentionArgs(hidden_size=32, num_heads=4, num_kv_heads=2, qkv_bias=True,
        ...                                rope_scaling_params={"rope_type": "linear", "factor": 4.0})
        >>> attn = build_mixer("llama_attention", args)
        >>> attn(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    kind = "attention"
    args_class = PretrainedAttentionArgs

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(PretrainedAttentionArgs.of(args))

    @classmethod
    def validate_args(cls, args: MixerArgs) -> None:
        super().validate_args(args)
        for name in _PRO_OPTIONS:
            if getattr(args, name):
                raise ValueError(f"{cls.name}: `{name}` is not part of the pretrained attention layout; use the "
                                 f"softmax mixer for the Pro options")
        if args.forget_gate != "data_dependent":
            raise ValueError(f"{cls.name}: has no forget gate, so `forget_gate` = {args.forget_gate!r} would be "
                             f"ignored; forget gates belong to fox")
        if args.prune_tolerance is not None:
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
        q, k, v = self.project(hidden)
        q, k = self.rotate(q, k, hidden, cache, position_ids, cu_seqlens)
        o = self.attend(q, k, v, window=self.args.window, cache=cache, token_mask=token_mask, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.seen_tokens += hidden.shape[1]
        return self.output(o)


# ---------------------------------------------------------------- Liger Attention


def _accumulation(x: torch.Tensor) -> torch.dtype:
    """Gates and feature maps run in fp32 (fp64 for fp64 inputs)."""
    return torch.promote_types(x.dtype, torch.float32)


class LearnableFeatureMap(nn.Module):
    """phi(x) = softmax(x W_h) over the head dim, one ``[K, K]`` matrix per head, starting at the identity
    (where it equals the softmax feature map): x ``[B, T, H, K]`` -> ``[B, T, H, K]``."""

    def __init__(self, num_heads: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.copy_(torch.eye(self.weight.shape[1]).expand_as(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = _accumulation(x)
        mixed = torch.einsum("bthk,hkj->bthj", x.to(acc), self.weight.to(acc))
        return torch.softmax(mixed, dim=-1).to(x.dtype)


def pool_channels(x: torch.Tensor, size: int) -> torch.Tensor:
    """Average each head's channels in ``size`` groups of consecutive ones: [..., K] -> [..., size].

    Example:
        >>> pool_channels(torch.tensor([[1.0, 3.0, 5.0, 7.0]]), 2).tolist()
        [[2.0, 6.0]]
    """
    return x.unflatten(-1, (size, x.shape[-1] // size)).mean(-1)


@register_mixer("liger")
class LigerAttention(_PretrainedProjections):
    """Liger Attention: a gated recurrence and sliding-window attention over one set of q, k, v
    projections (see the module docstring). hidden ``[B, T, D]`` -> ``[B, T, D]``.

    Example:
        >>> from linmem.layers import build_mixer
        >>> liger = build_mixer("liger", LigerArgs(hidden_size=32, num_heads=4, num_kv_heads=2, liger_window=4))
        >>> liger(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    kind = "memory"
    args_class = LigerArgs

    def __init__(self, args: MixerArgs) -> None:
        args = LigerArgs.of(args)
        super().__init__(args)
        if args.liger_gate == "projection":
            self.gate_proj = Linear(args.hidden_size, self.num_kv_heads * args.gate_size)
        if args.liger_feature_map == "learnable":
            self.feature_map = LearnableFeatureMap(args.num_heads, args.key_dim)

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
        w = self.args.liger_memory_weight
        q, k, v = self.project(hidden)
        o = 0.0
        if w > 0:
            o = w * self.memory(hidden, q, k, v, cache=cache, token_mask=token_mask, cu_seqlens=cu_seqlens)
        if w < 1:
            q_rot, k_rot = self.rotate(q, k, hidden, cache, position_ids, cu_seqlens)
            o = o + (1 - w) * self.attend(q_rot, k_rot, v, window=self.args.liger_window, cache=cache,
                                          token_mask=token_mask, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.seen_tokens += hidden.shape[1]
        return self.output(o.to(hidden.dtype))

    def gate_logits(self, hidden: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[B, T, Hkv, gate_size] fp32 (fp64 for fp64): the pooled key, or the random projection of the ablation."""
        if self.args.liger_gate == "projection":
            gate = rearrange(self.gate_proj(hidden), "b t (h d) -> b t h d", d=self.args.gate_size)
            return gate.to(_accumulation(gate))
        return pool_channels(k.to(_accumulation(k)), self.args.gate_size)

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """The feature map of q and k in the recurrence: [B, T, H, K] -> [B, T, H, K]."""
        if self.args.liger_feature_map == "learnable":
            return self.feature_map(x)
        return torch.softmax(x.to(_accumulation(x)), dim=-1).to(x.dtype)

    def memory(
        self,
        hidden: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cache: Optional[LayerState],
        token_mask: Optional[torch.Tensor],
        cu_seqlens: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The recurrent read-out o^mem [B, T, H, V] of q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V]."""
        a = self.args
        groups = q.shape[2] // k.shape[2]
        gate = self.gate_logits(hidden, k)
        if groups > 1:
            k, v, gate = (repeat(x, "b t h d -> b t (h g) d", g=groups) for x in (k, v, gate))
        dtype = activation_dtype(hidden)
        if a.liger_memory == "gsa":
            log_decay = (F.logsigmoid(gate) / GATE_LOGIT_NORMALIZER).clamp_min(MIN_LOG_DECAY)
            return slot_attention_with_cache(q.to(dtype), k.to(dtype), v.to(dtype), log_decay, scale=None,
                                             cache=cache, token_mask=token_mask, cu_seqlens=cu_seqlens,
                                             backend=a.backend)
        log_decay, key = self.decay_and_key(gate, k)
        args = RecurrenceArgs(q=self.phi(q), k=key, v=v, log_decay=log_decay.clamp_min(MIN_LOG_DECAY), scale=1.0)
        return memory_with_cache(args.cast(dtype), cache=cache, token_mask=token_mask, cu_seqlens=cu_seqlens,
                                 state_names=("recurrent",), run_memory=partial(run_recurrence, backend=a.backend),
                                 step_memory=step_recurrence)

    def decay_and_key(self, gate: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Liger Table 1: the log decay (``[B, T, H, K]`` per channel or ``[B, T, H]`` per head, fp32) and
        the key written, from the gate logits ``[B, T, H, K or 1]`` and the key ``[B, T, H, K]``."""
        kind = self.args.liger_memory
        if kind == "gla":
            return F.logsigmoid(gate) / GATE_LOGIT_NORMALIZER, self.phi(k)
        if kind == "mamba2":
            return -F.softplus(gate[..., 0]), self.phi(k)
        if kind == "gated_retention":
            return F.logsigmoid(gate[..., 0]) / GATE_LOGIT_NORMALIZER, self.phi(k)
        if kind == "rwkv6":
            return -torch.exp(gate.clamp_max(math.log(-MIN_LOG_DECAY))), self.phi(k)
        if kind == "mlstm":  # forget gate sigmoid(g), input gate exp(g) scaling the write
            input_gate = torch.exp(gate.clamp_max(math.log(-MIN_LOG_DECAY)))
            return F.logsigmoid(gate[..., 0]), (input_gate * self.phi(k)).to(k.dtype)
        # hgrn2: alpha = gamma + (1 - gamma) sigmoid(g), the key is 1 - alpha = (1 - gamma) sigmoid(-g)
        gamma = self.args.layer_idx / self.args.num_layers
        log_decay = F.logsigmoid(gate) if gamma == 0 else torch.logaddexp(
            torch.full_like(gate, math.log(gamma)), math.log1p(-gamma) + F.logsigmoid(gate))
        return log_decay, ((1 - gamma) * torch.sigmoid(-gate)).to(k.dtype)
