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
:data:`~linmem.layers.norms.GROUP_NORM_EPS` are the paper's constants. Initialisation follows the
reference code (RWKV-LM, x060), depending on ``layer_idx`` / ``num_layers``.

"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .base import LayerState, MixerArgs, register_mixer
from .conv import token_shift
from .init import Linear, orthogonal_init, zeros_init
from .lora import LoRA, channel_fraction, layer_ratios
from .norms import HeadGroupNorm
from .recurrent import MemoryMixer, RecurrenceArgs

#: rank of the five ddlerp LoRAs (RWKV-6's D_MIX_LORA)
MIX_LORA_RANK = 32
#: the token-shift mixes of RWKV-6, in the order the layer applies them
MIXES = "wkvrg"


@register_mixer("rwkv6")
class RWKV6(MemoryMixer):
    """RWKV-6 time mixing: per-channel data-dependent decay, bonus ``u``, ddlerp token shift.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees q = r, k ``[B, T, H, K]``,
    v ``[B, T, H, V]``, log_decay = -exp(d) ``[B, T, H, K]`` (fp32), bonus u ``[H, K]``.
    """

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.mu_x = nn.Parameter(torch.empty(D))
        self.mix = nn.ModuleDict({name: LoRA(D, MIX_LORA_RANK, D, bias=True) for name in MIXES})
        self.decay = LoRA(D, args.gate_low_rank, H * K, bias=True)
        self.bonus = nn.Parameter(torch.empty(H, K))
        self.receptance = Linear(D, H * K, init=orthogonal_init(1.0))
        self.key = Linear(D, H * K, init=orthogonal_init(0.1))
        self.value = Linear(D, H * V, init=orthogonal_init(1.0))
        self.gate = Linear(D, H * V, init=orthogonal_init(0.1))
        self.output_proj = Linear(H * V, D, init=zeros_init())
        self.norm = HeadGroupNorm(H, V, weight=((1 + args.layer_idx) / args.num_layers) ** 0.7)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The reference code's init (RWKV-LM x060) of the token-shift mixes, the decay and the bonus."""
        H, K = self.bonus.shape
        device = self.mu_x.device
        r0, r1 = layer_ratios(self.args)
        ddd = channel_fraction(self.args.hidden_size, self.args.hidden_size, device)
        self.mu_x.copy_(1.0 - ddd.pow(r1))
        mu = {"w": 1.0 - ddd.pow(r1), "k": 1.0 - ddd.pow(r1), "v": 1.0 - (ddd.pow(r1) + 0.3 * r0),
              "r": 1.0 - ddd.pow(0.5 * r1), "g": 1.0 - ddd.pow(0.5 * r1)}
        n = channel_fraction(H * K, H * K - 1, device)
        for lora, bias in [*((self.mix[name], mu[name]) for name in MIXES),
                           (self.decay, -6.0 + 5.0 * n.pow(0.7 + 1.3 * r0))]:
            nn.init.zeros_(lora.A)
            nn.init.uniform_(lora.B, -0.01, 0.01)
            lora.bias.copy_(bias)
        zigzag = ((torch.arange(H * K, device=device) + 1) % 3 - 1) * 0.1
        self.bonus.copy_((r0 * (1.0 - n) + zigzag).view(H, K))

    def recurrence_inputs(
        self, hidden: torch.Tensor, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
    ) -> RecurrenceArgs:
        K, V = self.args.key_dim, self.args.value_dim
        dx = token_shift(hidden, cache=cache, cu_seqlens=cu_seqlens) - hidden
        xx = hidden + dx * self.mu_x.to(hidden.dtype)
        xw, xk, xv, xr, xg = (hidden + dx * self.mix[name](xx) for name in MIXES)
        r, k, v = self.receptance(xr), self.key(xk), self.value(xv)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # gates in fp32 (fp64 for fp64 inputs)
        log_decay = -torch.exp(self.decay(xw.to(acc)))  # [B, T, H * K]
        r, k, log_decay = (rearrange(t, "b t (h d) -> b t h d", d=K) for t in (r, k, log_decay))
        v = rearrange(v, "b t (h d) -> b t h d", d=V)
        return RecurrenceArgs(q=r, k=k, v=v, log_decay=log_decay, bonus=self.bonus, scale=1.0,
                              extras={"xg": xg})

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        return self.output_proj(self.norm(o) * F.silu(self.gate(args.extras["xg"])))
