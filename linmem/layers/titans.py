"""Titans' neural memory, linear (Behrouz et al. 2025, "Titans: Learning to Memorize at Test Time",
arXiv 2501.00663), on Gated DeltaNet's projections.

The memory ``M: [K, V]`` takes one gradient step per token on ``l(M; k, v) = |k M - v|^2 / 2``, decayed by
the forget gate ``a_t = 1 - alpha_t``::

    M_t = a_t M_{t-1} - theta_t grad l(M_{t-1}; k_t, v_t) = a_t M_{t-1} + theta_t k_t^T (v_t - k_t M_{t-1})
    o_t = q_t M_t / sqrt(K),   y = W_o (RMSNorm(o) * silu(W_g x))

q, k, v, the gate and the output as in :class:`~linmem.layers.deltanet.GatedDeltaNet` (short conv + SiLU, q
and k L2-normalised, as the paper's architecture), ``log a_t = -exp(A_log) softplus(W_a x_t + dt_bias)`` and
the inner learning rate ``theta_t = a_t sigmoid(W_b x_t)``: bounded by what the gate keeps, so that with unit
keys every step is a contraction (``a_t (1 - sigmoid)``). The paper asks only for a data-dependent
``theta_t``; this bound is what lets the rule run on the gated delta rule's kernels, exactly: the gradient is
taken at ``M_{t-1}``, not at the decayed ``a_t M_{t-1}`` as in Gated DeltaNet, and
``a M + theta k^T (v - k M) = S' + beta k^T (a v - k S')`` with ``S' = a M``, ``beta = theta / a``, so the
layer hands :func:`linmem.ops.linear_recurrence` the values ``a_t v_t`` and ``beta_t = sigmoid(W_b x_t)``.

``titans.momentum`` adds the paper's momentum (its "surprise", eqs. 13-14)::

    S_t = eta_t S_{t-1} - theta_t grad l(M_{t-1}; k_t, v_t),   M_t = a_t M_{t-1} + S_t,   eta_t = sigmoid(W_m x_t)

The state is then the pair ``(M, S)`` (cache ``recurrent`` and ``momentum``), which the unified recurrence
cannot carry: :func:`linmem.ops.titans_momentum` computes it (a chunked PyTorch form; ``backend="reference"``
runs its token loop). The paper's deeper memories (an MLP of two or more layers) and its persistent memory and
attention branches (MAC, MAG, MAL) are left out: this is the memory of Linear-MoE's Table 1. In a mixture of
memories the rule runs without momentum.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.titans import titans_momentum, titans_momentum_step
from .base import LayerState, MixerArgs, check_bool, register_mixer
from .deltanet import _DeltaRule
from .recurrent import RecurrenceArgs, run_recurrence, step_recurrence


@dataclass
class TitansArgs(MixerArgs):
    """:class:`MixerArgs` plus Titans' momentum switch."""

    momentum: bool = False  # the momentum S_t = eta_t S_{t-1} - theta_t grad (state: the pair (M, S))

    @classmethod
    def of(cls, args: MixerArgs) -> "TitansArgs":
        """``args`` itself if it is TitansArgs, else its MixerArgs fields without momentum."""
        if isinstance(args, TitansArgs):
            return args
        return cls(**{name: getattr(args, name) for name in MixerArgs.field_names()})

    def validate(self, owner: str = "titans") -> None:
        super().validate(owner)
        self.validate_options(owner)

    def validate_options(self, owner: str = "titans") -> None:
        """Check the momentum switch only (the field :class:`MixerArgs` lacks)."""
        check_bool(owner, "momentum", self.momentum)


