"""Which form of a fused op runs: the Triton kernels or the PyTorch reference.

``backend="auto"`` runs the kernels on CUDA tensors and the reference elsewhere; ``"triton"`` asks for the
kernels (on CPU they run through the Triton interpreter when ``TRITON_INTERPRET=1`` was set before they were
first used); ``"reference"`` runs the PyTorch form. Inputs the kernels cannot serve fall back to the reference,
with the reason logged at debug level.

The kernels are imported on first use, so that the interpreter can still be switched on after ``import linmem``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from types import ModuleType
from typing import Optional

import torch

logger = logging.getLogger("linmem.ops")

#: the names ``backend=`` accepts
BACKENDS = ("auto", "reference", "triton")
#: the kernels take these dtypes (they compute in fp32 inside)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


#: the kernel modules imported so far, by name (``kernels``)
_KERNELS: dict[str, ModuleType] = {}


def kernels(name: str) -> ModuleType:
    """The kernel module ``linmem.ops.fused.triton.<name>``, imported on its first use (see the module docstring)
    and looked up after that: an import statement in a function costs microseconds of host time at every call.

    Example:
        >>> kernels("swiglu").__name__
        'linmem.ops.fused.triton.swiglu'
    """
    module = _KERNELS.get(name)
    if module is None:
        module = _KERNELS[name] = importlib.import_module(f"{__package__}.triton.{name}")
    return module


@functools.lru_cache(maxsize=None)
def _interpreted() -> bool:
    """Whether the kernels run in the interpreter (fixed when the kernels were first imported: looked up once)."""
    from ..recurrence.triton.numerics import INTERPRET

    return INTERPRET


def triton_refusal(x: torch.Tensor) -> Optional[str]:
    """None if the kernels can run on x's device and dtype, else why not."""
    if not _TRITON_INSTALLED:
        return "the triton package is not installed"
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (the kernels take float16, bfloat16, float32)"
    device = x.device.type
    if device == "cuda":
        return None
    if device == "cpu":
        return None if _interpreted() else (
            "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before the kernels are first used)")
    return f"no Triton kernels for {device} tensors"


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def use_triton(op: str, backend: str, x: torch.Tensor, refusal: Optional[str] = None) -> bool:
    """Whether ``op`` runs its kernels on inputs like x; ``refusal`` is the op's own reason not to, if any."""
    check_backend(backend)
    if backend == "reference" or (backend == "auto" and x.device.type != "cuda"):
        return False
    reason = refusal or triton_refusal(x)
    if reason is not None:
        logger.debug("%s: the triton kernels cannot serve these inputs (%s); running the reference", op, reason)
        return False
    return True
