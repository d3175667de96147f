"""Rotary position embedding of q and k in one kernel each way.

The eager form launches a dozen small kernels per tensor (the frequencies, cos, sin, the half rotation, fp32
copies) and keeps fp32 intermediates for the backward; this launches one kernel for q and k together, keeps
only the positions, and its backward is the rotation by the opposite angles. ``torch.compile`` sees the custom
op ``linmem::rotary``, which serves both directions.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference
from ..checks import check_positive
from .backend import kernels, use_triton


def _or_empty(x: Optional[Tensor], like: Tensor) -> Tensor:
    return x if x is not None else like.new_empty(0)


def _launch(q: Tensor, k: Optional[Tensor], position_ids: Tensor, theta: float,
            inverse: bool) -> tuple[Tensor, Optional[Tensor]]:
    return kernels("rotary").rotary_launch(q, k, position_ids, theta, inverse)


@torch.library.custom_op("linmem::rotary", mutates_args=())
def rotary_op(q: Tensor, k: Optional[Tensor], position_ids: Tensor, theta: float,
              inverse: bool) -> tuple[Tensor, Tensor]:
    """q [B, T, H, D], k [B, T, Hkv, D] or None -> (q rotated, k rotated or empty), contiguous; ``inverse``
    turns by minus the angles (the backward: the rotation's adjoint is its inverse)."""
    qo, ko = _launch(q, k, position_ids, theta, inverse)
    return qo, _or_empty(ko, q)


@rotary_op.register_fake
def _(q, k, position_ids, theta, inverse):
    return q.new_empty(q.shape), (q.new_empty(0) if k is None else k.new_empty(k.shape))


def _setup_context(ctx, inputs, output):
    q, k, position_ids, theta, inverse = inputs
    ctx.save_for_backward(position_ids)
    ctx.theta, ctx.inverse, ctx.q_meta, ctx.has_k = theta, inverse, (q.shape, q.dtype), k is not None
    ctx.set_materialize_grads(False)


def _cotangents(ctx, dq: Optional[Tensor], dk: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """dq (zeros where q's output got none) and dk (None where k has no output or it got none)."""
    if dq is None:
        shape, dtype = ctx.q_meta
        dq = torch.zeros(shape, dtype=dtype, device=ctx.saved_tensors[0].device)
    if not ctx.has_k or (dk is not None and dk.numel() == 0):
        dk = None
    return _unit_last(dq), (None if dk is None else _unit_last(dk))


def _backward(ctx, dq, dk):
    dq, dk = _cotangents(ctx, dq, dk)
    dq, dk_out = rotary_op(dq, dk, ctx.saved_tensors[0], ctx.theta, not ctx.inverse)
    return dq, (dk_out if dk is not None else None), None, None, None


rotary_op.register_autograd(_backward, setup_context=_setup_context)


class RotaryFn(torch.autograd.Function):
    """The rotary kernel under autograd (eager mode); saves the positions only."""

    @staticmethod
    def forward(ctx, q, k, position_ids, theta):
        qo, ko = _launch(q, k, position_ids, theta, False)
        _setup_context(ctx, (q, k, position_ids, theta, False), None)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        dq, dk = _cotangents(ctx, dq, dk)
        dq, dk = _launch(dq, dk, ctx.saved_tensors[0], ctx.theta, not ctx.inverse)
        return dq, dk, None, None


def _unit_last(x: Tensor) -> Tensor:
    """x itself where its last dim is contiguous (the kernels read the other dims through their strides), else a
    copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: Tensor, k: Optional[Tensor], position_ids: Tensor, theta: float) -> None:
    if not isinstance(q, Tensor) or not q.is_floating_point():
        raise TypeError(f"rotary: `q` must be a floating-point tensor [B, T, H, D], got "
                        f"{getattr(q, 'dtype', type(q))}")
    if q.ndim != 4 or q.shape[-1] % 2:
        raise ValueError(f"rotary: `q` must be [B, T, H, D] with an even D, got {list(q.shape)}")
    B, T, _, D = q.shape
    if k is not None:
        if not isinstance(k, Tensor) or k.dtype != q.dtype or k.device != q.device:
            raise TypeError(f"rotary: `k` must be a tensor of q's dtype {q.dtype} on {q.device}, got "
                            f"{getattr(k, 'dtype', type(k))} on {getattr(k, 'device', None)}")
        if k.ndim != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (B, T, D):
            raise ValueError(f"rotary: `k` must be [B, T, Hkv, D] = [{B}, {T}, Hkv, {D}], got {list(k.shape)}")
    if not isinstance(position_ids, Tensor) or position_ids.is_floating_point() or position_ids.is_complex() \
            or position_ids.dtype == torch.bool:
        raise TypeError(f"rotary: `position_ids` must be an integer tensor [B, T], got "
                        f"{getattr(position_ids, 'dtype', type(position_ids))}")
    if tuple(position_ids.shape) != (B, T):
        raise ValueError(f"rotary: `position_ids` must be [B, T] = [{B}, {T}], got {list(position_ids.shape)}")
    if position_ids.device != q.device:
        raise ValueError(f"rotary: `position_ids` must be on q's device {q.device}, got {position_ids.device}")
    check_positive("rotary", "theta", theta)


def rotary(q: Tensor, k: Optional[Tensor], position_ids: Tensor, *, theta: float = 10000.0,
           scaling: Optional[dict] = None, backend: str = "auto") -> tuple[Tensor, Optional[Tensor]]:
    """Rotary position embedding (rotate-half form) of q and k, in one kernel forward and one backward.

    Each head ``x = [x1, x2]`` (halves of D/2) at position p turns by the angles ``a_i = p f_i``, with the
    frequencies ``f_i = theta^(-2i/D)`` (rescaled by ``scaling``: :func:`.reference.rope_frequencies`):
    ``[x1 cos a - x2 sin a, x2 cos a + x1 sin a]``, in fp32, returned in the input's dtype. No gradient
    reaches the positions.

    Args:
        q: ``[B, T, H, D]``, D even; may be a view (e.g. the head split of a projection) whose last dim is
            contiguous, read in place.
        k: ``[B, T, Hkv, D]`` of q's dtype (Hkv may differ from H), or None.
        position_ids: ``[B, T]`` integer positions (any integer dtype), e.g. restarting per sequence or shifted
            by left padding.
        theta: the rotary base.
        scaling: a checkpoint's frequency scaling (``rope_type`` "linear" or "llama3" with its keys), or None;
            the kernel computes the unscaled frequencies itself, so a scaled rotation runs the reference.
        backend: ``"auto"`` (the Triton kernel on CUDA, the reference elsewhere), ``"triton"``, ``"reference"``.

    Returns:
        ``(q_rot, k_rot)`` shaped as q and k (``k_rot`` is None when k is), contiguous from the kernel.

    Example:
        >>> q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
        >>> q_rot, k_rot = rotary(q, k, torch.arange(5).expand(2, 5))
        >>> q_rot.shape, k_rot.shape
        (torch.Size([2, 5, 4, 16]), torch.Size([2, 5, 2, 16]))
    """
    _check(q, k, position_ids, theta)
    scaled = (scaling or {}).get("rope_type", "default") != "default"
    refusal = "a frequency scaling" if scaled else (None if q.numel() else "no elements")
    if not use_triton("rotary", backend, q, refusal):
        return reference.rotary(q, k, position_ids, theta, scaling)
    q, k = _unit_last(q), (None if k is None else _unit_last(k))
    if position_ids.dtype not in (torch.int32, torch.int64):
        position_ids = position_ids.long()
    theta = float(theta)
    if torch.compiler.is_compiling():
        qo, ko = rotary_op(q, k, position_ids, theta, False)
        return qo, (ko if k is not None else None)
    return RotaryFn.apply(q, k, position_ids, theta)