@dataclass
class MomentumArgs(RecurrenceArgs):
    """:class:`RecurrenceArgs` plus the momentum gate (``beta`` is ``theta_t / a_t``)."""

    log_momentum: Optional[torch.Tensor] = None  # log eta [B, T, H] fp32
    rho: Optional[torch.Tensor] = None  # [B, T, H]: 1 at a token, 0 at padding (its momentum does not move M)

    def masked(self, token_mask: torch.Tensor) -> "MomentumArgs":
        """Padded tokens neither decay, nor write, nor move the memory by the momentum (eta = 1, rho = 0)."""
        keep = token_mask.to(self.rho.dtype)[..., None]
        return MomentumArgs(**{**vars(super().masked(token_mask)), "log_momentum": self.log_momentum * keep,
                               "rho": self.rho * keep})

    def as_steps(self) -> "MomentumArgs":
        return MomentumArgs(**{**vars(super().as_steps()), "log_momentum": self.log_momentum.flatten(0, 1),
                               "rho": self.rho.flatten(0, 1)})

    def momentum_kwargs(self) -> dict:
        """The keyword arguments of :func:`titans_momentum` / :func:`titans_momentum_step` besides q, k, v."""
        return dict(log_decay=self.log_decay, theta=self.log_decay.exp() * self.beta, log_momentum=self.log_momentum,
                    rho=self.rho, scale=self.scale)


@register_mixer("titans")
class TitansMemory(_DeltaRule):
    """Titans' linear memory: hidden ``[B, T, D]`` -> ``[B, T, D]`` (see the module docstring).

    Example:
        >>> from linmem.layers import build_mixer
        >>> layer = build_mixer("titans", TitansArgs(hidden_size=32, num_heads=2, momentum=True))
        >>> layer(torch.randn(2, 7, 32)).shape, layer.state_names
        (torch.Size([2, 7, 32]), ('recurrent', 'momentum'))
    """

    gated = True
    args_class = TitansArgs
    memory_projections = ("k_proj", "v_proj", "b_proj", "a_proj")

    def __init__(self, args: MixerArgs) -> None:
        args = TitansArgs.of(args)
        super().__init__(args)
        if args.momentum:
            self.m_proj = nn.Linear(args.hidden_size, args.num_heads, bias=False)
            self.state_names = ("recurrent", "momentum")

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        args = super().recurrence_inputs(hidden, cache=cache, cu_seqlens=cu_seqlens, projected=projected)
        if not self.args.momentum:
            return args
        log_momentum = F.logsigmoid(self.m_proj(hidden).float())  # [B, T, H]
        return MomentumArgs(**vars(args), log_momentum=log_momentum, rho=torch.ones_like(log_momentum))

    def fresh_state(self, rows: int, args: RecurrenceArgs) -> tuple[torch.Tensor, ...]:
        """``(M,)``, or ``(M, S)`` with momentum: zeros ``[rows, H, K, V]`` (fp32)."""
        M = super().fresh_state(rows, args)[0]
        return (M, torch.zeros_like(M)) if self.args.momentum else (M,)

    def run_memory(
        self,
        args: RecurrenceArgs,
        state: Optional[tuple[torch.Tensor, ...]],
        *,
        cu_seqlens: Optional[torch.Tensor],
        output_final_state: bool,
    ) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, ...]]]:
        if not self.args.momentum:
            return run_recurrence(_gradient_at_previous(args), state, cu_seqlens=cu_seqlens,
                                  output_final_state=output_final_state, backend=self.args.backend)
        return titans_momentum(args.q, args.k, args.v, **args.momentum_kwargs(), initial_state=state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               backend="reference" if self.args.backend == "reference" else "chunk")

    def step_memory(
        self, step: RecurrenceArgs, state: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if not self.args.momentum:
            return step_recurrence(_gradient_at_previous(step), state)
        return titans_momentum_step(step.q, step.k, step.v, state, **step.momentum_kwargs())


def _gradient_at_previous(args: RecurrenceArgs) -> RecurrenceArgs:
    """The gated delta rule's arguments of Titans' step ``a M + a beta k^T (v - k M)``: the values ``a v``."""
    a = args.log_decay.exp()[..., None]
    return replace(args, v=(a * args.v).to(args.v.dtype))
