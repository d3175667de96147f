"""The SwiGLU activation ``silu(gate) * up`` in one kernel each way, saving only its two inputs.

Eager PyTorch keeps ``silu(gate)`` (and its fp32 copies) for the backward; this keeps nothing but gate and up,
which the projections' outputs are anyway. ``torch.compile`` sees the custom ops ``linmem::swiglu_fwd`` /
``linmem::swiglu_bwd``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .backend import kernels, use_triton


@torch.library.custom_op("linmem::swiglu_fwd", mutates_args=())
def swiglu_fwd_op(gate: Tensor, up: Tensor) -> Tensor:
    """Rows [M, D] -> y [M, D]."""
    return kernels("swiglu").swiglu_forward(gate, up)


@swiglu_fwd_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("linmem::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(gate: Tensor, up: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    return kernels("swiglu").swiglu_backward(gate, up, dy)


@swiglu_bwd_op.register_fake
def _(gate, up, dy):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    return swiglu_bwd_op(*ctx.saved_tensors, dy)


swiglu_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class SwiGLUFn(torch.autograd.Function):
    """The SwiGLU kernels under autograd (eager mode); saves gate and up only."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return kernels("swiglu").swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        return kernels("swiglu").swiglu_backward(*ctx.saved_tensors, dy)


def _rows(x: Tensor) -> Tensor:
    """x [..., D] as [M, D]: a view where the strides allow (e.g. a half of a fused projection), else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def swiglu(gate: Tensor, up: Tensor, *, backend: str = "auto") -> Tensor:
    """``silu(gate) * up`` (fp32 inside, gate's dtype out), fused forward and backward.

    Args:
        gate, up: ``[..., I]`` of one shape and dtype, e.g. the two halves of ``gate_up(x).chunk(2, -1)``
            (read in place).
        backend: ``"auto"`` (the Triton kernels on CUDA, the reference elsewhere), ``"triton"``, ``"reference"``.

    Returns:
        ``[..., I]``, contiguous.

    Example:
        >>> gate, up = torch.randn(2, 5, 64).chunk(2, dim=-1)
        >>> swiglu(gate, up).shape
        torch.Size([2, 5, 32])
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.ndim == 0:
            raise TypeError(f"swiglu: `{name}` must be a floating-point tensor [..., I], got "
                            f"{getattr(t, 'dtype', type(t))}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"swiglu: `up` must match gate ({list(gate.shape)}, {gate.dtype}, {gate.device}), got "
                         f"{list(up.shape)}, {up.dtype}, {up.device}")
    if not use_triton("swiglu", backend, gate, None if gate.numel() else "no elements"):
        return reference.swiglu(gate, up)
    g, u = _rows(gate), _rows(up)
    if torch.compiler.is_compiling():
        y = swiglu_fwd_op(g, u)
    elif torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        y = SwiGLUFn.apply(g, u)
    else:  # nothing to differentiate (inference, or inside another op's forward or backward): the launcher alone
        y = kernels("swiglu").swiglu_forward(g, u)
    return y.view(gate.shape)


def swiglu_grads(gate: Tensor, up: Tensor, dy: Tensor, *, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """The gradients of :func:`swiglu` at (gate, up) for the output's gradient ``dy``, computed directly (no autograd
    graph): for a backward that recomputes the product itself, such as :func:`linmem.layers.moe.swiglu_down`'s.

    Args:
        gate, up: ``[..., I]`` as :func:`swiglu` took them (read in place).
        dy: ``[..., I]`` in gate's dtype (the output's).
        backend: as in :func:`swiglu`.

    Returns:
        ``(dgate, dup)``: ``[..., I]``, contiguous, in the dtypes of gate and up.

    Example:
        >>> gate, up = torch.randn(2, 5, 64).chunk(2, dim=-1)
        >>> [d.shape for d in swiglu_grads(gate, up, torch.ones(2, 5, 32))]
        [torch.Size([2, 5, 32]), torch.Size([2, 5, 32])]
    """
    if dy.shape != gate.shape:
        raise ValueError(f"swiglu_grads: `dy` must have gate's shape {list(gate.shape)}, got {list(dy.shape)}")
    if not use_triton("swiglu", backend, gate, None if gate.numel() else "no elements"):
        return reference.swiglu_grads(gate, up, dy)
    dgate, dup = kernels("swiglu").swiglu_backward(_rows(gate), _rows(up), dy.reshape(-1, dy.shape[-1]))
    return dgate.view(gate.shape), dup.view(up.shape)
