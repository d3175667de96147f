"""The causal depthwise short convolution of the mixers (before q, k, v), activation fused.

``short_conv`` replaces ``F.conv1d`` + SiLU (and the windows-times-weights form of packed sequences);
``short_conv_step`` is its decoding update against the conv cache, in place. The Triton kernels run under
autograd through :class:`ShortConv` in eager mode and through the custom ops ``linmem::short_conv_fwd`` /
``linmem::short_conv_bwd`` under ``torch.compile`` (one graph, no breaks).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference
from ..checks import check_cu_seqlens
from .backend import kernels, use_triton

#: the activations short_conv takes (None: the identity)
CONV_ACTIVATIONS = (None, "silu")
#: the kernels take kernel sizes from 2 to this
MAX_KERNEL_SIZE = 16


def _act_code(activation: Optional[str]) -> int:
    return 0 if activation is None else 1


def _or_empty(x: Optional[Tensor], like: Tensor) -> Tensor:
    return x if x is not None else like.new_empty(0)


def _or_none(x: Optional[Tensor]) -> Optional[Tensor]:
    return x if x is not None and x.numel() else None


@torch.library.custom_op("linmem::short_conv_fwd", mutates_args=())
def short_conv_fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                      cu_seqlens: Optional[Tensor], act: int, output_final_state: bool) -> tuple[Tensor, Tensor]:
    """-> (y, final state or empty)."""
    y, final = kernels("conv").conv_forward(x, weight, bias, initial_state, cu_seqlens, act, output_final_state)
    return y, _or_empty(final, x)


@short_conv_fwd_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, act, output_final_state):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = x.new_empty(N, weight.shape[1] - 1, x.shape[2]) if output_final_state else x.new_empty(0)
    return x.new_empty(x.shape), final


def _launch_backward(x, weight, bias, initial_state, cu_seqlens, dy, dfinal, act):
    return kernels("conv").conv_backward(x, weight, bias, initial_state, cu_seqlens, dy, dfinal, act)


@torch.library.custom_op("linmem::short_conv_bwd", mutates_args=())
def short_conv_bwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                      cu_seqlens: Optional[Tensor], dy: Tensor, dfinal: Optional[Tensor], act: int
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx, dweight, dbias or empty, d initial state or empty)."""
    dx, dw, db, dh0 = _launch_backward(x, weight, bias, initial_state, cu_seqlens, dy, dfinal, act)
    return dx, dw, _or_empty(db, x), _or_empty(dh0, x)


@short_conv_bwd_op.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, dy, dfinal, act):
    like = lambda t: x.new_empty(0) if t is None else torch.empty_like(t)  # noqa: E731
    return x.new_empty(x.shape), torch.empty_like(weight), like(bias), like(initial_state)


def _gradients(ctx, dy: Optional[Tensor], dfinal: Optional[Tensor], backward) -> tuple:
    """The inputs' gradients through ``backward`` (the custom op or the launcher)."""
    x, weight, bias, h0, cu_seqlens = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    if dfinal is not None and dfinal.numel() == 0:  # the final state was not returned
        dfinal = None
    dx, dw, db, dh0 = backward(x, weight, bias, h0, cu_seqlens, dy, dfinal, ctx.act)
    return dx, dw, _or_none(db), _or_none(dh0), None, None, None


def _setup_context(ctx, inputs, output):
    x, weight, bias, h0, cu_seqlens, act, _ = inputs
    ctx.save_for_backward(x, weight, bias, h0, cu_seqlens)
    ctx.act = act
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dfinal):
    return _gradients(ctx, dy, dfinal, short_conv_bwd_op)


short_conv_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class ShortConv(torch.autograd.Function):
    """The conv kernels under autograd without the custom ops' dispatch (eager mode)."""

    @staticmethod
    def forward(ctx, x, weight, bias, h0, cu_seqlens, act, output_final_state):
        taps = weight.t().contiguous().t()  # [C, W] over tap-major memory: both launchers read it without a copy
        y, final = kernels("conv").conv_forward(x, taps, bias, h0, cu_seqlens, act, output_final_state)
        ctx.save_for_backward(x, taps, bias, h0, cu_seqlens)
        ctx.act = act
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        return _gradients(ctx, dy, dfinal, _launch_backward)


@torch.library.custom_op("linmem::short_conv_step", mutates_args=("state",))
def short_conv_step_op(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor], act: int) -> Tensor:
    """One token x [B, C] against state [B, W-1, C], shifted in place -> y [B, C]."""
    return kernels("conv").conv_step(x, state, weight, bias, act)


@short_conv_step_op.register_fake
def _(x, state, weight, bias, act):
    return x.new_empty(x.shape)


def _check_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"short_conv: `x` must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    C = x.shape[-1]
    if weight.ndim != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"short_conv: `weight` must be [C, W] = [{C}, W >= 1], got {list(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"short_conv: `bias` must be [C] = [{C}], got {list(bias.shape)}")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"short_conv: `activation` must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not t.is_floating_point() or t.device != x.device):
            raise TypeError(f"short_conv: `{name}` must be floating point on {x.device}, got {t.dtype} on {t.device}")


