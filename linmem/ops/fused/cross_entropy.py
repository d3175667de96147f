"""Linear + cross-entropy in chunks of rows: the ``[N, vocab]`` logits are never materialised.

For each chunk of ``c`` rows: ``z = h W^T`` ``[c, V]`` in the activation dtype; the log-sum-exp in fp32; z is
overwritten with ``dL/dz = (softmax(z) - onehot) * scale`` (a Triton kernel, or PyTorch with one fp32 copy of
the chunk); then ``dh = dz W`` and ``dW += dz^T h`` (the product in the activation dtype, the sum in fp32). The
gradients are thus computed in the forward; the backward multiplies them by the loss's incoming gradient.

Memory beyond the inputs: dh ``[N, D]`` (hidden's dtype), dW ``[V, D]`` fp32 and one ``[V, D]`` product at a
time, one chunk of logits ``[c, V]`` (the activation dtype; the PyTorch form adds an fp32 copy of it) and the
per-row losses ``[N]`` fp32 -- where eager PyTorch holds ``[N, V]`` logits, their fp32 copy, its log-softmax and
their gradients."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference
from ..checks import values_checkable
from .backend import kernels, logger, triton_refusal

#: ``backend=`` of linear_cross_entropy: those of every fused op and "chunked" (the chunks in PyTorch)
CE_BACKENDS = ("auto", "reference", "chunked", "triton")
#: the default chunk holds about this many logits (128 MB in bf16)
CHUNK_LOGITS = 1 << 26


def _torch_softmax_grad_(logits: Tensor, labels: Tensor, scale: Tensor, ignore_index: int, grad: bool) -> Tensor:
    """The PyTorch form of ``triton.cross_entropy.softmax_grad_``: loss [R] fp32; logits <- dL/dlogits."""
    z = logits.float()  # [R, V]
    lse = torch.logsumexp(z, dim=-1)
    keep = labels != ignore_index
    target = torch.where(keep, labels, 0).long()[:, None]
    loss = torch.where(keep, lse - z.gather(1, target)[:, 0], 0.0)
    if grad:
        p = z.sub_(lse[:, None]).exp_()  # softmax, in z's memory
        p.scatter_add_(1, target, torch.full_like(target, -1, dtype=p.dtype))
        logits.copy_(p.mul_(torch.where(keep, scale, 0.0)[:, None]))
    return loss


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b for an fp32 acc: the product in a's dtype (fp32 accumulation inside the matmul), added in fp32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def chunked_forward(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int,
                    reduce_sum: bool, with_grads: bool, kernel: bool
                    ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """-> (loss fp32 scalar, dloss/dhidden, dloss/dweight) (the gradients None without ``with_grads``)."""
    N, D = hidden.shape
    keep = labels != ignore_index
    count = keep.sum()
    scale = torch.ones(1, device=hidden.device) if reduce_sum else (1.0 / count.clamp(min=1).float()).reshape(1)
    if kernel:
        softmax_grad_ = kernels("cross_entropy").softmax_grad_
    else:
        softmax_grad_ = _torch_softmax_grad_
    losses = torch.empty(N, device=hidden.device, dtype=torch.float32)
    dh = torch.empty_like(hidden) if with_grads else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if with_grads else None
    for start in range(0, N, chunk_size):
        end = min(start + chunk_size, N)
        h = hidden[start:end]
        logits = h @ weight.T  # [c, V], the activation dtype
        losses[start:end] = softmax_grad_(logits, labels[start:end], scale, ignore_index, with_grads)
        if with_grads:  # logits now hold dL/dlogits
            torch.mm(logits, weight, out=dh[start:end])
            _accumulate_mm(dw, logits.T, h)
    loss = losses.sum()
    if not reduce_sum:
        loss = loss / count
    return loss, dh, (None if dw is None else dw.to(weight.dtype))


@torch.library.custom_op("linmem::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int,
                            reduce_sum: bool, with_grads: bool, kernel: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (loss, dhidden or empty, dweight or empty)."""
    loss, dh, dw = chunked_forward(hidden, weight, labels, ignore_index, chunk_size, reduce_sum, with_grads, kernel)
    empty = hidden.new_empty(0)
    return loss, (empty if dh is None else dh), (empty if dw is None else dw)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, ignore_index, chunk_size, reduce_sum, with_grads, kernel):
    grads = (hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)) if with_grads else \
        (hidden.new_empty(0), hidden.new_empty(0))
    return (hidden.new_empty((), dtype=torch.float32), *grads)


