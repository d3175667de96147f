"""RWKV's low-rank projections and the init schedules over depth and channels of RWKV-6/7."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .base import MixerArgs


class LoRA(nn.Module):
    """The low-rank projection of RWKV-6/7: ``x -> bias + act(x A) B``, x: [..., d_in] -> [..., d_out].

    It has no ``reset_parameters``: its owner sets ``A``, ``B`` and ``bias`` (RWKV's inits
    depend on the layer and the channel).
    """

    def __init__(
        self,
        d_in: int,
        rank: int,
        d_out: int,
        activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = torch.tanh,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.A = nn.Parameter(torch.empty(d_in, rank))
        self.B = nn.Parameter(torch.empty(rank, d_out))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., d_in] -> [..., d_out]."""
        h = x @ self.A.to(x.dtype)
        if self.activation is not None:
            h = self.activation(h)
        y = h @ self.B.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def layer_ratios(args: MixerArgs) -> tuple[float, float]:
    """The RWKV init schedules over depth: (0 -> 1, 1 -> almost 0) from the first to the last layer."""
    ratio_0_to_1 = args.layer_idx / max(args.num_layers - 1, 1)
    ratio_1_to_almost_0 = 1.0 - args.layer_idx / args.num_layers
    return ratio_0_to_1, ratio_1_to_almost_0


def channel_fraction(n: int, denominator: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """[n] tensor i / denominator, the channel ramp the RWKV inits are built from."""
    return torch.arange(n, dtype=torch.float32, device=device) / max(denominator, 1)
