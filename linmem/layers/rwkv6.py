"""RWKV-6 "Finch" time mixing (Peng et al. 2024, "Eagle and Finch: RWKV with Matrix-Valued
States and Dynamic Recurrence", arXiv 2404.05892).

Per head, with the state S: [K, V] and the bonus u: [K]::

    o_t = r_t (S_{t-1} + diag(u) k_t^T v_t)
    S_t = diag(w_t) S_{t-1} + k_t^T v_t,          w_t = exp(-exp(d_t))   (per key channel)

All projections read token-shifted inputs mixed by data-dependent interpolation
(ddlerp), with ``lora(y) = lambda + tanh(y A) B`` and ``dx_t = x_{t-1} - x_t``::

    x_* = x_t + dx_t * lora_*(x_t + dx_t * mu_x)         for * in w, k, v, r, g
    r, k, v = W_r x_r, W_k x_k, W_v x_v;   d_t = lora_d(x_w);   g = silu(W_g x_g)
    out = W_o (GroupNorm_H(o) * g)

:class:`MixerArgs` mapping: H = ``num_heads``, K = ``key_dim`` (r, k, decay, bonus),
V = ``value_dim`` (v, gate, output); the decay LoRA rank is ``gate_low_rank`` (the
paper uses 64); the ddlerp rank :data:`MIX_LORA_RANK` and the group-norm epsilon
:data:`GROUP_NORM_EPS` are the paper's constants. Initialisation follows the
reference code (RWKV-LM, x060), depending on ``layer_idx`` / ``num_layers``.

:class:`LoRA`, :class:`HeadGroupNorm` and :func:`layer_ratios` are shared with RWKV-7.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .base import LayerState, MixerArgs, register_mixer
from .modules import token_shift
from .recurrent import MemoryMixer, RecurrenceArgs

#: rank of the five ddlerp LoRAs (RWKV-6's D_MIX_LORA)
MIX_LORA_RANK = 32
#: epsilon of the per-head output GroupNorm (1e-5 * head_size_divisor**2 with divisor 8)
GROUP_NORM_EPS = 64e-5


class LoRA(nn.Module):
    """The low-rank projection of RWKV-6/7: ``x -> bias + act(x A) B``, x: [..., d_in] -> [..., d_out].

    ``A`` starts at zero (as in the reference code); the caller initialises ``B``.
    ``bias`` (the initial value of a learnt offset ``[d_out]``) is optional.
    """

    def __init__(
        self,
        d_in: int,
        rank: int,
        d_out: int,
        activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = torch.tanh,
        bias: Optional[torch.Tensor] = None,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.A = nn.Parameter(torch.zeros(d_in, rank))
        self.B = nn.Parameter(torch.zeros(rank, d_out))
        self.bias = None if bias is None else nn.Parameter(bias.clone().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., d_in] -> [..., d_out]."""
        h = x @ self.A.to(x.dtype)
        if self.activation is not None:
            h = self.activation(h)
        y = h @ self.B.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class HeadGroupNorm(nn.Module):
    """LayerNorm of each head's output (GroupNorm with one group per head), in fp32 (fp64 for fp64).

    o: [B, T, H, V] -> [B, T, H * V].
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = GROUP_NORM_EPS, weight: float = 1.0) -> None:
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.weight = nn.Parameter(torch.full((num_heads * head_dim,), float(weight)))
        self.bias = nn.Parameter(torch.zeros(num_heads * head_dim))

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B, T, H, V] -> [B, T, H * V]."""
        B, T = o.shape[:2]
        acc = torch.promote_types(o.dtype, torch.float32)
        flat = rearrange(o, "b t h v -> (b t) (h v)").to(acc)
        y = F.group_norm(flat, self.num_heads, self.weight.to(acc), self.bias.to(acc), self.eps)
        return y.view(B, T, -1).to(o.dtype)