def _kernel_refusal(x: Tensor, W: int) -> Optional[str]:
    if not 2 <= W <= MAX_KERNEL_SIZE:
        return f"kernel size {W} (the kernels take 2 to {MAX_KERNEL_SIZE})"
    if x.shape[1] == 0:
        return "no tokens"
    return None


def short_conv(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    activation: Optional[str] = None,
    cu_seqlens: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Optional[Tensor]]:
    """Causal depthwise convolution over time, one kernel per channel: ``y_t = act(b + sum_i w[:, i] x_(t-W+1+i))``.

    Args:
        x: ``[B, T, C]`` (channels contiguous; any batch and token strides, e.g. a slice of a fused projection).
        weight: ``[C, W]``, oldest tap first (``ShortConvolution.weight``); bias: ``[C]`` or None.
        activation: None or ``"silu"``, applied to the output.
        cu_seqlens: ``[N + 1]`` boundaries of packed sequences (B == 1); no window crosses a boundary.
        initial_state: ``[N, W-1, C]``, each sequence's last W-1 inputs before x (oldest first); zeros if None.
        output_final_state: also return each sequence's last W-1 inputs ``[N, W-1, C]`` (the next call's
            ``initial_state``; the history where a sequence is shorter than W-1).
        backend: ``"auto"`` (the Triton kernels on CUDA, the reference elsewhere), ``"triton"``, ``"reference"``.

    Returns:
        ``(y [B, T, C] in x's dtype, final state or None)``. Gradients reach x, weight, bias and initial_state.

    Example:
        >>> x, w = torch.randn(2, 10, 8), torch.randn(8, 4)
        >>> y, state = short_conv(x, w, activation="silu", output_final_state=True)
        >>> y.shape, state.shape
        (torch.Size([2, 10, 8]), torch.Size([2, 3, 8]))
    """
    _check_conv(x, weight, bias, activation)
    if x.ndim != 3:
        raise ValueError(f"short_conv: `x` must be [B, T, C], got {list(x.shape)}")
    B, _, C = x.shape
    W = weight.shape[1]
    N = B if cu_seqlens is None else check_cu_seqlens("short_conv", cu_seqlens, B, x.shape[1], x.device, like="x")
    if initial_state is not None and tuple(initial_state.shape) != (N, W - 1, C):
        raise ValueError(f"short_conv: `initial_state` must be [N, W-1, C] = [{N}, {W - 1}, {C}], "
                         f"got {list(initial_state.shape)}")
    if not use_triton("short_conv", backend, x, _kernel_refusal(x, W)):
        return reference.short_conv(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                    initial_state=initial_state, output_final_state=output_final_state)
    if x.stride(-1) != 1:
        x = x.contiguous()
    args = (x, weight.contiguous(), None if bias is None else bias.contiguous(),
            None if initial_state is None else initial_state.contiguous(), cu_seqlens, _act_code(activation),
            output_final_state)
    if torch.compiler.is_compiling():
        y, final = short_conv_fwd_op(*args)
        return y, (final if output_final_state else None)
    return ShortConv.apply(*args)


def short_conv_step(
    x: Tensor,
    state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """One decoding step of :func:`short_conv`: x ``[B, C]`` against the conv cache ``state`` ``[B, W-1, C]``.

    ``state`` (the last W-1 inputs, oldest first) is shifted in place to end with x; nothing else is allocated
    but y. Returns y ``[B, C]`` in x's dtype. No autograd (a decoding step).

    Example:
        >>> state = torch.zeros(2, 3, 8)
        >>> y = short_conv_step(torch.randn(2, 8), state, torch.randn(8, 4), activation="silu")
        >>> y.shape
        torch.Size([2, 8])
    """
    _check_conv(x, weight, bias, activation)
    if x.ndim != 2:
        raise ValueError(f"short_conv_step: `x` must be [B, C], got {list(x.shape)}")
    B, C = x.shape
    W = weight.shape[1]
    if tuple(state.shape) != (B, W - 1, C):
        raise ValueError(f"short_conv_step: `state` must be [B, W-1, C] = [{B}, {W - 1}, {C}], got {list(state.shape)}")
    if state.device != x.device or not state.is_floating_point():
        raise TypeError(f"short_conv_step: `state` must be floating point on {x.device}, got {state.dtype} on "
                        f"{state.device}")
    refusal = _kernel_refusal(x[:, None], W) or (None if state.is_contiguous() else
                                                  "the state is not contiguous (it is updated in place)")
    if not use_triton("short_conv_step", backend, x, refusal):
        return reference.short_conv_step(x, state, weight, bias, activation)
    if x.stride(-1) != 1:
        x = x.contiguous()
    args = (x, state, weight.contiguous(), None if bias is None else bias.contiguous(), _act_code(activation))
    if torch.compiler.is_compiling():
        return short_conv_step_op(*args)
    return kernels("conv").conv_step(*args)
