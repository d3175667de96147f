"""Rotary position embedding for the attention layers (:func:`linmem.ops.fused.rotary`), with a pretrained
checkpoint's frequency scaling where it has one."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.fused import rotary


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form, as Llama) for q, k: [B, T, H, D] (:func:`linmem.ops.fused.rotary`:
    one kernel for q and k on CUDA, the PyTorch form elsewhere or with a frequency ``scaling``).

    ``scaling`` is a checkpoint's RoPE scaling (``{"rope_type": "linear" | "llama3", ...}``, see
    :func:`linmem.ops.fused.reference.rope_frequencies`) or None. The frequencies are computed on the fly rather
    than stored in a buffer, so a model built on the meta device (as ``from_pretrained`` does) has nothing to
    restore.

    Example:
        >>> rope = RotaryEmbedding(16, scaling={"rope_type": "linear", "factor": 2.0})
        >>> q, k = rope.pair(torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16), torch.arange(5).expand(2, 5))
        >>> q.shape, k.shape
        (torch.Size([2, 5, 4, 16]), torch.Size([2, 5, 2, 16]))
    """

    def __init__(self, dim: int, theta: float = 10000.0, scaling: Optional[dict] = None) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling = dim, theta, scaling

    def pair(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [B, T, H, D], k: [B, T, Hkv, D], position_ids: [B, T] -> rotated (q, k), in one launch."""
        self._check_dim(q)
        return rotary(q, k, position_ids, theta=self.theta, scaling=self.scaling)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H, D], position_ids: [B, T] -> rotated x."""
        self._check_dim(x)
        return rotary(x, None, position_ids, theta=self.theta, scaling=self.scaling)[0]

    def _check_dim(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RotaryEmbedding: built for head dim {self.dim}, got a tensor of shape {list(x.shape)}")
