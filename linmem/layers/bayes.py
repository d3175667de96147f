"""The Bayesian memory layer (Dowling et al. 2026, "Memory by Design: Probabilistic Sequence Layers",
arXiv 2605.31163): Gated DeltaNet's projections around an exact Kalman filter over the memory.

Per head the memory is a Gaussian belief over ``W: [K, V]``: a mean ``M`` and a covariance ``P: [K, K]``
(:func:`linmem.ops.bayes_filter`). Per token, with the projections of Gated DeltaNet::

    q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x));   q, k L2-normalised per head
    log a_t = -exp(A_log) * softplus(W_a x_t + dt_bias)                  Mamba-2 scalar decay
    r_t     = r_h * exp(-b_t),   b_t = W_b x_t                          observation noise
    Q_t     = q_h * (1 - a_t^2)                                          process noise
    P^- = a^2 P + Q_t I,  u = P^- k,  s = k.u + r_t,  M = a M + u (v - (a M)^T k)^T / s,  P = P^- - u u^T / s
    y_t = W_o (RMSNorm(M^T q / sqrt(K)) * SiLU(W_g x_t))

``r_h = softplus(obs_noise_raw_h)`` and ``q_h = softplus(process_noise_raw_h)`` are learned per head;
a fresh sequence starts from ``M = 0``, ``P = I``. Why so:

* **The prior is the unit.** Scaling the prior, r and Q together leaves the mean (the layer's output)
  unchanged and scales P, so one of the three is fixed: ``p = 1``; ``r_h`` and ``q_h`` are relative to it.
* **r_t carries Gated DeltaNet's write strength.** With the covariance reset to ``p I`` at every step the
  filter is the gated delta rule with ``beta = p / (p + r_t) = sigmoid(b_t - log r_h)`` (unit keys), so
  ``W_b`` plays Gated DeltaNet's beta projection, and ``r_h = 1`` at init makes the reset layer Gated
  DeltaNet with the same weights (a fresh direction takes half of the innovation, ``beta = 1/2``).
  ``b_t`` is clamped to +-:data:`LOGIT_LIMIT` (beta within 5e-5 of 0 or 1) so that r stays finite and > 0.
* **Q_t keeps the prior stationary.** With ``q_h = 1`` (the init) the dynamics
  ``W_t = a_t W_{t-1} + noise(Q_t)`` leave a direction nothing wrote at variance ``p``: the memory forgets
  its confidence as it forgets its contents, at the rate of the decay; ``q_h > 1`` re-opens written
  directions faster, ``q_h < 1`` keeps them. A head that does not decay keeps its confidence (ridge
  regression).

The cache holds the mean as ``recurrent: [B, H, K, V]`` and the covariance as ``covariance:
[B, H, K, K]`` (fp32); decoding updates both in place (:func:`linmem.ops.bayes_filter_step`).
``use_short_conv=False`` drops the convolutions and keeps the SiLU (the paper's Block-MQAR layer). In a
mixture of memories each memory owns its k, v, b and decay projections; the noise parameters are shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops import bayes_filter, bayes_filter_step
from ..ops.bayes import BACKENDS
from .base import LayerState, MixerArgs, check_choice, register_mixer
from .conv import ShortConvs
from .init import init_mamba2_gate_
from .norms import GatedRMSNorm
from .recurrent import MemoryMixer, RecurrenceArgs

#: |b_t| is clamped to this before r_t = r_h exp(-b_t)
LOGIT_LIMIT = 10.0
#: the backends of :func:`linmem.ops.bayes_filter` the layer runs ("delta" is the covariance-reset filter only;
#: "chunk" has no decoding step in :func:`linmem.ops.bayes_filter_step`; "chunk_triton" decodes with "triton")
LAYER_BACKENDS = tuple(b for b in BACKENDS if b not in ("delta", "chunk"))
#: the decoding step's backend for a layer backend that has no step of its own
STEP_BACKEND = {"chunk_triton": "triton"}
#: softplus^-1(1): the raw value of a noise parameter that starts at 1
SOFTPLUS_INV_ONE = math.log(math.e - 1.0)


@dataclass
class FilterArgs(RecurrenceArgs):
    """:class:`RecurrenceArgs` plus the filter's noises (the ``beta``, ``bonus``, ``a``, ``b`` fields stay None)."""

    obs_noise: Optional[torch.Tensor] = None  # r [B, T, H] fp32, > 0
    process_noise: Optional[torch.Tensor] = None  # Q [B, T, H] fp32, >= 0

    def masked(self, token_mask: torch.Tensor) -> "FilterArgs":
        """Padded tokens neither decay, nor gain process noise, nor write (k = 0 leaves M and P as they are)."""
        base = super().masked(token_mask)
        keep = token_mask.to(self.process_noise.dtype)
        process_noise = self.process_noise * keep[..., None]
        return FilterArgs(**{**vars(base), "obs_noise": self.obs_noise, "process_noise": process_noise})

    def as_steps(self) -> "FilterArgs":
        base = super().as_steps()
        return FilterArgs(**{**vars(base), "obs_noise": self.obs_noise.flatten(0, 1),
                             "process_noise": self.process_noise.flatten(0, 1)})

    def filter_kwargs(self) -> dict:
        """The keyword arguments of :func:`bayes_filter` / :func:`bayes_filter_step` besides q, k, v."""
        return dict(log_decay=self.log_decay, obs_noise=self.obs_noise, process_noise=self.process_noise,
                    scale=self.scale)