def _scaled(dloss: Tensor, dh: Tensor, dw: Tensor) -> tuple:
    return dh * dloss.to(dh.dtype), dw * dloss.to(dw.dtype), None, None, None, None, None, None


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, dloss, _dh, _dw):
    return _scaled(dloss, *ctx.saved_tensors)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


class LinearCrossEntropyFn(torch.autograd.Function):
    """The chunked loss under autograd (eager mode): the gradients come from the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size, reduce_sum, with_grads, kernel):
        loss, dh, dw = chunked_forward(hidden, weight, labels, ignore_index, chunk_size, reduce_sum, with_grads,
                                       kernel)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        return _scaled(dloss, *ctx.saved_tensors)


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
           chunk_size: Optional[int], backend: str) -> None:
    if not isinstance(hidden, Tensor) or hidden.ndim != 2 or not hidden.is_floating_point():
        raise TypeError(f"linear_cross_entropy: `hidden` must be a floating-point [N, D] tensor, got "
                        f"{getattr(hidden, 'dtype', type(hidden))} {list(getattr(hidden, 'shape', []))}")
    N, D = hidden.shape
    if weight.ndim != 2 or weight.shape[1] != D:
        raise ValueError(f"linear_cross_entropy: `weight` must be [V, D] = [V, {D}], got {list(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"linear_cross_entropy: `weight` must have hidden's dtype {hidden.dtype} on {hidden.device}, "
                        f"got {weight.dtype} on {weight.device}")
    if tuple(labels.shape) != (N,) or labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"linear_cross_entropy: `labels` must be int32/int64 [N] = [{N}], got {labels.dtype} "
                         f"{list(labels.shape)}")
    if labels.numel() and values_checkable(labels):
        wrong = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(wrong.any()):
            raise ValueError(f"linear_cross_entropy: `labels` must lie in [0, V = {weight.shape[0]}) or equal "
                             f"ignore_index = {ignore_index}, got {int(labels[wrong][0])}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: `reduction` must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: `chunk_size` must be >= 1, got {chunk_size}")
    if backend not in CE_BACKENDS:
        raise ValueError(f"linear_cross_entropy: `backend` must be one of {CE_BACKENDS}, got {backend!r}")


def _uses_kernel(backend: str, hidden: Tensor) -> bool:
    """Whether the chunks' softmax gradient runs in the Triton kernel (else in PyTorch)."""
    if backend == "chunked" or (backend == "auto" and hidden.device.type != "cuda"):
        return False
    reason = triton_refusal(hidden)
    if reason is not None:
        logger.debug("linear_cross_entropy: the triton kernel cannot serve these inputs (%s); chunks in PyTorch",
                     reason)
    return reason is None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
    backend: str = "auto",
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against labels, chunk by chunk, without the full logits.

    Equals ``F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=..., reduction=...)`` (logits in
    the activation dtype, log-sum-exp in fp32), loss and both gradients.

    Args:
        hidden: ``[N, D]`` (e.g. the final norm's output, flattened); weight: ``[V, D]`` (the lm_head), same dtype.
        labels: ``[N]`` int64/int32 in ``[0, V)``; rows equal to ``ignore_index`` add nothing. Values are checked
            on CPU tensors and, with debug checks on (:func:`linmem.ops.set_debug_checks`), on GPU ones; unchecked,
            a label outside ``[0, V)`` other than ignore_index gives a wrong loss.
        chunk_size: rows per chunk; default: as many as make about 2^26 logits.
        reduction: ``"mean"`` (over the rows not ignored; NaN when there are none, as F.cross_entropy) or ``"sum"``.
        backend: ``"auto"`` (the chunks with the Triton softmax-gradient kernel on CUDA, in PyTorch elsewhere),
            ``"triton"``, ``"chunked"`` (PyTorch chunks), ``"reference"`` (the full logits, for tests).

    Returns:
        The loss, an fp32 scalar. Its gradients are computed in the forward when hidden or weight requires grad
        (see the module's docstring for the memory this takes).

    Example:
        >>> h, w = torch.randn(6, 16), torch.randn(50, 16)
        >>> labels = torch.tensor([1, 2, -100, 4, 5, 6])
        >>> loss = linear_cross_entropy(h, w, labels, chunk_size=4)
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(h @ w.T, labels))
        True
    """
    _check(hidden, weight, labels, ignore_index, reduction, chunk_size, backend)
    if backend == "reference":
        return reference.linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction)
    chunk = chunk_size or max(1, CHUNK_LOGITS // weight.shape[0])
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    args = (hidden.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, chunk, reduction == "sum",
            with_grads, _uses_kernel(backend, hidden))
    if torch.compiler.is_compiling():
        return linear_cross_entropy_op(*args)[0]
    return LinearCrossEntropyFn.apply(*args)
