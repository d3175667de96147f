"""RWKV-7 "Goose" time mixing (Peng et al. 2025, "RWKV-7 "Goose" with Expressive Dynamic State
Evolution", arXiv 2503.14456).

The paper keeps a state wkv: [V, K] per head and updates it with a diagonal-plus-low-rank
transition acting on the key side::

    wkv_t = wkv_{t-1} (diag(w_t) - kappa_t^T (a_t * kappa_t)) + v_t^T k~_t,     y_t = wkv_t r_t^T

with the decay w_t = exp(-e^{-1/2} sigmoid(w0 + tanh(x_w W1) W2)) in (0.545, 1), the
in-context learning rate a_t = sigmoid(a0 + x_a A1 A2), the removal key
kappa_t = normalize_per_head(k_t * k_k) and the write key k~_t = k_t * (1 + (a_t - 1) * k_a).

Mapping onto :func:`linmem.ops.linear_recurrence` (state S = wkv^T: [K, V], rows = keys):
transposing the update gives ``S_t = (diag(w_t) - (a_t * kappa_t)^T kappa_t) S_{t-1} + k~_t^T v_t``,
so with the op's low-rank term ``a^T (b S_{t-1})`` (read along b, write along a)::

    log_decay = log w_t = -e^{-1/2} sigmoid(.)    [B, T, H, K], fp32
    a = -(a_t * kappa_t),  b = kappa_t,  k = k~_t,  q = r_t,  scale = 1

and ``o_t = r_t S_t = (wkv_t r_t^T)^T``. The output adds the bonus ``(r_t . (r_k * k~_t)) v_t``
outside the op after a per-head GroupNorm, is gated by ``g = sigmoid(x_g G1) G2`` and projected:
``out = W_o ((GroupNorm_H(o) + bonus) * g)``. Token shift: ``x_* = x_t + (x_{t-1} - x_t) * mu_*``.

Left out: the value residual (v_t mixed with the first layer's values through a
learnt gate), since the mixer interface passes nothing between layers.

:class:`MixerArgs` mapping: H = ``num_heads``, K = ``key_dim`` (r, k, w, a, kappa, r_k),
V = ``value_dim`` (v, gate, output); the decay LoRA rank is ``gate_low_rank``; the
LoRA ranks of a and g follow the reference rule :func:`lora_rank` with the factors
:data:`A_LORA_FACTOR` and :data:`GATE_LORA_FACTOR`. Initialisation follows the reference
code (RWKV-LM, x070), depending on ``layer_idx`` / ``num_layers``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from einops import rearrange
from torch import nn

from ..ops.fused import l2_norm
from .base import LayerState, MixerArgs, register_mixer
from .conv import token_shift
from .init import Linear, orthogonal_init, zeros_init
from .lora import LoRA, channel_fraction, layer_ratios
from .norms import HeadGroupNorm
from .recurrent import MemoryMixer, RecurrenceArgs

#: the decay's bound: log w = -DECAY_SCALE * sigmoid(.) (e^{-1/2}, so w > 0.545)
DECAY_SCALE = math.exp(-0.5)
#: LoRA rank factors of the in-context learning rate and of the output gate (rank ~ factor * sqrt(D))
A_LORA_FACTOR = 2.5
GATE_LORA_FACTOR = 5.0
#: epsilon of the removal key's L2 norm x / sqrt(|x|^2 + eps): F.normalize's floor |x| >= 1e-12 (the paper's code)
NORMALIZE_EPS = 1e-24
#: the token-shift mixes of RWKV-7 and the exponent factor of each one's init
MIXES = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}


def lora_rank(hidden_size: int, factor: float) -> int:
    """The reference code's suggested LoRA rank: ``factor * sqrt(D)`` rounded to a multiple of 32, at least 32."""
    return max(32, int(round(factor * hidden_size ** 0.5 / 32) * 32))


def orthogonal_lora_(lora: LoRA, scale: float = 0.1) -> None:
    """Orthogonal init of a LoRA's B ``[rank, d_out]`` with gain ``scale`` (times sqrt(rank/d_out) if tall)."""
    rank, d_out = lora.B.shape
    gain = math.sqrt(rank / d_out) if rank > d_out else 1.0
    nn.init.orthogonal_(lora.B, gain=gain * scale)


