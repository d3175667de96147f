"""The SwiGLU activation y = silu(g) u, forward and backward, fp32 inside.

Backward from the inputs alone (nothing else is saved): ``du = dy silu(g)``,
``dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g)))``. g and u are read as ``[M, D]`` with a row stride each
(the two halves of a fused gate-up projection are read in place); outputs are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...triton_launch import cdiv, run_kernel
from .common import STAGES, activate, activation_grad, next_power_of_2, rounded

#: columns per program
BLOCK_D = 1024
#: elements per program
TILE = 4096
#: warps per program (16 elements a thread: about 110 registers on sm_90 for the backward, no spills)
WARPS = 8


@triton.jit
def swiglu_fwd_kernel(g, u, y, M, D, sgm, sum_, BM: tl.constexpr, BD: tl.constexpr):
    """y [M, D] (contiguous) = silu(g) u. Grid (M blocks, D blocks)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (m < M)[:, None] & (d < D)[None, :]
    m = m.to(tl.int64)[:, None]
    gv = tl.load(g + m * sgm + d[None, :], mask=mask, other=0.0).to(tl.float32)
    uv = tl.load(u + m * sum_ + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + m * D + d[None, :], rounded(activate(gv, 1) * uv, y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(g, u, dy, dg, du, M, D, sgm, sum_, BM: tl.constexpr, BD: tl.constexpr):
    """dg, du [M, D] (contiguous) from g, u and dy (contiguous). Grid (M blocks, D blocks)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (m < M)[:, None] & (d < D)[None, :]
    m = m.to(tl.int64)[:, None]
    gv = tl.load(g + m * sgm + d[None, :], mask=mask, other=0.0).to(tl.float32)
    uv = tl.load(u + m * sum_ + d[None, :], mask=mask, other=0.0).to(tl.float32)
    dyv = tl.load(dy + m * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(du + m * D + d[None, :], rounded(dyv * activate(gv, 1), du.dtype.element_ty), mask=mask)
    tl.store(dg + m * D + d[None, :], rounded(dyv * uv * activation_grad(gv, 1), dg.dtype.element_ty), mask=mask)


def _tile(M: int, D: int) -> tuple[int, int]:
    BD = min(BLOCK_D, next_power_of_2(D))
    return max(1, min(next_power_of_2(M), TILE // BD)), BD


def swiglu_forward(g: Tensor, u: Tensor) -> Tensor:
    """g, u: [M, D] (last dim contiguous) -> y [M, D] contiguous in g's dtype."""
    M, D = g.shape
    BM, BD = _tile(M, D)
    y = torch.empty(M, D, device=g.device, dtype=g.dtype)
    run_kernel(swiglu_fwd_kernel, (cdiv(M, BM), cdiv(D, BD)), (g, u, y, M, D, g.stride(0), u.stride(0)),
               {"BM": BM, "BD": BD}, WARPS, STAGES)
    return y


def swiglu_backward(g: Tensor, u: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """-> (dg, du), contiguous [M, D] in the dtypes of g and u."""
    M, D = g.shape
    BM, BD = _tile(M, D)
    dy = dy.contiguous()
    dg = torch.empty(M, D, device=g.device, dtype=g.dtype)
    du = torch.empty(M, D, device=u.device, dtype=u.dtype)
    run_kernel(swiglu_bwd_kernel, (cdiv(M, BM), cdiv(D, BD)),
               (g, u, dy, dg, du, M, D, g.stride(0), u.stride(0)), {"BM": BM, "BD": BD}, WARPS, STAGES)
    return dg, du
