"""The "triton" backend of the unified recurrence: fused chunk kernels (forward and backward)
and a fused recurrent kernel for decoding.

Importing this package registers the backend (``linmem.ops`` does so when Triton is
installed); on CUDA devices ``backend="auto"`` tries it first. Triton and the kernels are
imported here only when a GPU is present; on CPU-only machines on first use, so that
``TRITON_INTERPRET=1`` set before then runs them through the interpreter (the variable must
be set before ``import triton``).

What the kernels serve: additive writes and the delta rule; no decay, a constant, a scalar
or a per-channel decay; the RWKV-6 bonus (additive rule); fp16, bf16 and fp32 inputs; head
dims up to 256 (K != V allowed); fixed length and ``cu_seqlens`` varlen. Everything else
(full [K, V] decays, the DPLR a/b transition, fp64, larger heads, CPU tensors without the
interpreter) goes to the chunk backend, with the reason logged at debug level.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from ..backends import Backend, StepKernel, register_backend, register_step_kernel
from ..inputs import RecurrenceInputs

if importlib.util.find_spec("triton") is None:
    raise ImportError("the triton package is not installed")

MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernels_interpreted() -> bool:
    from .numerics import INTERPRET

    return INTERPRET


def refusal(inputs: RecurrenceInputs) -> Optional[str]:
    """None if the chunk kernels serve these inputs, else why not."""
    K, V = inputs.q.shape[-1], inputs.v.shape[-1]
    if inputs.rule == "dplr":
        return "the DPLR transition (a, b) has no Triton kernel"
    if inputs.decay_kind == "full":
        return "a full [K, V] decay has no Triton kernel"
    if inputs.rule == "delta" and inputs.bonus is not None:
        return "the delta rule with a bonus has no Triton kernel"
    if inputs.q.dtype not in DTYPES:
        return f"dtype {inputs.q.dtype} (the kernels take float16, bfloat16, float32)"
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return f"head dims K={K}, V={V} (the kernels take up to {MAX_HEAD_DIM})"
    if inputs.q.shape[1] == 0:
        return "no tokens"
    device = inputs.q.device.type
    if device == "cuda":
        return None
    if device == "cpu" and _kernels_interpreted():
        return None
    if device == "cpu":
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before the kernels are first used)"
    return f"no Triton kernels for {device} tensors"


def step_refusal(inputs: RecurrenceInputs, state: torch.Tensor) -> Optional[str]:
    """None if the fused recurrent kernel serves this decoding step, else why not."""
    if inputs.q.device.type != "cuda":
        return "the decoding kernel runs on CUDA tensors"
    if not state.is_contiguous():
        return "the state is not contiguous (it is updated in place)"
    return refusal(inputs)


def _backend_fn(inputs: RecurrenceInputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    from .ops import triton_recurrence

    return triton_recurrence(inputs)


def _step_fn(inputs: RecurrenceInputs, state: torch.Tensor) -> torch.Tensor:
    from .ops import triton_step

    return triton_step(inputs, state)


register_backend(Backend("triton", _backend_fn, refusal), auto_priority=0 if torch.cuda.is_available() else None)
register_step_kernel(StepKernel("triton", _step_fn, step_refusal))
if torch.cuda.is_available():  # the custom ops exist before anything is compiled
    from . import ops  # noqa: E402,F401
