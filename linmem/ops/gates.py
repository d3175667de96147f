"""Elementwise gates whose backward keeps only their input: a generic one and the Mamba-2 decay."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .checks import as_dtype

__all__ = ["pointwise", "mamba2_log_decay"]

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
    # x is promoted to acc inside the add (the values of x.to(acc) + dt_bias, one kernel and one buffer fewer)
    return x + as_dtype(dt_bias, acc), -torch.exp(as_dtype(A_log, acc)).unsqueeze(-1)


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
        da = dy * minus_a  # [..., H, K]
        dz = da * torch.sigmoid(z)
        batch = tuple(range(dz.dim() - 2))
        dA_log = (da * F.softplus(z)).sum((*batch, -1))  # d/dA_log of -exp(A_log) s = the output
        return as_dtype(dz, x.dtype), as_dtype(dA_log, A_log.dtype), as_dtype(dz.sum(batch), dt_bias.dtype)


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
