"""Small modules shared by the mixers: norms, short causal convolution, token shift, RoPE.

The convolution and the token shift carry their own decoding history in a
:class:`~linmem.layers.base.LayerState` and never look across a ``cu_seqlens`` boundary.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import LayerState


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim (computed in fp32)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * silu(gate): the output norm of Mamba-2, GLA and Gated DeltaNet."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x).float() * F.silu(gate.float())).to(x.dtype)


def positions_in_sequence(T: int, cu_seqlens: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[T] position of every packed token inside its own sequence (arange without cu_seqlens)."""
    steps = torch.arange(T, device=device)
    if cu_seqlens is None:
        return steps
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    seq_id = torch.searchsorted(starts[1:], steps, right=True)
    return steps - starts[seq_id]


def causal_window(
    x: torch.Tensor, size: int, *, history: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The last ``size`` inputs at every step: x [B, T, C] -> [B, T, size, C] (oldest first).

    Before a sequence's start the window holds ``history`` ([B, size - 1, C], from a
    cache) or zeros; with ``cu_seqlens`` it never reaches into the previous sequence.
    """
    B, T, C = x.shape
    if history is None:
        history = x.new_zeros(B, size - 1, C)
    padded = torch.cat([history.to(x.dtype), x], dim=1)  # [B, size - 1 + T, C]
    window = padded.unfold(1, size, 1).movedim(-1, 2)  # [B, T, size, C]
    if cu_seqlens is not None:
        pos = positions_in_sequence(T, cu_seqlens, x.device)  # [T]
        lag = torch.arange(size - 1, -1, -1, device=x.device)  # lag of each window slot
        window = window * (lag[None, :] <= pos[:, None]).to(x.dtype)[None, :, :, None]
    return window


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over time (kernel ``size``) with an optional SiLU.

    Its decoding history (the last ``size - 1`` inputs) lives in ``cache[key]``.
    """

    def __init__(self, channels: int, size: int = 4, activation: bool = True) -> None:
        super().__init__()
        self.size = size
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, size))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as nn.Conv1d, fan-in = size
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: Optional[LayerState] = None,
        key: str = "conv",
        cu_seqlens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        history = cache.get(key) if cache is not None else None
        past = history.to(x.dtype) if history is not None else x.new_zeros(x.shape[0], self.size - 1, x.shape[2])
        seen = torch.cat([past, x], dim=1)  # [B, size - 1 + T, C]
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        if cu_seqlens is None:  # one depthwise conv1d
            y = F.conv1d(seen.transpose(1, 2), weight[:, None, :], bias, groups=x.shape[2]).transpose(1, 2)
        else:  # packed sequences: windows that stop at each sequence start
            window = causal_window(x, self.size, history=history, cu_seqlens=cu_seqlens)
            y = torch.einsum("btwc,cw->btc", window, weight) + bias
        if cache is not None and self.size > 1:
            cache.set(key, seen[:, -(self.size - 1):].detach())
        return F.silu(y) if self.activation else y


def token_shift(
    x: torch.Tensor, *, cache: Optional[LayerState] = None, key: str = "shift",
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The previous token's features: x [B, T, C] -> x_{t-1} [B, T, C] (zeros at a sequence start).

    The last token is kept in ``cache[key]`` for the next call.
    """
    history = cache.get(key) if cache is not None else None
    previous = causal_window(x, 2, history=history, cu_seqlens=cu_seqlens)[:, :, 0]
    if cache is not None:
        cache.set(key, x[:, -1:].detach())
    return previous


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form) for q, k: [B, T, H, D].

    The frequencies are computed in ``forward`` rather than stored in a buffer, so a
    model built on the meta device (as ``from_pretrained`` does) has nothing to restore.
    """

    def __init__(self, dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.theta = dim, theta

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H, D], position_ids: [B, T] -> rotated x."""
        steps = torch.arange(0, self.dim, 2, dtype=torch.float32, device=x.device)
        inv_freq = 1.0 / (self.theta ** (steps / self.dim))
        angles = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, :, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, :, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x.float() * cos + rotated * sin).to(x.dtype)
