"""The "triton" backend of forgetting attention: a flash forward and backward, and a decoding kernel.

The kernels are imported on first use (at import time on CUDA machines, so that the custom
ops exist before anything is compiled); on CPU-only machines ``TRITON_INTERPRET=1`` set
before then runs them through the Triton interpreter.

What the kernels serve: fp16, bf16 and fp32; head dims 32, 64, 96, 128, 192 and 256, for q/k and
for v independently (96 and 192 in tiles of 128 and 256 whose padded columns are masked), fp32 up to
head dim 128 on CUDA; causal, sliding window, GQA, packed sequences, a key mask, the forget bias and
pruning. Everything else (fp64, other head dims, fp32 above 128 on CUDA, CPU tensors without the
interpreter) goes to the reference or SDPA, with the reason logged at debug level.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

if importlib.util.find_spec("triton") is None:
    raise ImportError("the triton package is not installed")

#: the head dims of q/k and of v that the kernels take (each independently)
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the largest head dim of fp32 inputs on CUDA: above it, every fp32 tile that fits shared memory spills hundreds
#: to thousands of bytes of registers per thread in its tile loops (the tf32x3 products split both operands in two)
FP32_MAX_HEAD_DIM = 128


def _interpreted() -> bool:
    from ...recurrence.triton.numerics import INTERPRET

    return INTERPRET


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """None if the kernels serve these activations, else why not."""
    D, DV = q.shape[-1], v.shape[-1]
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernels take float16, bfloat16, float32)"
    if D not in HEAD_DIMS or DV not in HEAD_DIMS:
        return f"head dims D={D}, Dv={DV} (the kernels take {', '.join(map(str, HEAD_DIMS))}, each)"
    if q.shape[1] == 0 or q.shape[0] == 0:
        return "no tokens"
    device = q.device.type
    if device == "cuda" and q.dtype == torch.float32 and max(D, DV) > FP32_MAX_HEAD_DIM:
        return (f"float32 at head dims D={D}, Dv={DV}: the fp32 tiles above {FP32_MAX_HEAD_DIM} spill registers in "
                f"every tile loop (bf16 and fp16 take the kernels)")
    if device == "cuda":
        return None
    if device == "cpu" and _interpreted():
        return None
    if device == "cpu":
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before the kernels are first used)"
    return f"no Triton kernels for {device} tensors"


def flash_attention(q, k, v, c, key_mask, cu_seqlens, scale, window, tol):
    from .ops import flash_attention as run

    return run(q, k, v, c, key_mask, cu_seqlens, scale, window, tol)


def decode_attention(q, k, v, c, key_mask, scale, window):
    from .ops import decode_attention as run

    return run(q, k, v, c, key_mask, scale, window)


if torch.cuda.is_available():  # the custom ops exist before anything is compiled
    from . import ops  # noqa: E402,F401
