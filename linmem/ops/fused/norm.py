"""Fused norms: RMSNorm with the residual add, the gated output RMSNorm, and the q/k L2 norm.

Each is one kernel forward and one backward, statistics in fp32, output in the input's dtype. The kernels
run under autograd through a ``torch.autograd.Function`` in eager mode and through custom ops
(``linmem::rms_norm_fwd`` / ``_bwd``, ``linmem::l2_norm_fwd`` / ``_bwd``) under ``torch.compile``.

Rows are read in place as ``[M, H, D]`` (``[B, T, H, D]`` inputs and per-head weights ``[H, D]`` by head,
``[..., D]`` inputs as rows) where the strides allow, so a head split of a fused projection costs no copy.
"""

from __future__ import annotations


from typing import Optional, Union

import torch
from torch import Tensor

from . import reference
from ..checks import check_positive
from .backend import kernels, use_triton

#: the output-gate activations of gated_rms_norm
GATE_ACTIVATIONS = {"silu": 1, "sigmoid": 2}
#: the kernels take rows of at most this many elements
MAX_DIM = 16384


def _or_empty(x: Optional[Tensor], like: Tensor) -> Tensor:
    return x if x is not None else like.new_empty(0)


def _or_none(x: Optional[Tensor]) -> Optional[Tensor]:
    return x if x is not None and x.numel() else None


