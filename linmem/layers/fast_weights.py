"""Two gated fast-weight memories of Linear-MoE's Table 1 (Sun et al. 2025, arXiv 2503.05447):
``M_t = A_t ⊙ M_{t-1} + k_t^T v_t`` with a data-dependent gate ``A_t: [K, V]`` per token and head.

``gfw`` (gated fast weights; the "DFW" of Mao 2022, "Fine-Tuning Pre-trained Transformers into Decaying
Fast Weights", arXiv 2210.04243, and of the GLA paper's Table 1): the gate is the outer product of a key
gate and a value gate::

    A_t = σ(W_α x_t + b_α)^T σ(W_β x_t + b_β)          [K, V], log A_t = logσ(·)_k + logσ(·)_v
    o_t = K^-1/2 q_t M_t,     y_t = W_o(RMSNorm(o_t) ⊙ swish(W_r x_t))

``gateloop`` (GateLoop, Katsch 2023, "GateLoop: Fully Data-Controlled Linear Recurrence for Sequence
Modeling", arXiv 2311.01927): a data-controlled state transition per key channel::

    A_t = σ(W_a x_t + b_a)^T 1                        [K, V] constant along V, i.e. diag(σ(W_a x_t + b_a))
    o_t = K^-1/2 q_t M_t,     y_t = W_o(RMSNorm(o_t) ⊙ swish(W_r x_t))

GateLoop's transition is complex (a magnitude σ(·) times a data-controlled phase e^{iθ_t}); only the real
magnitude is kept here, so that the state stays real. Because GateLoop's gate is constant along V it is
handed to the recurrence as a ``[B, T, H, K]`` decay (the fused kernels serve it); ``gfw``'s is a full
``[B, T, H, K, V]`` decay, which no fused kernel takes: ``backend="auto"`` runs it on the chunked PyTorch
backend (one vector-decay recurrence per value column). Both output stages and initialisations are GLA's
(xavier-uniform, gain 2^-2.5, zero biases); a short convolution on q, k, v is optional (off by default).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from ..ops.gates import pointwise
from .base import LayerState, MixerArgs, register_mixer
from .conv import ShortConvs
from .init import Linear, xavier_init
from .norms import GatedRMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs

#: gain of the xavier-uniform init of every linear map (GLA's)
XAVIER_GAIN = 2 ** -2.5


def log_sigmoid_gate(logits: torch.Tensor) -> torch.Tensor:
    """logσ(logits) in fp32 (fp64 for fp64 logits), any shape, saving only the logits for the backward.

    Example:
        >>> log_sigmoid_gate(torch.zeros(2, dtype=torch.bfloat16))
        tensor([-0.6931, -0.6931])
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    return pointwise(logits, lambda x: F.logsigmoid(x.to(acc)), lambda x: torch.sigmoid(-x.to(acc)))


class _GatedFastWeights(MemoryMixer):
    """The shared part: q, k, v projections with optional short convolutions, GLA's gated output stage.

    Subclasses add their gate projections and say how they become the log decay (:meth:`log_decay`).
    """

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.init = xavier_init(XAVIER_GAIN)
        self.q_proj = Linear(D, H * K, init=self.init)
        self.k_proj = Linear(D, H * K, init=self.init)
        self.v_proj = Linear(D, H * V, init=self.init)
        self.g_proj = Linear(D, H * V, init=self.init)
        self.convs = ShortConvs({"q": H * K, "k": H * K, "v": H * V}, args)
        self.o_norm = GatedRMSNorm(V, eps=args.norm_eps)
        self.o_proj = Linear(H * V, D, init=self.init)

    @abstractmethod
    def log_decay(self, hidden: torch.Tensor, projected: Optional[dict[str, torch.Tensor]]) -> torch.Tensor:
        """hidden [B, T, D] -> the log decay, fp32: [B, T, H, K] or [B, T, H, K, V]."""

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        q, k, v = self.convolved_qkv(hidden, cache=cache, cu_seqlens=cu_seqlens, projected=projected)
        return RecurrenceArgs(q=q, k=k, v=v, log_decay=self.log_decay(hidden, projected))

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        gate = rearrange(self.g_proj(hidden), "b t (h d) -> b t h d", d=self.args.value_dim)
        return self.o_proj(rearrange(self.o_norm(o, gate), "b t h d -> b t (h d)"))


@register_mixer("gfw")
class GatedFastWeights(_GatedFastWeights):
    """Gated fast weights: ``M_t = (α_t^T β_t) ⊙ M_{t-1} + k_t^T v_t``, α over keys, β over values.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees a full log decay ``[B, T, H, K, V]`` (fp32).

    Example:
        >>> layer = GatedFastWeights(MixerArgs(hidden_size=16, num_heads=2))
        >>> layer(torch.randn(1, 5, 16)).shape
        torch.Size([1, 5, 16])
    """

    memory_projections = ("k_proj", "v_proj", "alpha_proj", "beta_proj")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.alpha_proj = Linear(D, H * K, bias=True, init=self.init)
        self.beta_proj = Linear(D, H * V, bias=True, init=self.init)

    def log_decay(self, hidden: torch.Tensor, projected: Optional[dict[str, torch.Tensor]]) -> torch.Tensor:
        K, V = self.args.key_dim, self.args.value_dim
        alpha = log_sigmoid_gate(rearrange(self.project("alpha_proj", hidden, projected), "b t (h k) -> b t h k", k=K))
        beta = log_sigmoid_gate(rearrange(self.project("beta_proj", hidden, projected), "b t (h v) -> b t h v", v=V))
        return alpha[..., :, None] + beta[..., None, :]  # log(α^T β) = log α_k + log β_v


@register_mixer("gateloop")
class GateLoop(_GatedFastWeights):
    """GateLoop (real magnitudes): ``M_t = diag(σ(W_a x_t + b_a)) M_{t-1} + k_t^T v_t``.

    hidden ``[B, T, D]`` -> ``[B, T, D]``; the recurrence sees a log decay ``[B, T, H, K]`` (fp32).

    Example:
        >>> layer = GateLoop(MixerArgs(hidden_size=16, num_heads=2))
        >>> layer(torch.randn(1, 5, 16)).shape
        torch.Size([1, 5, 16])
    """

    memory_projections = ("k_proj", "v_proj", "a_proj")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K = args.hidden_size, args.num_heads, args.key_dim
        self.a_proj = Linear(D, H * K, bias=True, init=self.init)

    def log_decay(self, hidden: torch.Tensor, projected: Optional[dict[str, torch.Tensor]]) -> torch.Tensor:
        logits = rearrange(self.project("a_proj", hidden, projected), "b t (h k) -> b t h k", k=self.args.key_dim)
        return log_sigmoid_gate(logits)
