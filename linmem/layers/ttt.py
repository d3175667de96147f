"""TTT-Linear (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden States",
arXiv 2407.04620) on the delta rule's projections.

The hidden state is the weight ``W: [K, V]`` of the inner model ``f(x) = x + LN(x W)``; every token takes one
gradient step of the self-supervised loss, and the output is the inner model applied to the query::

    W_t = W_{t-1} - eta_t grad l(W_{t-1}; k_t, v_t),   l(W; k, v) = |k + k W - v|^2 / 2
        = W_{t-1} + eta_t k_t^T ((v_t - k_t) - k_t W_{t-1})
    z_t = q_t + LN_h(q_t W_t),   y = W_o RMSNorm_h(z)

that is the delta rule towards the residual target ``v - k`` (:func:`linmem.ops.linear_recurrence` with
``beta = eta``), LN_h the paper's per-head LayerNorm (weight and bias per channel, eps 1e-6). q, k, v as in
DeltaNet (short conv + SiLU, :class:`~linmem.layers.deltanet.DeltaNet`); the paper's keys are of norm about
``sqrt(K)`` and its rate ``eta_base sigmoid(W_eta x) / K`` (``eta_base = 1``): here q, k are scaled to norm
``sqrt(K)`` too, so ``eta_t k^T k`` is ``sigmoid(W_eta x_t)`` on unit keys and the recurrence runs on unit
keys with ``beta = sigmoid(W_eta x_t)`` (the same W_t up to the factor ``sqrt(K)``, which the read-out
takes back).

What differs from the paper, and why:

* **LN in the loss.** The paper's loss is ``|LN(k W) - (v - k)|^2``; its gradient in W is not linear in W
  (the norm divides by the statistics of ``k W``), so no linear recurrence carries it. Here the loss is the
  plain square (the update is linear in W) and LN is kept where it is exact: on the output ``f(q)``.
* **Online steps.** The paper takes one step per mini-batch of 16 tokens (all gradients at the batch's start,
  with learnt per-position rates); Linear-MoE's Table 1 form, kept here, takes one step per token (mini-batch 1).
* **Positions.** The paper's Transformer backbone puts RoPE on q and k; here the short convolutions carry
  position (as in its Mamba backbone); no output gate; ``expand_v`` must be 1 (the residual adds k to v).

In a mixture of memories the read-out residual is the routed weights' sum times q, and LN applies to the
mixed read-out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from .base import LayerState, MixerArgs, register_mixer
from .deltanet import _DeltaRule
from .norms import HeadGroupNorm
from .recurrent import RecurrenceArgs

#: epsilon of the inner model's LayerNorm (the paper's)
TTT_NORM_EPS = 1e-6


@register_mixer("ttt")
class TTTLinear(_DeltaRule):
    """TTT-Linear: hidden ``[B, T, D]`` -> ``[B, T, D]`` (see the module docstring).

    Example:
        >>> from linmem.layers import MixerArgs, build_mixer
        >>> layer = build_mixer("ttt", MixerArgs(hidden_size=32, num_heads=2))
        >>> layer(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    memory_projections = ("k_proj", "v_proj", "b_proj")

    def __init__(self, args: MixerArgs) -> None:
        super().__init__(args)
        self.ttt_norm = HeadGroupNorm(args.num_heads, args.value_dim, eps=TTT_NORM_EPS)

    @classmethod
    def validate_args(cls, args: MixerArgs) -> None:
        super().validate_args(args)
        if args.expand_v != 1:
            raise ValueError(f"{cls.name}: `expand_v` must be 1 (the inner model x + LN(x W) adds the key to the "
                             f"value), got {args.expand_v}")

    def recurrence_inputs(
        self,
        hidden: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        projected: Optional[dict[str, torch.Tensor]] = None,
    ) -> RecurrenceArgs:
        args = super().recurrence_inputs(hidden, cache=cache, cu_seqlens=cu_seqlens, projected=projected)
        root = self.args.key_dim**0.5  # the paper's keys and queries have norm about sqrt(K)
        return replace(args, v=args.v - root * args.k, scale=1.0, extras={"q": root * args.q})

    def output(self, o: torch.Tensor, hidden: torch.Tensor, args: RecurrenceArgs) -> torch.Tensor:
        z = args.extras["q"].to(o.dtype) + self.ttt_norm(o).view_as(o)  # f(q) = q + LN(q W)
        return super().output(z, hidden, args)
