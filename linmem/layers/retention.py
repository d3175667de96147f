"""Linear attention with a constant decay per head: RetNet's retention (Sun et al. 2023, "Retentive
Network: A Successor to Transformer for Large Language Models", arXiv 2307.08621) and Lightning
Attention of TransNormerLLM (Qin et al. 2023, "TransNormerLLM", arXiv 2307.14708; Qin et al. 2024,
"Lightning Attention-2", arXiv 2401.04658).

    S_t = gamma_h S_{t-1} + k_t^T v_t,    o_t = scale * q_t S_t

Retention: q, k rotated by position (RoPE), scale K^-1/2, gamma_h = 1 - 2^(-5 - h) (h = 0..H-1),
    y = W_o (RMSNorm_head(o) * swish(W_g x)).
Lightning: q, k = silu(W x), scale 1, gamma_h = exp(-m_h (1 - l / (L - 1) + 1e-5)) with the ALiBi
    slopes m_h and layer l of L (decays approach 1 in deep layers), y = W_o (RMSNorm(o) * (W_u x)).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from ..ops.varlen import positions_in_sequence
from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvs
from .init import Linear, xavier_init
from .norms import GatedRMSNorm, RMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs
from .rotary import RotaryEmbedding

#: TransNormerLLM keeps this much of the slope in the last layer, so its decay stays below 1
LIGHTNING_SLOPE_FLOOR = 1e-5
#: gain of the xavier-uniform init of every linear map (as GLA)
XAVIER_GAIN = 2 ** -2.5


def retnet_log_decay(num_heads: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """[H] fp32: log(1 - 2^(-5 - h)) for h = 0..H-1 (RetNet's multi-scale decays)."""
    h = torch.arange(num_heads, device=device, dtype=torch.float32)
    return torch.log1p(-torch.exp2(-5.0 - h))


def alibi_slopes(num_heads: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """[H] fp32 ALiBi slopes: 2^(-8 i / n) for i = 1..n with n the largest power of 2 <= H; the
    remaining heads take the odd-indexed slopes 2^(-4 (2 j + 1) / n) of the 2n-head geometric series."""
    n = 2 ** math.floor(math.log2(num_heads))
    first = torch.exp2(-8.0 * torch.arange(1, n + 1, device=device, dtype=torch.float32) / n)
    rest = torch.exp2(-4.0 * (2 * torch.arange(num_heads - n, device=device, dtype=torch.float32) + 1) / n)
    return torch.cat([first, rest])


def lightning_log_decay(
    num_heads: int, layer_idx: int, num_layers: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """[H] fp32: -m_h (1 - l / (L - 1) + 1e-5), TransNormerLLM's depth-scaled ALiBi decays."""
    depth = layer_idx / (num_layers - 1) if num_layers > 1 else 0.0
    return -alibi_slopes(num_heads, device) * (1 - depth + LIGHTNING_SLOPE_FLOOR)


def running_positions(
    batch: int, length: int, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """[B, T] positions of the tokens of this call, continuing from ``cache["position"]`` ([B], tokens seen)."""
    pos = positions_in_sequence(length, cu_seqlens, device).expand(batch, length)
    if cache is None:
        return pos
    seen = cache.get("position")
    if seen is None:
        seen = torch.zeros(batch, dtype=torch.long, device=device)
    positions = pos + seen[:, None]
    cache.set("position", seen + length)  # a static cache writes into `seen`
    return positions


class _ConstantDecayAttention(MemoryMixer):
    """q, k, v and output-gate projections; one constant decay per head, additive write."""

    memory_projections = ("k_proj", "v_proj")

    #: applied to q, k when there is no short convolution
    qk_activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    #: read-out scale; None = K^-1/2
    scale: Optional[float] = None

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        init = xavier_init(XAVIER_GAIN)
        self.q_proj = Linear(D, H * K, init=init)
        self.k_proj = Linear(D, H * K, init=init)
        self.v_proj = Linear(D, H * V, init=init)
        self.g_proj = Linear(D, H * V, init=init)
        self.o_proj = Linear(H * V, D, init=init)
        self.convs = ShortConvs({"q": H * K, "k": H * K, "v": H * V}, args)

    @abstractmethod
    def head_log_decay(self, device: torch.device) -> torch.Tensor:
        """[H] fp32 natural-log decays (<= 0) of the heads this module computes (:attr:`heads`)."""

    def positional(
        self, q: torch.Tensor, k: torch.Tensor, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Position encoding of q, k: [B, T, H, K] each (none by default)."""
        return q, k

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        act, K, V = self.qk_activation, self.args.key_dim, self.args.value_dim
        k, v = self.project("k_proj", hidden, projected), self.project("v_proj", hidden, projected)
        q, k, v = (
            rearrange(self.convs(n, x, cache=cache, cu_seqlens=cu_seqlens, activation=a), "b t (h d) -> b t h d", d=d)
            for n, x, a, d in (("q", self.q_proj(hidden), act, K), ("k", k, act, K), ("v", v, None, V))
        )
        q, k = self.positional(q, k, cache=cache, cu_seqlens=cu_seqlens)
        return RecurrenceArgs(q=q, k=k, v=v, log_decay=self.head_log_decay(hidden.device), scale=self.scale)


@register_mixer("retention")
class Retention(_ConstantDecayAttention):
    """RetNet's multi-scale retention (recurrent form) with RoPE and a swish output gate.

    Not a mixture-of-memories rule: its rotary positions would restart on every memory's stream.
    """

    memory_projections = ()

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        self.rotary = RotaryEmbedding(args.key_dim, theta=args.rope_theta)
        self.o_norm = GatedRMSNorm(args.value_dim, eps=args.norm_eps)

    def head_log_decay(self, device: torch.device) -> torch.Tensor:
        return retnet_log_decay(self.args.num_heads, device)[self.heads]

    def positional(
        self, q: torch.Tensor, k: torch.Tensor, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # only relative positions reach the output, so a running count per row serves left padding too
        pos = running_positions(q.shape[0], q.shape[1], cache=cache, cu_seqlens=cu_seqlens, device=q.device)
        return self.rotary.pair(q, k, pos)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        gate = rearrange(self.g_proj(hidden), "b t (h d) -> b t h d", d=self.args.value_dim)
        return self.o_proj(rearrange(self.o_norm(o, gate), "b t h d -> b t (h d)"))


@register_mixer("lightning")
class LightningAttention(_ConstantDecayAttention):
    """TransNormerLLM's lightning attention: silu features, ALiBi decays scaled by depth, gated RMSNorm."""

    qk_activation = staticmethod(F.silu)
    scale = 1.0

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        self.o_norm = RMSNorm(args.num_heads * args.value_dim, eps=args.norm_eps)

    def head_log_decay(self, device: torch.device) -> torch.Tensor:
        return lightning_log_decay(self.args.num_heads, self.args.layer_idx, self.args.num_layers, device)[self.heads]

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        return self.o_proj(self.o_norm(rearrange(o, "b t h d -> b t (h d)")) * self.g_proj(hidden))