def as_rows(x: Tensor, by_head: bool) -> Tensor:
    """x [..., H, D] as [M, H, D] (by_head) or x [..., D] as [M, 1, D]: a view where the strides allow, else a
    copy; the last dim contiguous."""
    rows = x.reshape(-1, *x.shape[-2:]) if by_head else x.reshape(-1, 1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _by_head(x: Tensor, weight: Optional[Tensor]) -> bool:
    """Rows by head for [B, T, H, D] inputs and per-head weights [H, D]; plain rows otherwise."""
    return x.ndim >= 4 or (weight is not None and weight.ndim == 2)


def _dim_refusal(D: int) -> Optional[str]:
    return None if D <= MAX_DIM else f"rows of {D} elements (the kernels take up to {MAX_DIM})"


# ---------------------------------------------------------------- RMSNorm (residual add, output gate)


@torch.library.custom_op("linmem::rms_norm_fwd", mutates_args=())
def rms_norm_fwd_op(x: Tensor, weight: Tensor, residual: Optional[Tensor], gate: Optional[Tensor], eps: float,
                    act: int, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rows [M, H, D] -> (y in out_dtype, h = x + residual in residual's dtype, or empty)."""
    y, h = kernels("norm").rms_norm_forward(x, weight, residual, gate, eps, act, out_dtype)
    return y, _or_empty(h, x)


@rms_norm_fwd_op.register_fake
def _(x, weight, residual, gate, eps, act, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), (residual.new_empty(x.shape) if residual is not None
                                                   else x.new_empty(0))


@torch.library.custom_op("linmem::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(x: Tensor, gate: Optional[Tensor], weight: Tensor, dy: Tensor, dh: Optional[Tensor],
                    eps: float, act: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx, dgate or empty, dweight); x is the norm's input (h with a residual)."""
    dx, dgate, dw = kernels("norm").rms_norm_backward(x, gate, weight, dy, dh, eps, act)
    return dx, _or_empty(dgate, x), dw


@rms_norm_bwd_op.register_fake
def _(x, gate, weight, dy, dh, eps, act):
    return x.new_empty(x.shape), (torch.empty_like(gate) if gate is not None else x.new_empty(0)), \
        torch.empty_like(weight)


def _launch_rms_backward(x, gate, weight, dy, dh, eps, act):
    return kernels("norm").rms_norm_backward(x, gate, weight, dy, dh, eps, act)


def _rms_gradients(ctx, dy: Optional[Tensor], dh: Optional[Tensor], backward) -> tuple:
    normed, gate, weight = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(normed)
    if dh is not None and dh.numel() == 0:
        dh = None
    dx, dgate, dw = backward(normed, gate, weight, dy, dh, ctx.eps, ctx.act)
    return dx, dw, (dx if ctx.has_residual else None), _or_none(dgate), None, None, None


def _rms_setup_context(ctx, inputs, output):
    x, weight, residual, gate, eps, act, _ = inputs
    ctx.save_for_backward(x if residual is None else output[1], gate, weight)
    ctx.eps, ctx.act, ctx.has_residual = eps, act, residual is not None
    ctx.set_materialize_grads(False)


def _rms_backward(ctx, dy, dh):
    return _rms_gradients(ctx, dy, dh, rms_norm_bwd_op)


rms_norm_fwd_op.register_autograd(_rms_backward, setup_context=_rms_setup_context)


class RMSNormFn(torch.autograd.Function):
    """The RMSNorm kernels under autograd without the custom ops' dispatch (eager mode); saves the norm's input
    (x, or h = x + residual, which is returned anyway), the gate and the weight."""

    @staticmethod
    def forward(ctx, x, weight, residual, gate, eps, act, out_dtype):
        y, h = kernels("norm").rms_norm_forward(x, weight, residual, gate, eps, act, out_dtype)
        ctx.save_for_backward(x if h is None else h, gate, weight)
        ctx.eps, ctx.act, ctx.has_residual = eps, act, residual is not None
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        return _rms_gradients(ctx, dy, dh, _launch_rms_backward)


def _rms_rows(x: Tensor, weight: Tensor, residual: Optional[Tensor], gate: Optional[Tensor], eps: float,
              act: int, out_dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    """The kernels on x's rows: -> (y, h or None) shaped as x."""
    by_head = _by_head(x, weight)
    rows = [None if t is None else as_rows(t, by_head) for t in (x, residual, gate)]
    args = (rows[0], weight.contiguous(), rows[1], rows[2], eps, act, out_dtype)
    if torch.compiler.is_compiling():
        y, h = rms_norm_fwd_op(*args)
        h = h if residual is not None else None
    else:
        y, h = RMSNormFn.apply(*args)
    return y.view(x.shape), (None if h is None else h.view(x.shape))


def _check_norm(op: str, x: Tensor, weight: Tensor, *others: tuple[str, Optional[Tensor]]) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim == 0:
        raise TypeError(f"{op}: `x` must be a floating-point tensor [..., D], got {getattr(x, 'dtype', type(x))}")
    if weight.ndim not in (1, 2) or tuple(weight.shape) != tuple(x.shape[x.ndim - weight.ndim:]):
        raise ValueError(f"{op}: `weight` must be [D] or [H, D] matching x's last dims {list(x.shape)}, "
                         f"got {list(weight.shape)}")
    for name, t in (("weight", weight), *others):
        if t is None:
            continue
        if name != "weight" and t.shape != x.shape:
            raise ValueError(f"{op}: `{name}` must have x's shape {list(x.shape)}, got {list(t.shape)}")
        if not t.is_floating_point() or t.device != x.device:
            raise TypeError(f"{op}: `{name}` must be floating point on {x.device}, got {t.dtype} on {t.device}")


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    residual: Optional[Tensor] = None,
    residual_out: bool = False,
    *,
    out_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """RMSNorm over the last dim, with the pre-norm residual add fused: ``h = x (+ residual)``,
    ``y = h / sqrt(mean(h^2) + eps) * weight``.

    Args:
        x: ``[..., D]``; residual: None or x's shape (the residual stream), in any float dtype: h is computed in
            fp32 and kept in the residual's dtype (an fp32 stream under autocast takes bf16 block outputs
            without a cast of its own).
        weight: ``[D]``, or ``[H, D]`` for x ``[..., H, D]`` (a scale per head).
        residual_out: also return h (x itself without a residual), the stream the next block adds to.
        out_dtype: y's dtype; x's when None.
        backend: ``"auto"`` (the Triton kernels on CUDA, the reference elsewhere), ``"triton"``, ``"reference"``.

    Returns:
        y (fp32 statistics), or ``(y, h)`` with ``residual_out``. The backward saves only h (or x) and recomputes
        the statistics.

    Example:
        >>> x, stream = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        >>> y, stream = rms_norm(x, torch.ones(16), residual=stream, residual_out=True)
        >>> y.shape, stream.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 16]))
    """
    _check_norm("rms_norm", x, weight, ("residual", residual))
    check_positive("rms_norm", "eps", eps)
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"rms_norm: `out_dtype` must be None or a floating-point torch.dtype, got {out_dtype!r}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not use_triton("rms_norm", backend, x, _dim_refusal(x.shape[-1])):
        return reference.rms_norm(x, weight, eps, residual, residual_out, out_dtype)
    y, h = _rms_rows(x, weight, residual, None, eps, 0, out_dtype)
    if not residual_out:
        return y
    return y, (x if h is None else h)


def gated_rms_norm(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6, activation: str = "silu", *, backend: str = "auto"
) -> Tensor:
    """The gated output norm: ``y = x / sqrt(mean(x^2) + eps) * weight * act(gate)`` over the last dim.

    Args:
        x, gate: ``[..., D]``, e.g. ``[B, T, H, V]`` (a norm per head); gate in any float dtype.
        weight: ``[D]``, or ``[H, D]`` (a scale per head).
        activation: ``"silu"`` (GLA, Gated DeltaNet, RetNet) or ``"sigmoid"``.
        backend: as :func:`rms_norm`.

    Returns:
        y in x's dtype; the backward saves x and gate only.

    Example:
        >>> o, g = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 4, 8)
        >>> gated_rms_norm(o, g, torch.ones(8)).shape
        torch.Size([2, 5, 4, 8])
    """
    _check_norm("gated_rms_norm", x, weight, ("gate", gate))
    check_positive("gated_rms_norm", "eps", eps)
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gated_rms_norm: `activation` must be one of {tuple(GATE_ACTIVATIONS)}, got {activation!r}")
    if not use_triton("gated_rms_norm", backend, x, _dim_refusal(x.shape[-1])):
        return reference.gated_rms_norm(x, gate, weight, eps, activation)
    return _rms_rows(x, weight, None, gate, eps, GATE_ACTIVATIONS[activation], x.dtype)[0]


# ---------------------------------------------------------------- L2 norm


@torch.library.custom_op("linmem::l2_norm_fwd", mutates_args=())
def l2_norm_fwd_op(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Rows [M, H, D] -> (y [M, H, D], 1 / sqrt(sum(x^2) + eps) [M, H] fp32)."""
    return kernels("norm").l2_norm_forward(x, eps)


@l2_norm_fwd_op.register_fake
def _(x, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:2], dtype=torch.float32)


@torch.library.custom_op("linmem::l2_norm_bwd", mutates_args=())
def l2_norm_bwd_op(y: Tensor, rinv: Tensor, dy: Tensor) -> Tensor:
    return kernels("norm").l2_norm_backward(y, rinv, dy)


@l2_norm_bwd_op.register_fake
def _(y, rinv, dy):
    return torch.empty_like(y)


def _l2_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output)
    ctx.mark_non_differentiable(output[1])


def _l2_backward(ctx, dy, _):
    y, rinv = ctx.saved_tensors
    return l2_norm_bwd_op(y, rinv, dy), None


l2_norm_fwd_op.register_autograd(_l2_backward, setup_context=_l2_setup_context)


class L2NormFn(torch.autograd.Function):
    """The L2 norm kernels under autograd (eager mode); saves y (which the recurrence keeps as q or k anyway)
    and 1 / norm per row."""

    @staticmethod
    def forward(ctx, x, eps):
        y, rinv = kernels("norm").l2_norm_forward(x, eps)
        ctx.save_for_backward(y, rinv)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rinv = ctx.saved_tensors
        return kernels("norm").l2_norm_backward(y, rinv, dy), None


def l2_norm(x: Tensor, eps: float = 1e-6, *, head_dim: Optional[int] = None, backend: str = "auto") -> Tensor:
    """L2 normalisation over the last dim: ``y = x / sqrt(sum(x^2) + eps)`` (fp32 inside, x's dtype out).

    The drop-in for ``F.normalize(x, dim=-1)`` on q and k (which divides by ``max(|x|, 1e-12)`` instead;
    the two differ by about ``eps / (2 |x|^2)`` relative).

    Args:
        x: ``[..., D]``; with ``head_dim`` K, ``[..., H * K]`` (e.g. a projection's output, or a slice of a
            fused one), split into heads on the fly.
        head_dim: None, or K: normalise each of the H groups of K and return ``[..., H, K]``.
        backend: ``"auto"`` (the Triton kernels on CUDA, the reference elsewhere), ``"triton"``, ``"reference"``.

    Returns:
        y ``[..., D]`` (or ``[..., H, K]``), contiguous, in x's dtype.

    Example:
        >>> q = torch.randn(2, 5, 4 * 8)
        >>> l2_norm(q, head_dim=8).shape
        torch.Size([2, 5, 4, 8])
    """
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim == 0:
        raise TypeError(f"l2_norm: `x` must be a floating-point tensor [..., D], got {getattr(x, 'dtype', type(x))}")
    check_positive("l2_norm", "eps", eps)
    if head_dim is not None:
        if head_dim < 1 or x.shape[-1] % head_dim:
            raise ValueError(f"l2_norm: `head_dim` must divide x's last dim {x.shape[-1]}, got {head_dim}")
        x = x.unflatten(-1, (x.shape[-1] // head_dim, head_dim))
    if not use_triton("l2_norm", backend, x, _dim_refusal(x.shape[-1])):
        return reference.l2_norm(x, eps)
    rows = as_rows(x, _by_head(x, None) or head_dim is not None)
    if torch.compiler.is_compiling():
        y = l2_norm_fwd_op(rows, eps)[0]
    else:
        y = L2NormFn.apply(rows, eps)
    return y.view(x.shape)