@register_mixer("bayes")
class BayesianMemory(MemoryMixer):
    """The Bayesian memory layer: hidden ``[B, T, D]`` -> ``[B, T, D]`` (see the module docstring).

    The filter sees q, k ``[B, T, H, K]`` (unit norm), v ``[B, T, H, V]`` and the decay, observation
    and process noise ``[B, T, H]`` (fp32). ``MixerArgs.backend`` picks the filter's backend: "auto"
    (the fused Triton kernels on CUDA for K <= 128, chunked where they serve the inputs; the token loop
    elsewhere), "chunk_triton" (chunked kernels; the decoding step takes "triton"), "triton" or "reference".

    Example:
        >>> from linmem.layers import MixerArgs, build_mixer
        >>> layer = build_mixer("bayes", MixerArgs(hidden_size=32, num_heads=2))
        >>> layer(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    memory_projections = ("k_proj", "v_proj", "b_proj", "a_proj")
    state_names = ("recurrent", "covariance")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        D, H, K, V = args.hidden_size, args.num_heads, args.key_dim, args.value_dim
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.convs = ShortConvs({"q": H * K, "k": H * K, "v": H * V}, args, default=True)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.a_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.obs_noise_raw = nn.Parameter(torch.empty(H))  # r_h = softplus(.)
        self.process_noise_raw = nn.Parameter(torch.empty(H))  # q_h = softplus(.)
        self.g_proj = nn.Linear(D, H * V, bias=False)
        self.o_norm = GatedRMSNorm(V, eps=args.norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        self.reset_parameters()

    @classmethod
    def validate_args(cls, args: MixerArgs) -> None:
        super().validate_args(args)
        check_choice(cls.name, "backend", args.backend, LAYER_BACKENDS)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init_mamba2_gate_(self.A_log, self.dt_bias)
        self.obs_noise_raw.fill_(SOFTPLUS_INV_ONE)
        self.process_noise_raw.fill_(SOFTPLUS_INV_ONE)

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> FilterArgs:
        q, k, v = self.convolved_qkv(hidden, cache=cache, cu_seqlens=cu_seqlens, projected=projected,
                                     activation=F.silu)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        dt = F.softplus(self.project("a_proj", hidden, projected).float() + self.dt_bias.float())
        log_decay = -torch.exp(self.A_log.float()) * dt  # [B, T, H]
        b = self.project("b_proj", hidden, projected).float().clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
        obs_noise = F.softplus(self.obs_noise_raw.float()) * torch.exp(-b)  # [B, T, H]
        process_noise = F.softplus(self.process_noise_raw.float()) * -torch.expm1(2 * log_decay)  # q_h (1 - a^2)
        return FilterArgs(q=q, k=k, v=v, log_decay=log_decay, obs_noise=obs_noise, process_noise=process_noise)

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        gate = rearrange(self.g_proj(hidden), "b t (h d) -> b t h d", d=self.args.value_dim)
        return self.o_proj(rearrange(self.o_norm(o, gate), "b t h d -> b t (h d)"))

    # ---------------------------------------------------------------- the state: mean and covariance

    def fresh_state(self, rows: int, args: RecurrenceArgs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(M [rows, H, K, V] = 0, P [rows, H, K, K] = I)`` fp32: the prior of a fresh sequence."""
        H, K, V = args.q.shape[2], args.q.shape[3], args.v.shape[3]
        acc = torch.promote_types(args.q.dtype, torch.float32)
        eye = torch.eye(K, dtype=acc, device=args.q.device)
        return torch.zeros(rows, H, K, V, dtype=acc, device=args.q.device), eye.repeat(rows, H, 1, 1)

    def run_memory(
        self,
        args: FilterArgs,
        state: Optional[tuple[torch.Tensor, ...]],
        *,
        cu_seqlens: Optional[torch.Tensor],
        output_final_state: bool,
    ) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, ...]]]:
        o, _, final = bayes_filter(args.q, args.k, args.v, **args.filter_kwargs(), initial_state=state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                   backend=self.args.backend)
        return o, final

    def step_memory(
        self, step: FilterArgs, state: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        o, _, state = bayes_filter_step(step.q, step.k, step.v, state, **step.filter_kwargs(),
                                        backend=STEP_BACKEND.get(self.args.backend, self.args.backend))
        return o, state

