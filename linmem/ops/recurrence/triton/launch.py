"""How the stages launch their kernels: configs that fit, launch plans, and the fast path past Triton's dispatcher.

A stage's launcher calls :func:`launch_kernel` (or :func:`launch_sequential` for the sequential passes) with its
launch name, kernel, grid, arguments and constexprs. The first call of a name under a plan looks its config up in
``configs`` and, where its software pipelining does not fit the device's shared memory, steps down to one that
fits; the plan (:func:`plan_for`, one per launcher call shape) keeps the result for the next call.

The fast path (:func:`_run`): Triton's dispatcher costs 27-45 us of host time per launch (binding, specialising
and keying every argument, building launch metadata, calling the launch hooks), which short sequences do not hide
behind the GPU. So on CUDA the first launch of each configuration goes through it and keeps the compiled kernel,
keyed on everything the dispatcher keys it on (``_arg_key``, the constexprs, the options, the device), and later
launches call that kernel's launcher directly (16-20 us). This reads Triton's private launcher attributes
(``CompiledKernel.run``, ``function``, ``packed_metadata``, Triton 3.4 on); ``LINMEM_TRITON_FAST_LAUNCH=0`` in the
environment before linmem is imported turns it off, and every launch then goes through ``kernel[grid](...)``.
Launches with a launch hook installed (a profiler such as Proton) always take the dispatcher, which builds the
hooks' metadata. Like the dispatcher's own cache, the key assumes that the Triton environment variables that
change code generation (``TRITON_DEBUG``) keep their values once a kernel ran.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch
import triton.runtime.errors

try:  # Triton 3.4 on: the launch hooks live in knobs; before it, every launch goes through the dispatcher
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:
    _knobs = _driver = None

from . import configs
from .configs import Shapes, cdiv

logger = logging.getLogger("linmem.ops")

#: the fast launch path past Triton's dispatcher (see the module docstring); off with LINMEM_TRITON_FAST_LAUNCH=0
FAST_LAUNCH = _knobs is not None and os.environ.get("LINMEM_TRITON_FAST_LAUNCH", "1").lower() not in (
    "0", "false", "off", "no")

#: (kernel, current CUDA device, the arguments' specialization, constexprs, options) -> (the compiled kernel's
#: launcher, its function handle, its packed metadata, the constexprs' values in parameter order), or None where
#: the launcher does not take the arguments that way (then Triton's dispatcher launches it every time)
_COMPILED: dict = {}


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


def _run(kernel, grid: tuple, args: tuple, constexprs: dict, warps: int, stages: int,
         maxnreg: Optional[int] = None, compiled: Optional[tuple] = None) -> Optional[tuple]:
    """kernel[grid](*args, **constexprs) at these warps, stages and register cap, on the current stream; returns
    the compiled kernel's entry of ``_COMPILED`` (None in the interpreter, with ``FAST_LAUNCH`` off, or where
    Triton's dispatcher launches it every time), which a later launch of the same specialization passes back as
    ``compiled`` (the plans of :func:`launch_kernel`) to skip building the key. The fast path: see the module
    docstring."""
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
        logger.debug("linear_recurrence: %s launches through Triton's dispatcher (its compiled kernel's "
                     "signature does not list every parameter in order)", kernel.__name__)
        entry = None
    _COMPILED[key] = entry
    return entry


#: plan key (``plan_for``) -> {launch name: what ``launch_kernel`` or ``launch_sequential`` found for it}, the oldest
#: dropped past ``_PLANS_KEPT`` (varlen batches of changing lengths make a key each)
_PLANS: dict = {}
_PLANS_KEPT = 512
#: the settings' generation (``configs.generation``) the plans were made under
_PLANS_GENERATION = [-1]


def plan_for(launcher: str, *parts) -> dict:
    """The launch plan of one call of ``launcher``, keyed on ``parts`` (the call's arguments, the first a tensor: its
    device; of every tensor its dtype, shape and whether its address is 16-byte aligned; other values as given;
    None for absent ones). Its launches then take, by name, the config that fitted and the compiled kernel of the
    last call with that key: no config search, no per-launch key. A change of the settings (``configs.override``)
    drops every plan at the next call.

    Everything a launch depends on is a function of that key: its constexprs and integers (the shapes), its configs
    (the settings and the device's SMs), and the specialization of its tensors (the arguments' dtypes and
    alignment; the buffers the launchers allocate are fresh, so aligned). ``test_plans_key_every_launch`` checks
    that: one key, one launch specialization."""
    if _PLANS_GENERATION[0] != configs.generation():
        _PLANS.clear()
        _PLANS_GENERATION[0] = configs.generation()
    key = (launcher, parts[0].device,
           *[(p.dtype, p.shape, not p.data_ptr() & 15) if isinstance(p, torch.Tensor) else p for p in parts])
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
        plan = _PLANS[key] = {}
    return plan


#: (kernel, input dtype, its constexprs' values, first config) -> the first config of its fallbacks that fit in
#: shared memory
_FITTING: dict = {}


def _launch_fitting(name: str, tries: list, launch, describe, args: tuple, constexprs: dict) -> tuple:
    """launch(config) for the first of ``tries`` whose software pipelining fits the device's shared memory
    (fp32 or K = 256 tiles), starting from the one that fitted for the same kernel, input dtype, constexprs
    and ``tries`` before; each miss is logged at debug level, ``describe(config)`` naming the config. Returns
    that config and what launch returned.

    The first argument is an input activation, whose dtype fixes every other tensor's, and each kernel
    name has one call site, which passes its constexprs in one order: so the key reads one dtype, which arguments
    are absent (None) and the constexprs' values as given (sorting them and reading every argument's dtype would
    cost microseconds a launch)."""
    key = (name, args[0].dtype, *[a is None for a in args], *constexprs.values(), tries[0])
    if key in _FITTING:
        tries = tries[tries.index(_FITTING[key]):]
    for i, config in enumerate(tries):
        try:
            launched = launch(config)
            _FITTING[key] = config
            return config, launched
        except triton.runtime.errors.OutOfResources as error:
            if i == len(tries) - 1:
                raise
            logger.debug("linear_recurrence: %s %s does not fit (%s); trying %s", name, describe(config), error,
                         describe(tries[i + 1]))


def launch_kernel(plan: dict, name: str, kernel, grid: tuple, *args, **constexprs) -> None:
    """kernel[grid](*args) with the ``configs.LAUNCH`` config (warps, stages) of ``name`` (and its
    ``configs.MAX_REGISTERS``); a config whose software pipelining does not fit the device's shared memory runs with
    one stage fewer, until it fits. ``plan`` (:func:`plan_for`) keeps the config and the compiled kernel for the
    call's next launch of ``name``."""
    planned = plan.get(name)
    if planned is not None:
        warps, stages, cap, compiled = planned
        _run(kernel, grid, args, constexprs, warps, stages, cap, compiled)
        return
    warps, stages = configs.LAUNCH[name]
    cap = configs.MAX_REGISTERS.get(name)
    stages, compiled = _launch_fitting(name, list(range(stages, 0, -1)),
                                       lambda st: _run(kernel, grid, args, constexprs, warps, st, cap),
                                       lambda st: f"with {st} stages", args, constexprs)
    plan[name] = (warps, stages, cap, compiled)


