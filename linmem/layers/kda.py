"""Kimi Delta Attention (KDA, Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture", arXiv 2510.26692): the gated delta rule with a decay per key channel.

    S' = diag(alpha_t) S_{t-1},    S_t = S' + beta_t k_t^T (v_t - k_t S'),    o_t = K^-1/2 q_t S_t
    log alpha_t = -exp(A_log_h) * softplus(W_up W_down x_t + dt_bias)     [H, K] per token (<= 0)
    beta_t = sigmoid(W_b x_t),    y_t = W_o (RMSNorm(o_t) * sigmoid(W_g_up W_g_down x_t))

q, k, v pass a short convolution + SiLU; q, k are L2-normalised per head. The decay and the output
gate are low-rank projections of rank V (the head's value dim), as in Kimi Linear; A_log starts as
Mamba-2's (A uniform in [1, 16] per head) and dt_bias, one per key channel, as Mamba-2's dt init
(softplus^-1 of dt log-uniform in [1e-3, 0.1]) -- Gated DeltaNet's scalar gate made per channel.

:class:`MixerArgs` mapping: H = ``num_heads``, K = ``key_dim``, V = ``value_dim``;
``use_short_conv=False`` keeps the SiLU and drops the convolutions. In a mixture of memories each
memory owns its k, v, beta and decay projections.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.fused import l2_norm
from ..ops.gates import mamba2_log_decay
from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvs
from .init import init_mamba2_gate_, low_rank
from .norms import GatedRMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs


@register_mixer("kda")
class KimiDeltaAttention(MemoryMixer):
    """KDA: delta rule with a per-key-channel decay, sigmoid-gated RMSNorm output.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees q, k ``[B, T, H, K]`` (unit norm),
    v ``[B, T, H, V]``, log_decay ``[B, T, H, K]`` and beta ``[B, T, H]`` (fp32).
    """

    memory_projections = ("k_proj", "v_proj", "b_proj", "f_proj")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.convs = ShortConvs({"q": H * K, "k": H * K, "v": H * V}, args, default=True)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.f_proj = low_rank(D, V, H * K)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.g_proj = low_rank(D, V, H * V, bias=True)
        self.o_norm = GatedRMSNorm(V, eps=args.norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(H * V, D, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init_mamba2_gate_(self.A_log, self.dt_bias)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        K, V = self.args.key_dim, self.args.value_dim
        q, k, v = (
            self.convs(n, x, cache=cache, cu_seqlens=cu_seqlens, activation=F.silu)
            for n, x in (("q", self.q_proj(hidden)), ("k", self.project("k_proj", hidden, projected)),
                         ("v", self.project("v_proj", hidden, projected)))
        )
        q, k = l2_norm(q, head_dim=K), l2_norm(k, head_dim=K)  # [B, T, H, K], unit norm per head
        v = v.unflatten(-1, (-1, V))
        beta = torch.sigmoid(self.project("b_proj", hidden, projected).float())  # [B, T, H]
        f = self.project("f_proj", hidden, projected).unflatten(-1, (-1, K))
        log_decay = mamba2_log_decay(f, self.A_log, self.dt_bias.view(-1, K))  # [B, T, H, K]
        return RecurrenceArgs(q=q, k=k, v=v, log_decay=log_decay, beta=beta)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        gate = self.g_proj(hidden).unflatten(-1, o.shape[-2:])  # [B, T, H, V]
        return self.o_proj(self.o_norm(o, gate).flatten(-2))
