"""Modules and initialisers shared by the mixers: linear maps that carry their initialisation, norms,
short causal convolutions, token shift, RoPE, the low-rank projections of RWKV, the Mamba-2 gate init.

Every module with parameters has ``reset_parameters()``. Its constructor calls it, and the model calls
it again for parameters a checkpoint does not hold, so a loaded model and a new one start alike. A
``reset_parameters`` sets what the constructor sets: the module's own parameters and those of children
that have no ``reset_parameters`` of their own (a :class:`LoRA`); never a child that has one (a child
``nn.Linear`` initialises itself: give it its scheme as :class:`Linear` ``init``).

The norms, the short convolution and the SwiGLU of the layers run the fused kernels of
:mod:`linmem.ops.fused` on CUDA. The convolution and the token shift carry their own decoding history
in a :class:`~linmem.layers.base.LayerState` and never look across a ``cu_seqlens`` boundary, except
that under sequence parallelism the first packed sequence continues the previous rank's tokens.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops import parallel
from ..ops.fused import gated_rms_norm, rms_norm, rotary, short_conv, short_conv_step
from ..ops.varlen import positions_in_sequence
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


# ---------------------------------------------------------------- gates that keep only their input for the backward


class _Pointwise(torch.autograd.Function):
    """y = f(x) saving only x; the backward multiplies by df(x), recomputed."""

    @staticmethod
    def forward(ctx, x, f, df):
        ctx.save_for_backward(x)
        ctx.df = df
        return f(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return (dy * ctx.df(x)).to(x.dtype), None, None


def pointwise(
    x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor], df: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """An elementwise gate ``f(x)`` (e.g. fp32 log-space decays of a bf16 projection) whose backward recomputes
    the derivative ``df(x)`` from x: only x is kept, in its own dtype, not f's fp32 intermediates.

    Under ``torch.compile`` this is f(x) (the compiler chooses what to recompute itself).

    Example:
        >>> x = torch.randn(3, requires_grad=True)
        >>> y = pointwise(x, F.logsigmoid, lambda t: torch.sigmoid(-t))
        >>> torch.allclose(y, F.logsigmoid(x))
        True
    """
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad):
        return f(x)
    return _Pointwise.apply(x, f, df)


def _mamba2_decay(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z = x + dt_bias, -exp(A_log) per head) in fp32 (fp64 for fp64 x): x [..., H, K], A_log [H], dt_bias [H, K]."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return x.to(acc) + dt_bias.to(acc), -torch.exp(A_log.to(acc))[:, None]


class _Mamba2LogDecay(torch.autograd.Function):
    """log a = -exp(A_log) * softplus(x + dt_bias), saving x, A_log and dt_bias only."""

    @staticmethod
    def forward(ctx, x, A_log, dt_bias):
        ctx.save_for_backward(x, A_log, dt_bias)
        z, minus_a = _mamba2_decay(x, A_log, dt_bias)
        return minus_a * F.softplus(z)

    @staticmethod
    def backward(ctx, dy):
        x, A_log, dt_bias = ctx.saved_tensors
        z, minus_a = _mamba2_decay(x, A_log, dt_bias)
        dz = dy * minus_a * torch.sigmoid(z)  # [..., H, K]
        batch = tuple(range(dz.dim() - 2))
        dA_log = (dy * minus_a * F.softplus(z)).sum(batch).sum(-1)  # d/dA_log of -exp(A_log) s = the output
        return dz.to(x.dtype), dA_log.to(A_log.dtype), dz.sum(batch).to(dt_bias.dtype)


def mamba2_log_decay(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The Mamba-2 decay ``log a = -exp(A_log) * softplus(x + dt_bias)`` (<= 0) in fp32 (fp64 for fp64 x):
    x ``[..., H, K]`` (K = 1: one gate per head), A_log ``[H]``, dt_bias ``[H, K]`` -> ``[..., H, K]``.

    The backward recomputes it from x, which is kept in its own dtype (not its fp32 intermediates).
    Under ``torch.compile`` it is the plain expression.

    Example:
        >>> mamba2_log_decay(torch.randn(2, 5, 4, 1), torch.zeros(4), torch.zeros(4, 1)).shape
        torch.Size([2, 5, 4, 1])
    """
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        z, minus_a = _mamba2_decay(x, A_log, dt_bias)
        return minus_a * F.softplus(z)
    return _Mamba2LogDecay.apply(x, A_log, dt_bias)


# ---------------------------------------------------------------- norms


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
