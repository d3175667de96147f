"""Modules and initialisers shared by the mixers: linear maps that carry their initialisation, norms,
short causal convolutions, token shift, RoPE, the low-rank projections of RWKV, the Mamba-2 gate init.

Every module with parameters has ``reset_parameters()``. Its constructor calls it, and the model calls
it again for parameters a checkpoint does not hold, so a loaded model and a new one start alike. A
``reset_parameters`` sets what the constructor sets: the module's own parameters and those of children
that have no ``reset_parameters`` of their own (a :class:`LoRA`); never a child that has one (a child
``nn.Linear`` initialises itself: give it its scheme as :class:`Linear` ``init``).

The convolution and the token shift carry their own decoding history in a
:class:`~linmem.layers.base.LayerState` and never look across a ``cu_seqlens`` boundary.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .base import LayerState, MixerArgs

# ---------------------------------------------------------------- initialisation

#: a weight initialiser: fills the tensor in place
Init = Callable[[torch.Tensor], object]


def _torch_init(name: str, tensor: torch.Tensor, **kwargs: float) -> object:
    # looked up at call time, so that callers who patch torch.nn.init (transformers' loading) see it
    return getattr(nn.init, name)(tensor, **kwargs)


def normal_init(std: float) -> Init:
    """N(0, std^2) weights."""
    return partial(_torch_init, "normal_", std=std)


def xavier_init(gain: float = 1.0) -> Init:
    """Xavier-uniform weights with ``gain``."""
    return partial(_torch_init, "xavier_uniform_", gain=gain)


def orthogonal_init(gain: float = 1.0) -> Init:
    """(Semi-)orthogonal weights scaled by ``gain``."""
    return partial(_torch_init, "orthogonal_", gain=gain)


def zeros_init() -> Init:
    """All-zero weights."""
    return partial(_torch_init, "zeros_")


class Linear(nn.Linear):
    """``nn.Linear`` whose weight starts as ``init`` says (its bias at zero); ``init=None`` keeps
    torch's default (Kaiming-uniform weight, uniform bias). x ``[..., d_in]`` -> ``[..., d_out]``.

    Example:
        >>> Linear(16, 8, init=normal_init(0.02))(torch.randn(3, 16)).shape
        torch.Size([3, 8])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, init: Optional[Init] = None) -> None:
        self.init = init  # set before nn.Linear.__init__, which calls reset_parameters
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        if self.init is None:
            super().reset_parameters()
            return
        self.init(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def low_rank(d_in: int, rank: int, d_out: int, *, bias: bool = False, init: Optional[Init] = None) -> nn.Sequential:
    """``W_up W_down x`` as two linear maps ``[d_in -> rank -> d_out]`` (the up map may have a bias)."""
    return nn.Sequential(Linear(d_in, rank, init=init), Linear(rank, d_out, bias=bias, init=init))


def mamba2_dt_bias(shape: tuple[int, ...] | int, dt_min: float = 1e-3, dt_max: float = 0.1,
                   device: Optional[torch.device] = None) -> torch.Tensor:
    """Inverse-softplus of dt drawn log-uniformly in [dt_min, dt_max] (Mamba-2's initialisation)."""
    u = torch.rand(shape, device=device)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


#: range of the initial A = exp(A_log) of Mamba-2-style decays, drawn uniformly per head (A_init_range)
A_INIT_RANGE = (1.0, 16.0)


def mamba2_a_log(shape: tuple[int, ...] | int, device: Optional[torch.device] = None) -> torch.Tensor:
    """log A with A uniform in :data:`A_INIT_RANGE` (Mamba-2, Gated DeltaNet, KDA)."""
    return torch.empty(shape, device=device).uniform_(*A_INIT_RANGE).log()


@torch.no_grad()
def init_mamba2_gate_(A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """Mamba-2's init of a decay ``-exp(A_log) * softplus(. + dt_bias)`` (Mamba-2, Gated DeltaNet, KDA)."""
    A_log.copy_(mamba2_a_log(A_log.shape, device=A_log.device))
    dt_bias.copy_(mamba2_dt_bias(dt_bias.shape, device=dt_bias.device))


# ---------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim (computed in fp32); weight ``[dim]`` starts at 1.

    ``num_heads`` gives every head its own weight (``[num_heads, dim]``) for x ``[..., H, dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, num_heads: Optional[int] = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim) if num_heads is None else torch.empty(num_heads, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


#: output-gate activations of :class:`GatedRMSNorm`
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * act(gate), act = silu (Mamba-2, GLA, Gated DeltaNet) or sigmoid (KDA)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__(dim, eps)
        self.activation = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x).float() * self.activation(gate.float())).to(x.dtype)


#: epsilon of RWKV's per-head output GroupNorm (1e-5 * head_size_divisor**2 with divisor 8)
GROUP_NORM_EPS = 64e-5


class HeadGroupNorm(nn.Module):
    """LayerNorm of each head's output (GroupNorm with one group per head), in fp32 (fp64 for fp64).

    o: [B, T, H, V] -> [B, T, H * V]; the affine weight starts at ``weight``, the bias at 0.
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = GROUP_NORM_EPS, weight: float = 1.0) -> None:
        super().__init__()
        self.num_heads, self.eps, self.initial_weight = num_heads, eps, float(weight)
        self.weight = nn.Parameter(torch.empty(num_heads * head_dim))
        self.bias = nn.Parameter(torch.empty(num_heads * head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.initial_weight)
        nn.init.zeros_(self.bias)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B, T, H, V] -> [B, T, H * V]."""
        B, T = o.shape[:2]
        acc = torch.promote_types(o.dtype, torch.float32)
        flat = rearrange(o, "b t h v -> (b t) (h v)").to(acc)
        y = F.group_norm(flat, self.num_heads, self.weight.to(acc), self.bias.to(acc), self.eps)
        return y.view(B, T, -1).to(o.dtype)


# ---------------------------------------------------------------- time: convolution, shift, positions


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


# ---------------------------------------------------------------- RWKV's low-rank projections and init schedules


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
