"""How the stages launch their kernels: configs that fit and launch plans, on the shared fast path past the dispatcher.

A stage's launcher calls :func:`launch_kernel` (or :func:`launch_sequential` for the sequential passes) with its
launch name, kernel, grid, arguments and constexprs. The first call of a name under a plan looks its config up in
``configs`` and, where its software pipelining does not fit the device's shared memory, steps down to one that
fits; the plan (:func:`plan_for`, one per launcher call shape) keeps the result for the next call.

Every launch goes through :func:`linmem.ops.triton_launch.run_kernel`, the fast path past Triton's dispatcher
(see there); a plan also keeps each launch's compiled kernel, so a planned launch skips building its key.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton.runtime.errors

# absolute: the kernel tools under dev/kernels load this folder as a package of its own
from linmem.ops.triton_launch import run_kernel

from . import configs
from .configs import Shapes, cdiv

logger = logging.getLogger("linmem.ops")


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
        run_kernel(kernel, grid, args, constexprs, warps, stages, cap, compiled)
        return
    warps, stages = configs.LAUNCH[name]
    cap = configs.MAX_REGISTERS.get(name)
    stages, compiled = _launch_fitting(name, list(range(stages, 0, -1)),
                                       lambda st: run_kernel(kernel, grid, args, constexprs, warps, st, cap),
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
        run_kernel(kernel, (cdiv(s.V, bv), s.N * s.H), args, {**constexprs, "BV": bv}, configs.SEQUENTIAL_WARPS, stages,
             None, compiled)
        return
    tries = _sequential_fallbacks(*configs.sequential_config(name, s, delta, decay, args[0].device))
    (bv, stages), compiled = _launch_fitting(
        name, tries, lambda c: run_kernel(kernel, (cdiv(s.V, c[0]), s.N * s.H), args, {**constexprs, "BV": c[0]},
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