def layer_ratios(args: MixerArgs) -> tuple[float, float]:
    """The RWKV init schedules over depth: (0 -> 1, 1 -> almost 0) from the first to the last layer."""
    ratio_0_to_1 = args.layer_idx / max(args.num_layers - 1, 1)
    ratio_1_to_almost_0 = 1.0 - args.layer_idx / args.num_layers
    return ratio_0_to_1, ratio_1_to_almost_0


def channel_fraction(n: int, denominator: int) -> torch.Tensor:
    """[n] tensor i / denominator, the channel ramp the RWKV inits are built from."""
    return torch.arange(n, dtype=torch.float32) / max(denominator, 1)


@register_mixer("rwkv6")
class RWKV6(MemoryMixer):
    """RWKV-6 time mixing: per-channel data-dependent decay, bonus ``u``, ddlerp token shift.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees q = r, k ``[B, T, H, K]``,
    v ``[B, T, H, V]``, log_decay = -exp(d) ``[B, T, H, K]`` (fp32), bonus u ``[H, K]``.
    """

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        r0, r1 = layer_ratios(args)
        ddd = channel_fraction(D, D)
        self.mu_x = nn.Parameter(1.0 - ddd.pow(r1))
        mu = {"w": 1.0 - ddd.pow(r1), "k": 1.0 - ddd.pow(r1), "v": 1.0 - (ddd.pow(r1) + 0.3 * r0),
              "r": 1.0 - ddd.pow(0.5 * r1), "g": 1.0 - ddd.pow(0.5 * r1)}
        self.mix = nn.ModuleDict({name: LoRA(D, MIX_LORA_RANK, D, bias=m) for name, m in mu.items()})

        n = channel_fraction(H * K, H * K - 1)
        decay_speed = -6.0 + 5.0 * n.pow(0.7 + 1.3 * r0)
        self.decay = LoRA(D, args.gate_low_rank, H * K, bias=decay_speed)
        zigzag = ((torch.arange(H * K) + 1) % 3 - 1) * 0.1
        self.bonus = nn.Parameter((r0 * (1.0 - n) + zigzag).view(H, K))
        for lora in [*self.mix.values(), self.decay]:
            nn.init.uniform_(lora.B, -0.01, 0.01)

        self.receptance = nn.Linear(D, H * K, bias=False)
        self.key = nn.Linear(D, H * K, bias=False)
        self.value = nn.Linear(D, H * V, bias=False)
        self.gate = nn.Linear(D, H * V, bias=False)
        self.output_proj = nn.Linear(H * V, D, bias=False)
        self.norm = HeadGroupNorm(H, V, weight=((1 + args.layer_idx) / args.num_layers) ** 0.7)
        for proj, gain in ((self.receptance, 1.0), (self.key, 0.1), (self.value, 1.0), (self.gate, 0.1)):
            nn.init.orthogonal_(proj.weight, gain=gain)
        nn.init.zeros_(self.output_proj.weight)

    def recurrence_inputs(
        self, hidden: torch.Tensor, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
    ) -> RecurrenceArgs:
        H = self.args.num_heads
        dx = token_shift(hidden, cache=cache, cu_seqlens=cu_seqlens) - hidden
        xx = hidden + dx * self.mu_x.to(hidden.dtype)
        xw, xk, xv, xr, xg = (hidden + dx * self.mix[name](xx) for name in "wkvrg")
        r, k, v = self.receptance(xr), self.key(xk), self.value(xv)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # gates in fp32 (fp64 for fp64 inputs)
        log_decay = -torch.exp(self.decay(xw.to(acc)))  # [B, T, H * K]
        r, k, v, log_decay = (rearrange(t, "b t (h d) -> b t h d", h=H) for t in (r, k, v, log_decay))
        return RecurrenceArgs(q=r, k=k, v=v, log_decay=log_decay, bonus=self.bonus, scale=1.0,
                              extras={"xg": xg})

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        return self.output_proj(self.norm(o) * F.silu(self.gate(args.extras["xg"])))