@register_mixer("rwkv7")
class RWKV7(MemoryMixer):
    """RWKV-7 time mixing: generalised delta rule with vector decay and in-context learning rate.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees q = r, k = k~ ``[B, T, H, K]``,
    v ``[B, T, H, V]``, log_decay ``[B, T, H, K]`` (fp32, in [-e^{-1/2}, 0]), and the
    low-rank transition a = -(a_t * kappa_t), b = kappa_t ``[B, T, H, K]``.
    """

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        C = H * K
        self.mu = nn.ParameterDict({name: nn.Parameter(torch.empty(D)) for name in MIXES})
        self.decay = LoRA(D, args.gate_low_rank, C, bias=True)
        self.icl_rate = LoRA(D, lora_rank(D, A_LORA_FACTOR), C, activation=None, bias=True)
        self.gate = LoRA(D, lora_rank(D, GATE_LORA_FACTOR), H * V, activation=torch.sigmoid)
        self.k_k = nn.Parameter(torch.empty(C))
        self.k_a = nn.Parameter(torch.empty(C))
        self.r_k = nn.Parameter(torch.empty(H, K))
        self.receptance = Linear(D, C, init=orthogonal_init(1.0))
        self.key = Linear(D, C, init=orthogonal_init(0.1))
        self.value = Linear(D, H * V, init=orthogonal_init(1.0))
        self.output_proj = Linear(H * V, D, init=zeros_init())
        self.norm = HeadGroupNorm(H, V, weight=((1 + args.layer_idx) / args.num_layers) ** 0.7)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The reference code's init (RWKV-LM x070) of the token-shift mixes, the LoRAs and the key scales."""
        H, K = self.r_k.shape
        C, device = H * K, self.k_k.device
        r0, r1 = layer_ratios(self.args)
        ddd = channel_fraction(self.args.hidden_size, self.args.hidden_size, device)
        for name, p in MIXES.items():
            self.mu[name].copy_(1.0 - ddd.pow(p * r1))
        n = torch.arange(C, dtype=torch.float32, device=device)
        linear = n / max(C - 1, 1) - 0.5
        zigzag = ((n % K) - (K - 1) / 2) / max((K - 1) / 2, 1)
        zigzag = zigzag * zigzag.abs()
        www = -6.0 + 6.0 * (n / max(C - 1, 1)).pow(1.0 + r0 ** 0.3)
        for lora in (self.decay, self.icl_rate, self.gate):
            nn.init.zeros_(lora.A)
            orthogonal_lora_(lora)
        self.decay.bias.copy_(www + 0.5 + 2.5 * zigzag)
        self.icl_rate.bias.copy_(-0.19 + 0.3 * zigzag + 0.4 * linear)
        self.k_k.copy_(0.71 - 0.1 * linear)
        nn.init.constant_(self.k_a, 1.02)
        nn.init.constant_(self.r_k, -0.04)

    def recurrence_inputs(
        self, hidden: torch.Tensor, *, cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]
    ) -> RecurrenceArgs:
        K, V = self.args.key_dim, self.args.value_dim
        dx = token_shift(hidden, cache=cache, cu_seqlens=cu_seqlens) - hidden
        xr, xw, xk, xv, xa, xg = (hidden + dx * self.mu[name].to(hidden.dtype) for name in MIXES)
        heads = lambda t, d=K: rearrange(t, "b t (h d) -> b t h d", d=d)  # noqa: E731
        r, k, v = heads(self.receptance(xr)), heads(self.key(xk)), heads(self.value(xv), V)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # gates in fp32 (fp64 for fp64 inputs)
        log_decay = heads(-DECAY_SCALE * torch.sigmoid(self.decay(xw.to(acc))))  # in [-e^{-1/2}, 0]
        icl = heads(torch.sigmoid(self.icl_rate(xa)))  # in-context learning rate a_t
        kappa = l2_norm(k * self.k_k.view(-1, K).to(k.dtype), eps=NORMALIZE_EPS)  # the removal key, unit norm per head
        k = k * (1 + (icl - 1) * self.k_a.view(-1, K).to(k.dtype))
        return RecurrenceArgs(q=r, k=k, v=v, log_decay=log_decay, a=-(icl * kappa), b=kappa, scale=1.0,
                              extras={"g": self.gate(xg)})

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        r, k, v = args.q, args.k, args.v
        bonus = (r * k * self.r_k.to(r.dtype)).sum(-1, keepdim=True) * v  # [B, T, H, V]
        y = self.norm(o) + rearrange(bonus, "b t h v -> b t (h v)")
        return self.output_proj(y * args.extras["g"])
