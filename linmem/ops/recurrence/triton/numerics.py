"""Arithmetic of the kernels' tiles: reductions, rounding, matrix products and exponentials.

Every helper here is spelled with Triton builtins only: ``triton.language``'s own jit helpers (``tl.sum``,
``tl.zeros``, ...) are fixed when ``triton`` is imported, and the interpreter refuses them inside a kernel when
``TRITON_INTERPRET=1`` was set only after that import (the CPU test suite does so).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: log2(e): the cumulative gates G of the chunk kernels are log2(e) times the cumulative log decays
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
#: True when the kernels run on the CPU through the Triton interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
_INTERP: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def total(x, axis: tl.constexpr):
    """tl.sum, spelled with Triton builtins only.

    ``triton.language``'s own helpers are jit functions fixed when ``triton`` is imported; these
    work in the interpreter even when TRITON_INTERPRET=1 was set only after that import.
    """
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def largest(x, axis: tl.constexpr):
    """tl.max, spelled with Triton builtins only (see :func:`total`)."""
    return tl.reduce(x, axis, _larger)


@triton.jit
def running_total(x, axis: tl.constexpr):
    """tl.cumsum (inclusive), spelled with Triton builtins only (see :func:`total`)."""
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def remaining_total(x, axis: tl.constexpr):
    """The reverse inclusive cumulative sum (element i: the sum of elements i, i + 1, ... along axis), spelled
    with Triton builtins only (see :func:`total`)."""
    return tl.associative_scan(x, axis, tl.standard._sum_combine, reverse=True)


@triton.jit
def rounded(x, DT: tl.constexpr):
    """x rounded to DT (round to nearest even), as DT.

    The interpreter truncates fp32 -> bf16; there the rounding is done on the bits first, so
    the CPU sees the same precision as the GPU.
    """
    if _INTERP and DT == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def mm(a, b, DT: tl.constexpr, X: tl.constexpr):
    """a @ b with both operands rounded to the dot dtype DT, fp32 accumulation.

    X: the kernel's inputs are fp32, so products keep about fp32's accuracy: three tf32 tensor-core products
    (``tf32x3``; IEEE fp32 products run without tensor cores, and their kernels spill). fp32 intermediates of
    bf16/fp16 inputs use tf32 products. The interpreter multiplies bf16 bit patterns as integers, so there the
    rounded operands are widened to fp32.
    """
    a = rounded(a, DT)
    b = rounded(b, DT)
    if _INTERP:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if X and DT == tl.float32:
        acc = tl.dot(a, b, input_precision="tf32x3")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def bf16_parts(x):
    """fp32 x as (hi, lo): its bf16 rounding and the bf16 rounding of the remainder, whose sum keeps about 16 of x's
    mantissa bits (the operands of :func:`mm_split` and :func:`mm_parts`)."""
    hi = rounded(x, tl.bfloat16)
    return hi, bf16_rest(x, hi)


@triton.jit
def bf16_rest(x, hi):
    """The bf16 rounding of x - hi, for fp32 x and its bf16 rounding hi (the lo of :func:`bf16_parts`)."""
    return rounded(x - hi.to(tl.float32), tl.bfloat16)


@triton.jit
def mm_split(a, b):
    """a @ b as bf16 products, for bf16 or fp32 operands: an fp32 operand is split into ``hi`` (rounded to bf16)
    and ``lo`` (the rest, rounded to bf16), which keeps about 16 of its mantissa bits (tf32 keeps 10) without an
    fp32 copy of the other operand. ``hi a @ hi b``, then ``hi a @ lo b`` and ``lo a @ hi b`` where those exist
    (the product of two remainders is left out). fp32 accumulation."""
    ah = rounded(a, tl.bfloat16)
    bh = rounded(b, tl.bfloat16)
    if a.dtype != tl.bfloat16:
        al = bf16_rest(a, ah)
    if b.dtype != tl.bfloat16:
        bl = bf16_rest(b, bh)
    if _INTERP:
        ah = ah.to(tl.float32)
        bh = bh.to(tl.float32)
        if a.dtype != tl.bfloat16:
            al = al.to(tl.float32)
        if b.dtype != tl.bfloat16:
            bl = bl.to(tl.float32)
    acc = tl.dot(ah, bh)
    if b.dtype != tl.bfloat16:
        acc = tl.dot(ah, bl, acc)
    if a.dtype != tl.bfloat16:
        acc = tl.dot(al, bh, acc)
    return acc


@triton.jit
def mm_parts(ah, al, b):
    """(ah + al) @ b as two bf16 products, for an fp32 left factor already split into its bf16 part ah and the bf16
    rounding of its remainder al (:func:`bf16_parts`, done once where the factor is reused), b bf16. fp32
    accumulation."""
    if _INTERP:
        ah = ah.to(tl.float32)
        al = al.to(tl.float32)
        b = b.to(tl.float32)
    acc = tl.dot(ah, b)
    return tl.dot(al, b, acc)


@triton.jit
def mm_wide(a, b, X: tl.constexpr):
    """a @ b for a stored score gradient a (bf16, or fp32 for fp16 and fp32 inputs) and an fp32 b of any range (a
    per-channel decay's factors, up to 2^CHUNK_SPAN). A bf16 a enters the tensor cores as loaded, b as its bf16
    parts (:func:`mm_split`: two bf16 products, about 16 of b's mantissa bits); an fp32 a takes one tf32 product
    (tf32x3 for fp32 inputs, X). fp32 accumulation.

    ``grads_kernel`` takes it for a per-channel decay's one-reference chunks (not RWKV-6's): one tf32 product on
    the widened bf16 dA spends a tenth of that kernel's warp samples on the widening and its change of layout (the
    transposed dA goes through shared memory 16 bits at a time), and b keeps 16 mantissa bits instead of tf32's 10.
    ``intra_grads_kernel``'s [16, 16] products and RWKV-6's one-reference products keep tf32, where this is
    slower; so do the WY products on dL (``wy_grads.py``), where bf16 products are miscompiled."""
    if a.dtype == tl.bfloat16:
        return mm_split(a, b)
    return mm(a, b, tl.float32, X)


@triton.jit
def exp2(x):
    """2^x of fp32 x as one ``ex2.approx.ftz`` (results under 2^-126 flush to 0); tl.exp2 in the interpreter.

    tl.exp compiles to the same instruction plus a multiply by log2(e) and three instructions that
    keep results in the subnormal range, which no decay here needs. The chunk kernels keep their
    cumulative gates in log2 units, so each decay is this one instruction.
    """
    if _INTERP:
        y = tl.exp2(x)
    else:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return y


@triton.jit
def exp(x):
    """e^x of fp32 x (see :func:`exp2`)."""
    return exp2(x * LOG2E)


@triton.jit
def masked_exp2(mask, x):
    """2^x where mask, exactly 0 elsewhere (the exponent is masked first, so nothing overflows)."""
    return exp2(tl.where(mask, x, float("-inf")))
