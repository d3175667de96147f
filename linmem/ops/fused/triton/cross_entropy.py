"""The softmax-gradient step of the chunked linear + cross-entropy, in place on a chunk of logits.

Per row r of logits z [R, V] (the activation dtype) with label l, in two passes over V in blocks::

    lse = log sum_v e^(z_v)      (online: a running max and a rescaled running sum, fp32)
    loss_r = lse - z_l
    z <- (softmax(z) - onehot(l)) * scale           (0 for an ignored row)

so the chunk's logits become dL/dz without an fp32 copy of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...triton_launch import run_kernel
from .common import STAGES, exp, largest, next_power_of_2, rounded, total

#: vocabulary entries per block of a row
BLOCK_V = 4096


@triton.jit
def ce_grad_kernel(logits, labels, loss, scale, V, stride, ignore_index, GRAD: tl.constexpr, BV: tl.constexpr):
    """loss [R] fp32 (0 for ignored rows); GRAD: logits [R, V] (row stride ``stride``) overwritten with
    (softmax - onehot(label)) * scale[0]. Grid (R,)."""
    r = tl.program_id(0)
    row = logits + r.to(tl.int64) * stride
    label = tl.load(labels + r).to(tl.int32)
    keep = label != ignore_index
    cols = tl.arange(0, BV)
    top = largest(tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32), 0)
    sum_exp = 0.0
    for v0 in range(0, V, BV):
        z = tl.load(row + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, largest(z, 0))
        sum_exp = sum_exp * exp(top - new_top) + total(exp(z - new_top), 0)
        top = new_top
    lse = top + tl.log(sum_exp)
    target = tl.load(row + label, mask=keep & (label >= 0) & (label < V), other=0.0).to(tl.float32)
    tl.store(loss + r, tl.where(keep, lse - target, 0.0))
    if GRAD:
        s = tl.where(keep, tl.load(scale), 0.0)
        for v0 in range(0, V, BV):
            at = v0 + cols
            z = tl.load(row + at, mask=at < V, other=0.0).to(tl.float32)
            g = exp(z - lse) * s - tl.where(at == label, s, 0.0)
            tl.store(row + at, rounded(g, logits.dtype.element_ty), mask=at < V)


def softmax_grad_(logits: Tensor, labels: Tensor, scale: Tensor, ignore_index: int, grad: bool) -> Tensor:
    """logits [R, V] (last dim contiguous), labels [R], scale [1] fp32 -> loss [R] fp32; with ``grad`` the
    logits are overwritten with dL/dlogits (times scale)."""
    R, V = logits.shape
    loss = torch.empty(R, device=logits.device, dtype=torch.float32)
    BV = min(BLOCK_V, next_power_of_2(V))
    run_kernel(ce_grad_kernel, (R,), (logits, labels, loss, scale, V, logits.stride(0), ignore_index),
               {"GRAD": grad, "BV": BV}, 8 if BV >= 2048 else 4, STAGES)
    return loss
