"""Pieces shared by the fused kernels: activations and their derivatives (fp32 inside), their launches' defaults."""

from __future__ import annotations

import triton
import triton.language as tl

from ...recurrence.triton.numerics import exp, largest, rounded, total
from ...triton_launch import next_power_of_2

__all__ = ["exp", "largest", "rounded", "total", "activate", "activation_grad", "next_power_of_2", "STAGES",
           "DEFAULT_WARPS"]

#: software-pipelining stages of every fused kernel's launch (Triton's default on CUDA)
STAGES = 3
#: warps of a launch whose kernel names none of its own (Triton's default)
DEFAULT_WARPS = 4


@triton.jit
def activate(z, ACT: tl.constexpr):
    """ACT 0: z; 1: silu(z) = z sigmoid(z); 2: sigmoid(z) = 1 / (1 + e^-z) (0 and 1 at the ends, no NaN).

    The activations call no helper: every nested call costs the interpreter a few milliseconds."""
    if ACT == 1:
        z = z / (1.0 + tl.exp(-z))
    elif ACT == 2:
        z = 1.0 / (1.0 + tl.exp(-z))
    return z


@triton.jit
def activation_grad(z, ACT: tl.constexpr):
    """d act(z) / dz: 1; sigmoid(z) (1 + z (1 - sigmoid(z))); sigmoid(z) (1 - sigmoid(z))."""
    if ACT == 0:
        g = tl.full(z.shape, 1.0, tl.float32)
    else:
        s = 1.0 / (1.0 + tl.exp(-z))
        if ACT == 1:
            g = s * (1.0 + z * (1.0 - s))
        else:
            g = s * (1.0 - s)
    return g
