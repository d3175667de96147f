"""Rotary position embedding (rotate-half form) of q and k in one launch, fp32 inside.

For a head x = [x1, x2] (halves of D / 2) at position p, with the angles a_i = p theta^(-2i / D) (in fp64, reduced
to [-pi, pi], then fp32):

    y1 = x1 cos a - x2 sin a,    y2 = x2 cos a + x1 sin a

The backward is the rotation by -a (``dx1 = dy1 cos a + dy2 sin a``, ``dx2 = dy2 cos a - dy1 sin a``): the same
kernel with the sine's sign flipped. One program per token computes cos and sin of its D / 2 angles once and
rotates all heads of q and of k. Inputs are read through their (b, t, head) strides, the last dim contiguous;
outputs are contiguous ``[B, T, H, D]``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...triton_launch import run_kernel
from .common import STAGES, next_power_of_2, rounded

#: elements of one half-head tile (heads x D / 2) a program rotates at a time
TILE = 2048
#: 2 pi as HI + LO: HI has 8 significant bits, so that turns * HI is exact in fp64 (LO is the small rest)
TWO_PI_HI: tl.constexpr = tl.constexpr(6.28125)
TWO_PI_LO: tl.constexpr = tl.constexpr(2 * math.pi - 6.28125)
INV_TWO_PI: tl.constexpr = tl.constexpr(1 / (2 * math.pi))


@triton.jit
def rotate_heads(x, y, x_row, y_row, sxh, H, c, s, HALF, BH: tl.constexpr, BHALF: tl.constexpr):
    """Rotates the H heads of one token: x at x + x_row (head stride sxh), y at y + y_row (contiguous heads);
    c, s: [BHALF] fp32."""
    i = tl.arange(0, BHALF)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        mask = (h < H)[:, None] & (i < HALF)[None, :]
        src = x + x_row + h.to(tl.int64)[:, None] * sxh + i[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = y + y_row + h.to(tl.int64)[:, None] * (2 * HALF) + i[None, :]
        tl.store(dst, rounded(x1 * c[None, :] - x2 * s[None, :], y.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, rounded(x2 * c[None, :] + x1 * s[None, :], y.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(q, k, qo, ko, pos, T, Hq, Hk, HALF, sqb, sqt, sqh, skb, skt, skh, spb, spt, r_hi, r_lo,
                  SIGN: tl.constexpr, HAS_K: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr,
                  BHALF: tl.constexpr, LOG_BHALF: tl.constexpr):
    """qo, ko [B, T, H, D] (contiguous) = q, k rotated by SIGN * angle. Grid (B T,): one program per token.

    r_hi + r_lo = theta^(-2 / D) (an fp32 pair: about 48 bits), so that theta^(-2i / D) = r^i."""
    n = tl.program_id(0)
    b, t = n // T, n % T
    p = tl.load(pos + b.to(tl.int64) * spb + t.to(tl.int64) * spt).to(tl.float64)
    i = tl.arange(0, BHALF)
    # the angles in fp64, r^i from the binary powers of r, then reduced to [-pi, pi] before fp32 cos / sin: as
    # accurate at position 10^6 as at 0 (fp32 angles would be off by p 2^-24 radians), and cos / sin never
    # take their slow path for large arguments
    inv_freq = tl.full([BHALF], 1.0, tl.float64)
    r = (inv_freq * r_hi) + (inv_freq * r_lo)
    for j in tl.static_range(LOG_BHALF):
        inv_freq = tl.where(((i >> j) & 1) == 1, inv_freq * r, inv_freq)
        r = r * r
    angle = p * inv_freq  # [BHALF]
    turns = tl.floor(angle * INV_TWO_PI + 0.5)
    angle = ((angle - turns * TWO_PI_HI) - turns * TWO_PI_LO).to(tl.float32)
    c, s = tl.cos(angle), tl.sin(angle) * SIGN
    b, t, n = b.to(tl.int64), t.to(tl.int64), n.to(tl.int64)
    rotate_heads(q, qo, b * sqb + t * sqt, n * Hq * 2 * HALF, sqh, Hq, c, s, HALF, BHQ, BHALF)
    if HAS_K:
        rotate_heads(k, ko, b * skb + t * skt, n * Hk * 2 * HALF, skh, Hk, c, s, HALF, BHK, BHALF)


@functools.lru_cache(maxsize=64)  # two small tensors a call otherwise; one theta ** (-2 / D) a model
def _fp32_pair(x: float) -> tuple[float, float]:
    """x as hi + lo, both fp32 (the kernels take float arguments as fp32)."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


def _heads_per_tile(H: int, BHALF: int) -> int:
    return max(1, min(next_power_of_2(max(H, 1)), TILE // BHALF))


def rotary_launch(q: Tensor, k: Optional[Tensor], position_ids: Tensor, theta: float,
                  inverse: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """q [B, T, H, D], k [B, T, Hkv, D] or None (last dims contiguous), position_ids [B, T] int32/int64 ->
    (q, k) rotated by the angles (by minus the angles with ``inverse``: the backward), contiguous, in the inputs'
    dtypes."""
    B, T, Hq, D = q.shape
    HALF = D // 2
    BHALF = next_power_of_2(HALF)
    qo = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    ko = None if k is None else torch.empty(k.shape, device=k.device, dtype=k.dtype)
    Hk = 0 if k is None else k.shape[2]
    ks = (0, 0, 0) if k is None else k.stride()[:3]
    if B * T:
        run_kernel(rotary_kernel, (B * T,),
                   (q, q if k is None else k, qo, qo if ko is None else ko, position_ids, T, Hq, Hk, HALF,
                    *q.stride()[:3], *ks, *position_ids.stride(), *_fp32_pair(theta ** (-2.0 / D))),
                   {"SIGN": -1.0 if inverse else 1.0, "HAS_K": k is not None, "BHQ": _heads_per_tile(Hq, BHALF),
                    "BHK": _heads_per_tile(Hk, BHALF), "BHALF": BHALF, "LOG_BHALF": BHALF.bit_length() - 1}, 4, STAGES)
    return qo, ko
