"""Every Triton launch of linmem: :func:`run_kernel`, the fast path past Triton's dispatcher.

Triton's dispatcher (``kernel[grid](...)``) costs 27-45 us of host time per launch (binding, specialising and
keying every argument, building launch metadata, calling the launch hooks), which short sequences and small ops
do not hide behind the GPU. So on CUDA the first launch of each configuration goes through it and keeps the
compiled kernel, keyed on everything the dispatcher keys it on (``_arg_key``, the constexprs, the options, the
device), and later launches call that kernel's launcher directly (16-20 us). This reads Triton's private launcher
attributes (``CompiledKernel.run``, ``function``, ``packed_metadata``, Triton 3.4 on); ``LINMEM_TRITON_FAST_LAUNCH=0``
in the environment before linmem is imported turns it off, and every launch then goes through ``kernel[grid](...)``.
Launches with a launch hook installed (a profiler such as Proton) always take the dispatcher, which builds the
hooks' metadata. Like the dispatcher's own cache, the key assumes that the Triton environment variables that
change code generation (``TRITON_DEBUG``) keep their values once a kernel ran.

The fast path needs the call in the kernel's own order: the runtime arguments positionally, in parameter order
(None for an absent tensor), then every constexpr by name and nothing left to a default. A kernel launched
otherwise is logged at debug level and keeps going through the dispatcher.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

try:  # Triton 3.4 on: the launch hooks live in knobs; before it, every launch goes through the dispatcher
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:
    _knobs = _driver = None

logger = logging.getLogger("linmem.ops")

#: the fast launch path past Triton's dispatcher (see the module docstring); off with LINMEM_TRITON_FAST_LAUNCH=0
FAST_LAUNCH = _knobs is not None and os.environ.get("LINMEM_TRITON_FAST_LAUNCH", "1").lower() not in (
    "0", "false", "off", "no")

#: (kernel, current CUDA device, the arguments' specialization, constexprs, options) -> (the compiled kernel's
#: launcher, its function handle, its packed metadata, the constexprs' values in parameter order), or None where
#: the launcher does not take the arguments that way (then Triton's dispatcher launches it every time)
_COMPILED: dict = {}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of plain integers, for grids and block counts on the host (``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions that cost microseconds a call).

    Example:
        >>> cdiv(130, 64)
        3
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), plain integers as :func:`cdiv`.

    Example:
        >>> next_power_of_2(96)
        128
    """
    return 1 << max(n - 1, 0).bit_length()


def _arg_key(args: tuple) -> tuple:
    """What Triton's dispatcher specializes the arguments before the constexprs on, or more: a tensor's dtype and
    whether its address is 16-byte aligned, None (a constexpr, for an absent tensor), a number's equality to 1,
    divisibility by 16 and 32-bit range."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor) else None if a is None
                  else (a == 1, a % 16 == 0, -2147483648 <= a < 2147483648) for a in args])


def _cache_key(kernel, args: tuple, constexprs: dict, warps: int, stages: int, maxnreg: Optional[int]) -> tuple:
    """The key of ``_COMPILED`` for one launch on the current CUDA device."""
    return kernel, torch.cuda.current_device(), _arg_key(args), *constexprs.items(), warps, stages, maxnreg


def _hooked() -> bool:
    """Whether a launch hook is installed (a profiler such as Proton): those launches go through Triton's
    dispatcher, which builds the hooks' metadata."""
    rt = _knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def run_kernel(kernel, grid: tuple, args: tuple, constexprs: dict, warps: int, stages: int,
               maxnreg: Optional[int] = None, compiled: Optional[tuple] = None) -> Optional[tuple]:
    """``kernel[grid](*args, **constexprs, num_warps=warps, num_stages=stages, maxnreg=maxnreg)`` on the current
    stream, through the fast path on CUDA (module docstring).

    ``args``: the runtime arguments in the kernel's parameter order, the first a tensor (its device picks the
    stream; a CPU tensor runs the interpreter); ``constexprs``: every remaining parameter by name, in the same order
    at every call of one call site. Returns the compiled kernel's entry of ``_COMPILED`` (None in the interpreter,
    with ``FAST_LAUNCH`` off, or where the dispatcher launches it every time), which a later launch of the same
    specialization may pass back as ``compiled`` to skip building the key (the recurrence's launch plans).

    Example::

        run_kernel(swiglu_fwd_kernel, (triton.cdiv(M, BM), triton.cdiv(D, BD)),
                   (g, u, y, M, D, g.stride(0), u.stride(0)), {"BM": BM, "BD": BD}, warps=4, stages=3)
    """
    cuda = args[0].is_cuda  # else the interpreter runs it
    cacheable = cuda and FAST_LAUNCH
    if cacheable and compiled is None:
        key = _cache_key(kernel, args, constexprs, warps, stages, maxnreg)
        compiled = _COMPILED.get(key, False)
    if compiled and not _hooked():
        run, function, metadata, tail = compiled
        x, y, z = grid if len(grid) == 3 else (*grid, 1, 1)[:3]
        run(x, y, z, _driver.active.get_current_stream(args[0].get_device()), function, metadata, None, None, None,
            *args, *tail)
        return compiled
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    launched = kernel[grid](*args, **constexprs, **options)
    if not cacheable or compiled is not False:  # the interpreter, a hooked launch, or a kernel already keyed
        return compiled or None
    names = kernel.arg_names
    if list(getattr(launched.src, "signature", ())) == names and set(names[len(args):]) == set(constexprs):
        entry = (launched.run, launched.function, launched.packed_metadata,
                 tuple(constexprs[n] for n in names[len(args):]))
    else:
        logger.debug("%s launches through Triton's dispatcher (its compiled kernel's signature does not list every "
                     "parameter in order)", kernel.__name__)
        entry = None
    _COMPILED[key] = entry
    return entry
