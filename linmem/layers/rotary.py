"""Rotary position embedding for the attention layers (:func:`linmem.ops.fused.rotary`)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.fused import rotary


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form) for q, k: [B, T, H, D] (:func:`linmem.ops.fused.rotary`:
    one kernel for q and k on CUDA, the PyTorch form elsewhere).

    The frequencies are computed on the fly rather than stored in a buffer, so a model built on the meta
    device (as ``from_pretrained`` does) has nothing to restore.
    """

    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.theta = dim, theta

    def pair(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [B, T, H, D], k: [B, T, Hkv, D], position_ids: [B, T] -> rotated (q, k), in one launch."""
        self._check_dim(q)
        return rotary(q, k, position_ids, theta=self.theta)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H, D], position_ids: [B, T] -> rotated x."""
        self._check_dim(x)
        return rotary(x, None, position_ids, theta=self.theta)[0]

    def _check_dim(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RotaryEmbedding: built for head dim {self.dim}, got a tensor of shape {list(x.shape)}")
