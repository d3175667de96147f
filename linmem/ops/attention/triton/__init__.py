"""The "triton" backend of forgetting attention: a flash forward and backward, and a decoding kernel.

The kernels are imported on first use (at import time on CUDA machines, so that the custom
ops exist before anything is compiled); on CPU-only machines ``TRITON_INTERPRET=1`` set
before then runs them through the Triton interpreter.

What the kernels serve: fp16, bf16 and fp32; head dims 64 and 128 (q/k and v each); causal,
sliding window, GQA, packed sequences, a key mask, the forget bias and pruning. Everything
else (fp64, other head dims, CPU tensors without the interpreter) goes to the reference or
SDPA, with the reason logged at debug level.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

if importlib.util.find_spec("triton") is None:
    raise ImportError("the triton package is not installed")

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreted() -> bool:
    from ...recurrence.triton.numerics import INTERPRET

    return INTERPRET


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """None if the kernels serve these activations, else why not."""
    D, DV = q.shape[-1], v.shape[-1]
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernels take float16, bfloat16, float32)"
    if D not in HEAD_DIMS or DV not in HEAD_DIMS:
        return f"head dims D={D}, Dv={DV} (the kernels take {' or '.join(map(str, HEAD_DIMS))})"
    if q.shape[1] == 0 or q.shape[0] == 0:
        return "no tokens"
    device = q.device.type
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