def _sequential_fallbacks(bv: int, stages: int) -> list[tuple[int, int]]:
    """(V block, stages) to try in order: the configured ones, fewer stages down to 2, then V blocks halved down
    to 16 at 2 stages, then 1 stage at the configured V block (the last resort: see below)."""
    # WORKAROUND(triton 3.6, sm_90): the gated delta rule's backward pass at 1 stage is miscompiled (K = 256, 128)
    tries = [(bv, st) for st in range(stages, 1, -1)]
    if stages >= 2:
        b = bv // 2
        while b >= 16:
            tries.append((b, 2))
            b //= 2
    return tries + [(bv, 1)]


def launch_sequential(plan: dict, name: str, kernel, s: Shapes, delta: bool, decay: int, *args, **constexprs) -> None:
    """A sequential pass, grid (V blocks, N * H), at the (V block, stages) of ``configs.sequential_config``. A config
    whose pipelining does not fit the device's shared memory (K = 256, fp32) takes the next of
    :func:`_sequential_fallbacks` that fits: narrower V blocks before a single stage (see there).
    ``plan`` as in :func:`launch_kernel`."""
    planned = plan.get(name)
    if planned is not None:
        bv, stages, compiled = planned
        _run(kernel, (cdiv(s.V, bv), s.N * s.H), args, {**constexprs, "BV": bv}, configs.SEQUENTIAL_WARPS, stages,
             None, compiled)
        return
    tries = _sequential_fallbacks(*configs.sequential_config(name, s, delta, decay, args[0].device))
    (bv, stages), compiled = _launch_fitting(
        name, tries, lambda c: _run(kernel, (cdiv(s.V, c[0]), s.N * s.H), args, {**constexprs, "BV": c[0]},
                                    configs.SEQUENTIAL_WARPS, c[1]),
        lambda c: f"at V block {c[0]}, {c[1]} stages", args, constexprs)
    plan[name] = (bv, stages, compiled)


def on_inputs_device(launcher):
    """The launcher run with its first argument's CUDA device current. Triton launches on the current device and its
    current stream, and a model split over GPUs in one process (``device_map="auto"``) calls layers whose tensors
    live on another device than the current one."""

    @functools.wraps(launcher)
    def run(q: torch.Tensor, *args, **kwargs):
        if q.is_cuda and q.get_device() != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                return launcher(q, *args, **kwargs)
        return launcher(q, *args, **kwargs)

    return run
