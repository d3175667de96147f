"""The forgetting-attention kernels as PyTorch custom ops (``torch.library``), so models compile without graph breaks.

``linmem::fox_attention_fwd`` returns the output and the log-sum-exp the backward needs;
``linmem::fox_attention_bwd`` returns dq, dk, dv and dc (the gradient of the cumulative
forget values); ``register_autograd`` joins them. ``linmem::fox_attention_decode`` is the
inference-only decoding kernel. Outside ``torch.compile`` the same launchers run under a plain
``torch.autograd.Function`` (:class:`FlashAttention`), without the custom ops' dispatch cost.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference import logit_bound
from . import launch


def _or_empty(x: Optional[Tensor], like: Tensor) -> Tensor:
    return x if x is not None else like.new_empty(0)


@torch.library.custom_op("linmem::fox_attention_fwd", mutates_args=())
def fwd_op(q: Tensor, k: Tensor, v: Tensor, c: Optional[Tensor], key_mask: Optional[Tensor],
           cu_seqlens: Optional[Tensor], bound: Optional[Tensor], scale: float, window: Optional[int],
           tol: Optional[float]) -> tuple[Tensor, Tensor]:
    """c: [B, H, Tk] -> (o [B, Tq, H, Dv], lse [B, H, Tq] fp32)."""
    return launch.attention_forward(q, k, v, c, key_mask, cu_seqlens, bound, scale, window, tol)


@fwd_op.register_fake
def _(q, k, v, c, key_mask, cu_seqlens, bound, scale, window, tol):
    B, Tq, H, _ = q.shape
    return q.new_empty(B, Tq, H, v.shape[-1]), q.new_empty(B, H, Tq, dtype=torch.float32)


@torch.library.custom_op("linmem::fox_attention_bwd", mutates_args=())
def bwd_op(q: Tensor, k: Tensor, v: Tensor, c: Optional[Tensor], key_mask: Optional[Tensor],
           cu_seqlens: Optional[Tensor], bound: Optional[Tensor], o: Tensor, lse: Tensor, do: Tensor, scale: float,
           window: Optional[int], tol: Optional[float]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dc); dc is empty without c."""
    dq, dk, dv, dc = launch.attention_backward(q, k, v, c, key_mask, cu_seqlens, bound, o, lse, do, scale, window,
                                               tol)
    return dq, dk, dv, _or_empty(dc, q)


@bwd_op.register_fake
def _(q, k, v, c, key_mask, cu_seqlens, bound, o, lse, do, scale, window, tol):
    dc = torch.empty_like(c) if c is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dc


def _setup_context(ctx, inputs, output):
    q, k, v, c, key_mask, cu_seqlens, bound, scale, window, tol = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, c, key_mask, cu_seqlens, bound, o, lse)
    ctx.args = (scale, window, tol)
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, do, backward) -> tuple:
    q, k, v, c, key_mask, cu_seqlens, bound, o, lse = ctx.saved_tensors
    dq, dk, dv, dc = backward(q, k, v, c, key_mask, cu_seqlens, bound, o, lse, do.contiguous(), *ctx.args)
    return dq, dk, dv, (dc if c is not None else None), None, None, None, None, None, None


def _backward(ctx, do, _dlse):
    return _gradients(ctx, do, bwd_op)


fwd_op.register_autograd(_backward, setup_context=_setup_context)


class FlashAttention(torch.autograd.Function):
    """The kernels under autograd without the custom ops (eager mode): same launchers, same gradients."""

    @staticmethod
    def forward(ctx, q, k, v, c, key_mask, cu_seqlens, bound, scale, window, tol):
        o, lse = launch.attention_forward(q, k, v, c, key_mask, cu_seqlens, bound, scale, window, tol)
        ctx.save_for_backward(q, k, v, c, key_mask, cu_seqlens, bound, o, lse)
        ctx.args = (scale, window, tol)
        return o

    @staticmethod
    def backward(ctx, do):
        return _gradients(ctx, do, launch.attention_backward)


@torch.library.custom_op("linmem::fox_attention_decode", mutates_args=())
def decode_op(q: Tensor, k: Tensor, v: Tensor, c: Optional[Tensor], key_mask: Optional[Tensor], scale: float,
              window: Optional[int]) -> Tensor:
    """A few queries against a KV cache (no autograd) -> o [B, Tq, H, Dv]."""
    return launch.attention_decode(q, k, v, c, key_mask, scale, window)


@decode_op.register_fake
def _(q, k, v, c, key_mask, scale, window):
    return q.new_empty(*q.shape[:3], v.shape[-1])


def _prepared(q, k, v, c, key_mask, head_major: bool):
    """Contiguous activations, fp32 c ([B, T, H], or with ``head_major`` [B, H, T]), the key mask as uint8."""
    if c is not None:
        c = c.float().transpose(1, 2) if head_major else c.float()
        c = c.contiguous()
    key_mask = None if key_mask is None else key_mask.contiguous().view(torch.uint8)
    return q.contiguous(), k.contiguous(), v.contiguous(), c, key_mask


def flash_attention(q: Tensor, k: Tensor, v: Tensor, c: Optional[Tensor], key_mask: Optional[Tensor],
                    cu_seqlens: Optional[Tensor], scale: float, window: Optional[int], tol: Optional[float]) -> Tensor:
    """The flash kernels for inputs that :func:`refusal` accepted (the backward needs Tq == Tk). c: [B, Tk, H], handed
    to the kernels head-major (its gradient flows back through the transpose)."""
    q, k, v, c, key_mask = _prepared(q, k, v, c, key_mask, head_major=True)
    bound = logit_bound(q, k, scale) if tol is not None and c is not None else None
    tol = tol if bound is not None else None
    cu_seqlens = None if cu_seqlens is None else cu_seqlens.contiguous()
    args = (q, k, v, c, key_mask, cu_seqlens, bound, scale, window, tol)
    if torch.compiler.is_compiling():
        return fwd_op(*args)[0]
    return FlashAttention.apply(*args)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, c: Optional[Tensor], key_mask: Optional[Tensor], scale: float,
                     window: Optional[int]) -> Tensor:
    """The decoding kernel (no autograd): the custom op under torch.compile, the launcher itself in eager mode."""
    q, k, v, c, key_mask = _prepared(q, k, v, c, key_mask, head_major=False)
    run = decode_op if torch.compiler.is_compiling() else launch.attention_decode
    return run(q, k, v, c, key_mask, scale, window)
