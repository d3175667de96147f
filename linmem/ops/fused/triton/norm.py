"""Row norms: RMSNorm (with the residual add, or with an output gate) and the L2 norm, forward and backward.

Rows are read as ``[M, H, D]`` with a stride per m and per h for every input (so a head split of a fused
projection is read in place), the norm is over D; outputs are contiguous. Statistics in fp32; the backward
recomputes them from its saved input instead of saving them (one pass over a row it reads anyway).

RMSNorm, with h = x (+ residual), r = 1 / sqrt(mean(h^2) + eps), n = h r w, y = n act(gate)::

    dn = dy act(gate),   dgate = dy n act'(gate),   dw = sum_rows dn h r,
    dh = r (dn w - h r mean(dn w h r)) (+ the gradient of the returned h)

L2 norm, y = x r with r = 1 / sqrt(sum(x^2) + eps): ``dx = r (dy - y sum(dy y))``, from the saved y and r
(y is what the recurrence saves as q or k anyway; r is 4 bytes a row).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...checks import as_dtype
from ...triton_launch import cdiv, run_kernel
from .common import STAGES, activate, activation_grad, next_power_of_2, rounded, total

#: elements of a row tile (rows x padded D): with 8 warps at most about 120 registers on sm_90, no spills
TILE = 2048
#: the most D the kernels hold in one tile row
MAX_D = 16384


@triton.jit
def rows_at(ptr, m, h, d, sm, sh):
    """Pointers of rows m (of head h) in an [M, H, D] tensor with strides (sm, sh, 1)."""
    return ptr + m.to(tl.int64)[:, None] * sm + h * sh + d[None, :]


@triton.jit
def rms_norm_fwd_kernel(x, res, gate, w, y, h, M, H, D, sxm, sxh, srm, srh, sgm, sgh, swh, eps,
                        HAS_RES: tl.constexpr, GATE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """y = norm(x (+ res)) w (act(gate)); h = x + res (rounded to h's dtype, the norm's input). y, h contiguous
    [M, H, D]. Grid (M blocks, H)."""
    hh = tl.program_id(1)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.arange(0, BD)
    mask = (m < M)[:, None] & (d < D)[None, :]
    v = tl.load(rows_at(x, m, hh, d, sxm, sxh), mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        v = rounded(v + tl.load(rows_at(res, m, hh, d, srm, srh), mask=mask, other=0.0).to(tl.float32),
                    h.dtype.element_ty)
        tl.store(rows_at(h, m, hh, d, H * D, D), v, mask=mask)
        v = v.to(tl.float32)
    r = 1.0 / tl.sqrt(total(v * v, 1) / D + eps)
    out = v * r[:, None] * tl.load(w + hh * swh + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    if GATE != 0:
        out *= activate(tl.load(rows_at(gate, m, hh, d, sgm, sgh), mask=mask, other=0.0).to(tl.float32), GATE)
    tl.store(rows_at(y, m, hh, d, H * D, D), rounded(out, y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(x, gate, w, dy, dh, dx, dgate, dw, M, H, D, sxm, sxh, sgm, sgh, swh, eps,
                        HAS_DH: tl.constexpr, GATE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """dx (and dgate) for the row blocks g, g + G, ... of head h, and this program's share of dw [G, H, D]
    (fp32). x is the norm's input (h with a residual); dy, dh, dx, dgate contiguous. Grid (G, H)."""
    g = tl.program_id(0)
    hh = tl.program_id(1)
    d = tl.arange(0, BD)
    md = d < D
    wv = tl.load(w + hh * swh + d, mask=md, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros((BD,), tl.float32)
    for mb in range(g, tl.cdiv(M, BM), tl.num_programs(0)):
        m = mb * BM + tl.arange(0, BM)
        mask = (m < M)[:, None] & md[None, :]
        v = tl.load(rows_at(x, m, hh, d, sxm, sxh), mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(total(v * v, 1) / D + eps)
        xhat = v * r[:, None]
        dn = tl.load(rows_at(dy, m, hh, d, H * D, D), mask=mask, other=0.0).to(tl.float32)
        if GATE != 0:
            gv = tl.load(rows_at(gate, m, hh, d, sgm, sgh), mask=mask, other=0.0).to(tl.float32)
            tl.store(rows_at(dgate, m, hh, d, H * D, D),
                     rounded(dn * xhat * wv * activation_grad(gv, GATE), dgate.dtype.element_ty), mask=mask)
            dn *= activate(gv, GATE)
        acc += total(dn * xhat, 0)
        dnw = dn * wv
        grad = r[:, None] * (dnw - xhat * (total(dnw * xhat, 1) / D)[:, None])
        if HAS_DH:
            grad += tl.load(rows_at(dh, m, hh, d, H * D, D), mask=mask, other=0.0).to(tl.float32)
        tl.store(rows_at(dx, m, hh, d, H * D, D), rounded(grad, dx.dtype.element_ty), mask=mask)
    tl.store(dw + (g * H + hh) * D + d, acc, mask=md)


@triton.jit
def l2_norm_fwd_kernel(x, y, rinv, M, H, D, sxm, sxh, eps, BM: tl.constexpr, BD: tl.constexpr):
    """y = x / sqrt(sum(x^2) + eps) (contiguous [M, H, D]) and rinv [M, H] = its 1 / sqrt. Grid (M blocks, H)."""
    hh = tl.program_id(1)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.arange(0, BD)
    mask = (m < M)[:, None] & (d < D)[None, :]
    v = tl.load(rows_at(x, m, hh, d, sxm, sxh), mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(total(v * v, 1) + eps)
    tl.store(rows_at(y, m, hh, d, H * D, D), rounded(v * r[:, None], y.dtype.element_ty), mask=mask)
    tl.store(rinv + m.to(tl.int64) * H + hh, r, mask=m < M)


@triton.jit
def l2_norm_bwd_kernel(y, rinv, dy, dx, R, D, BR: tl.constexpr, BD: tl.constexpr):
    """dx = r (dy - y sum(dy y)) for R contiguous rows of D. Grid (R blocks,)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    mask = (rows < R)[:, None] & (d < D)[None, :]
    at = rows.to(tl.int64)[:, None] * D + d[None, :]
    yv = tl.load(y + at, mask=mask, other=0.0).to(tl.float32)
    dyv = tl.load(dy + at, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rinv + rows, mask=rows < R, other=0.0)
    grad = r[:, None] * (dyv - yv * total(dyv * yv, 1)[:, None])
    tl.store(dx + at, rounded(grad, dx.dtype.element_ty), mask=mask)


def _tile(M: int, D: int) -> tuple[int, int]:
    """(rows per tile, padded D)."""
    BD = next_power_of_2(D)
    return max(1, min(next_power_of_2(M), TILE // BD)), BD


def _warps(BD: int) -> int:
    """8 warps (8 elements a thread) for tiles of TILE elements; 16 for longer rows."""
    return 8 if BD <= TILE else 16


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(blocks: int, H: int, device: torch.device) -> int:
    """Programs per head of a backward that loops over row blocks (each keeps one dw share): about four per SM."""
    if device.type != "cuda":
        return min(blocks, 4)
    return max(1, min(blocks, 4 * _sm_count(device.index if device.index is not None else 0) // H))


def _strides(t: Optional[Tensor]) -> tuple[int, int]:
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def rms_norm_forward(x: Tensor, weight: Tensor, residual: Optional[Tensor], gate: Optional[Tensor], eps: float,
                     act: int, out_dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    """x, residual, gate: [M, H, D] (last dim contiguous); weight [D] or [H, D] contiguous.
    -> (y in out_dtype, h = x + residual in residual's dtype or None), contiguous [M, H, D]."""
    M, H, D = x.shape
    BM, BD = _tile(M, D)
    y = torch.empty(M, H, D, device=x.device, dtype=out_dtype)
    h = torch.empty(M, H, D, device=x.device, dtype=residual.dtype) if residual is not None else None
    run_kernel(rms_norm_fwd_kernel, (cdiv(M, BM), H),
               (x, residual, gate, weight, y, h, M, H, D, *_strides(x), *_strides(residual), *_strides(gate),
                D if weight.ndim == 2 else 0, eps),
               {"HAS_RES": residual is not None, "GATE": act, "BM": BM, "BD": BD}, _warps(BD), STAGES)
    return y, h


def rms_norm_backward(x: Tensor, gate: Optional[Tensor], weight: Tensor, dy: Tensor, dh: Optional[Tensor],
                      eps: float, act: int) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """x: the norm's input [M, H, D]; -> (dx, dgate or None, dweight in weight's dtype)."""
    M, H, D = x.shape
    BM, BD = _tile(M, D)
    G = _programs(cdiv(M, BM), H, x.device)
    dy = dy.contiguous()
    dh = None if dh is None else dh.contiguous()
    dx = torch.empty(M, H, D, device=x.device, dtype=x.dtype)
    dgate = torch.empty(M, H, D, device=x.device, dtype=gate.dtype) if gate is not None else None
    dw = torch.empty(G, H, D, device=x.device, dtype=torch.float32)
    run_kernel(rms_norm_bwd_kernel, (G, H),
               (x, gate, weight, dy, dh, dx, dgate, dw, M, H, D, *_strides(x), *_strides(gate),
                D if weight.ndim == 2 else 0, eps),
               {"HAS_DH": dh is not None, "GATE": act, "BM": BM, "BD": BD}, _warps(BD), STAGES)
    dweight = dw.sum(0) if weight.ndim == 2 else dw.sum((0, 1))
    return dx, dgate, as_dtype(dweight, weight.dtype)


def l2_norm_forward(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x: [M, H, D] (last dim contiguous) -> (y contiguous [M, H, D] in x's dtype, rinv [M, H] fp32)."""
    M, H, D = x.shape
    BM, BD = _tile(M, D)
    y = torch.empty(M, H, D, device=x.device, dtype=x.dtype)
    rinv = torch.empty(M, H, device=x.device, dtype=torch.float32)
    run_kernel(l2_norm_fwd_kernel, (cdiv(M, BM), H), (x, y, rinv, M, H, D, *_strides(x), eps),
               {"BM": BM, "BD": BD}, _warps(BD), STAGES)
    return y, rinv


def l2_norm_backward(y: Tensor, rinv: Tensor, dy: Tensor) -> Tensor:
    """y: [M, H, D] contiguous, rinv [M, H] -> dx [M, H, D]."""
    M, H, D = y.shape
    BR, BD = _tile(M * H, D)
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    run_kernel(l2_norm_bwd_kernel, (cdiv(M * H, BR),), (y, rinv, dy, dx, M * H, D), {"BR": BR, "BD": BD},
               _warps(BD), STAGES)
    return dx
