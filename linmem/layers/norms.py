"""The layers' norms: RMSNorm (with the residual add), the gated RMSNorm of the output gates and the per-head
GroupNorm of RWKV. The RMSNorms run the fused kernels of :mod:`linmem.ops.fused` on CUDA."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops.fused import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim (fp32 statistics, x's dtype out); weight ``[dim]`` starts at 1.

    ``num_heads`` gives every head its own weight (``[num_heads, dim]``) for x ``[..., H, dim]``.
    One fused kernel each way on CUDA (:func:`linmem.ops.fused.rms_norm`); the backward saves only x.
    """

    def __init__(self, dim: int, eps: float = 1e-6, num_heads: Optional[int] = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim) if num_heads is None else torch.empty(num_heads, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] (or [..., H, dim]) -> the same shape."""
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], *,
                     out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm residual step in one pass: h = x + residual (x when None) -> (RMSNorm(h), h).

        x, residual: [..., dim]. h keeps the residual's dtype (under autocast an fp32 stream) and RMSNorm(h) comes
        in ``out_dtype``, x's when None: a block's bf16 output under autocast gives its successor bf16 inputs,
        which the projections would otherwise cast once each.
        """
        return rms_norm(x, self.weight, self.eps, residual=residual, residual_out=True, out_dtype=out_dtype)


#: output-gate activations of :class:`GatedRMSNorm`
GATE_ACTIVATIONS = ("silu", "sigmoid")


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * act(gate) in fp32, act = silu (Mamba-2, GLA, Gated DeltaNet) or sigmoid (KDA); one fused
    kernel each way on CUDA (:func:`linmem.ops.fused.gated_rms_norm`), saving only x and gate."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__(dim, eps)
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"GatedRMSNorm: `activation` must be one of {GATE_ACTIVATIONS}, got {activation!r}")
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        return gated_rms_norm(x, gate, self.weight, self.eps, activation=self.activation)


#: epsilon of RWKV's per-head output GroupNorm (1e-5 * head_size_divisor**2 with divisor 8)
GROUP_NORM_EPS = 64e-5


class HeadGroupNorm(nn.Module):
    """LayerNorm of each head's output (GroupNorm with one group per head), in fp32 (fp64 for fp64).

    o: [B, T, H, V] -> [B, T, H * V]; the affine weight starts at ``weight``, the bias at 0.
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = GROUP_NORM_EPS, weight: float = 1.0) -> None:
        super().__init__()
        self.eps, self.initial_weight = eps, float(weight)
        self.weight = nn.Parameter(torch.empty(num_heads * head_dim))
        self.bias = nn.Parameter(torch.empty(num_heads * head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.initial_weight)
        nn.init.zeros_(self.bias)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B, T, H, V] -> [B, T, H * V]."""
        B, T, H = o.shape[:3]  # H: all heads, or a tensor-parallel share (with the weight's share)
        acc = torch.promote_types(o.dtype, torch.float32)
        flat = rearrange(o, "b t h v -> (b t) (h v)").to(acc)
        y = F.group_norm(flat, H, self.weight.to(acc), self.bias.to(acc), self.eps)
        return y.view(B, T, -1).to(o.dtype)
