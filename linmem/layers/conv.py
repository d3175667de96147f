"""Time in the layers: the short causal convolutions (the fused op on CUDA) and the token shift.

Both carry their own decoding history in a :class:`~linmem.layers.base.LayerState` and never look across a
``cu_seqlens`` boundary, except that under sequence parallelism the first packed sequence continues the previous
rank's tokens.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import parallel
from ..ops.fused import short_conv, short_conv_step
from ..ops.varlen import positions_in_sequence
from .base import LayerState, MixerArgs


def causal_window(
    x: torch.Tensor, size: int, *, history: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The last ``size`` inputs at every step: x [B, T, C] -> [B, T, size, C] (oldest first).

    Before a sequence's start the window holds ``history`` ([B, size - 1, C], from a cache or, under
    sequence parallelism, the previous rank's last tokens) or zeros. With ``cu_seqlens`` it never reaches
    into the previous sequence: only the first packed sequence continues ``history``, the others see zeros.
    """
    B, T, C = x.shape
    if history is None:
        history = x.new_zeros(B, size - 1, C)
    padded = torch.cat([history.to(x.dtype), x], dim=1)  # [B, size - 1 + T, C]
    window = padded.unfold(1, size, 1).movedim(-1, 2)  # [B, T, size, C]
    if cu_seqlens is not None:
        pos = positions_in_sequence(T, cu_seqlens, x.device)  # [T]
        lag = torch.arange(size - 1, -1, -1, device=x.device)  # lag of each window slot
        first = torch.arange(T, device=x.device) < cu_seqlens[1]  # tokens of the first sequence
        keep = (lag[None, :] <= pos[:, None]) | first[:, None]  # [T, size]
        window = window * keep.to(x.dtype)[None, :, :, None]
    return window


def fused_conv(x: torch.Tensor) -> bool:
    """Whether :class:`ShortConvolution` runs the fused kernels (:func:`linmem.ops.fused.short_conv`) on x:
    on CUDA. Elsewhere it sums its taps in PyTorch, which is faster on a CPU than the op's literal reference."""
    return x.device.type == "cuda"


def _taps_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, history: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution as a sum of its W taps (no activation), computed in fp32 (fp64 for
    fp64): x [B, T, C], weight [C, W], history [B, W-1, C] or None -> (z [B, T, C], the inputs with the
    history in front [B, W-1 + T, C]).

    With ``cu_seqlens`` the taps stop at every sequence start, but the first sequence continues ``history``.
    """
    B, T, C = x.shape
    W = weight.shape[1]
    past = history.to(x.dtype) if history is not None else x.new_zeros(B, W - 1, C)
    seen = torch.cat([past, x], dim=1)  # [B, W - 1 + T, C]
    acc = torch.promote_types(x.dtype, torch.float32)
    if cu_seqlens is not None:
        pos = positions_in_sequence(T, cu_seqlens, x.device)  # [T]
        first = torch.arange(T, device=x.device) < cu_seqlens[1]  # the first sequence reads the history
    z = bias.to(acc)
    for i in range(W):  # tap i reads x_(t - lag), lag = W - 1 - i
        term = seen[:, i:i + T] * weight[:, i].to(acc)
        lag = W - 1 - i
        if cu_seqlens is not None and lag:
            term = term * ((pos >= lag) | first).to(acc)[:, None]
        z = z + term
    return z, seen


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over time (kernel ``size``) with an optional SiLU.

    Its decoding history (the last ``size - 1`` inputs, ``[B, size - 1, C]``) lives in ``cache[key]``;
    a one-token step without gradients shifts it in place. Under sequence parallelism (no cache) the
    history is the previous rank's last ``size - 1`` tokens, which only the first packed sequence reads.
    """

    def __init__(self, channels: int, size: int = 4, activation: bool = True) -> None:
        super().__init__()
        self.size = size
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, size))
        self.bias = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as nn.Conv1d, fan-in = size
        nn.init.zeros_(self.bias)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: Optional[LayerState] = None,
        key: str = "conv",
        cu_seqlens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C] in x's dtype."""
        act = "silu" if self.activation else None
        B, T, C = x.shape
        history = cache.get(key) if cache is not None else None
        if cache is None and (handler := parallel.sequence_handler()) is not None:
            history = handler.halo(x, self.size - 1, cu_seqlens)  # [B, size - 1, C]
        if cache is not None and T == 1 and cu_seqlens is None and not torch.is_grad_enabled():  # decoding
            if history is None:
                history = x.new_zeros(B, self.size - 1, C)
                cache.set(key, history)
            return short_conv_step(x[:, 0], history, self.weight, self.bias, act)[:, None]
        if fused_conv(x):
            if history is not None and cu_seqlens is not None:  # sequences after the first start from zeros
                history = torch.cat([history, history.new_zeros(cu_seqlens.shape[0] - 2, *history.shape[1:])])
            y, final = short_conv(x, self.weight, self.bias, activation=act, cu_seqlens=cu_seqlens,
                                  initial_state=history, output_final_state=cache is not None)
        else:
            z, seen = _taps_conv(x, self.weight, self.bias, history, cu_seqlens)
            y = (F.silu(z) if self.activation else z).to(x.dtype)
            final = seen[:, T:]
        if cache is not None:  # in its own contiguous memory: decoding shifts it in place
            cache.set(key, final.detach().clone(memory_format=torch.contiguous_format))
        return y


class ShortConvs(nn.ModuleDict):
    """Optional short causal convolutions (each ending in a SiLU) on named projections.

    When ``MixerArgs.use_short_conv`` (or ``default`` where it is None) is off there are none,
    and ``activation`` is applied in their place. The decoding history of projection ``name``
    lives in ``cache["conv_<name>"]``.
    """

    def __init__(self, channels: dict[str, int], args: MixerArgs, default: bool = False) -> None:
        enabled = default if args.use_short_conv is None else args.use_short_conv
        super().__init__({n: ShortConvolution(c, args.conv_size) for n, c in channels.items()} if enabled else {})

    def forward(
        self,
        name: str,
        x: torch.Tensor,
        *,
        cache: Optional[LayerState],
        cu_seqlens: Optional[torch.Tensor],
        activation: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]."""
        if name in self:
            return self[name](x, cache=cache, key=f"conv_{name}", cu_seqlens=cu_seqlens)
        return x if activation is None else activation(x)


def token_shift(
    x: torch.Tensor, *, cache: Optional[LayerState] = None, key: str = "shift",
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The previous token's features: x [B, T, C] -> x_{t-1} [B, T, C] (zeros at a sequence start).

    The last token is kept in ``cache[key]`` for the next call. Under sequence parallelism (no cache)
    the first packed sequence continues the previous rank's last token.
    """
    history = cache.get(key) if cache is not None else None
    if cache is None and (handler := parallel.sequence_handler()) is not None:
        history = handler.halo(x, 1, cu_seqlens)  # [B, 1, C]
    previous = causal_window(x, 2, history=history, cu_seqlens=cu_seqlens)[:, :, 0]
    if cache is not None:
        cache.set(key, x[:, -1:].detach())
    return previous
