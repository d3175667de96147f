"""linmem's own Python per op call, on a CPU: each op's forward and backward with every kernel launch a no-op.

The CPU proxy of an op's host time on the GPU: the ops of ``dev/gpu/tools/op_host.py`` (at a tinier shape, on
their Triton path) run on CPU tensors under ``TRITON_INTERPRET=1`` (set here before linmem is imported), which
takes the Triton launchers, with ``linmem.ops.triton_launch.run_kernel`` replaced by a no-op in every module that
imported it. ``backend="auto"`` is read as ``"triton"`` (ops that name no backend, such as ``swiglu_down``, take
the kernels too) and the checks of values that CPU tensors get are off, as for a CUDA tensor without
``LINMEM_DEBUG=1``. What is timed is then linmem's Python and the aten ops it calls (allocations, casts, small
reductions) and the autograd engine, not the kernels nor their launches (about 6 us each on the fast path). CPU
aten ops cost other times than CUDA ones: the proxy measures linmem's Python, the GPU profile the whole.

Per op it prints the median microseconds of ``--calls`` forward calls (the public function, inputs that require
gradients, as in training) and of as many backward calls (``torch.autograd.grad`` of the outputs of one forward
for fixed cotangents, the graph retained), and the no-op launches per call of each (a zero would mean the op did
not take its Triton path). With ``--cprofile N`` the N costliest functions of each by tottime follow.

Example::

    python dev/kernels/python_overhead.py
    python dev/kernels/python_overhead.py --ops recurrence_gdn,short_conv --cprofile 15

A timing is a benchmark, never a test.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: CPU tensors take the launchers

import argparse  # noqa: E402
import cProfile  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu" / "tools"))
import op_host  # noqa: E402

from linmem.ops import checks, triton_launch  # noqa: E402
from linmem.ops.fused import backend as fused_backend  # noqa: E402

#: the ops timed by default: those of a Gated DeltaNet training step, and the other fused glue
DEFAULT_OPS = ("recurrence_gdn", "recurrence_gla", "swiglu_down", "swiglu", "short_conv", "rms_norm",
               "gated_rms_norm", "l2_norm", "mamba2_log_decay")
#: the tiny shape (op_host.py's names): tokens, heads, head dim, width; aten's CPU arithmetic on it is small
SHAPE = {"T": 16, "H": 2, "D": 16, "WIDTH": 32}
#: the kernel modules that import run_kernel (several lazily, on an op's first call)
KERNEL_MODULES = ("linmem.ops.recurrence.triton.launch", "linmem.ops.recurrence.triton.recurrent",
                  "linmem.ops.fused.triton.conv", "linmem.ops.fused.triton.norm", "linmem.ops.fused.triton.swiglu",
                  "linmem.ops.fused.triton.rotary", "linmem.ops.fused.triton.cross_entropy")


@contextlib.contextmanager
def no_launches(counter: list) -> Iterator[None]:
    """``run_kernel`` a no-op counting its calls in ``counter[0]``, in every loaded linmem module that holds it, the
    fused ops' ``backend="auto"`` taken as ``"triton"`` and ``values_checkable`` false (a CUDA tensor's path); all
    restored on exit."""
    real_run, real_use, real_checkable = triton_launch.run_kernel, fused_backend.use_triton, checks.values_checkable
    for name in KERNEL_MODULES:
        importlib.import_module(name)

    def run_kernel(*args, **kwargs):
        counter[0] += 1

    def use_triton(op, backend, x, refusal=None):
        return real_use(op, "triton" if backend == "auto" else backend, x, refusal)

    def values_checkable(t):
        return False

    replaced = {"run_kernel": (real_run, run_kernel), "use_triton": (real_use, use_triton),
                "values_checkable": (real_checkable, values_checkable)}
    patched = [(m, attr, value) for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("linmem")
               for attr, (value, _) in replaced.items() if getattr(m, attr, None) is value]
    try:
        for m, attr, _ in patched:
            setattr(m, attr, replaced[attr][1])
        yield
    finally:
        for m, attr, value in patched:
            setattr(m, attr, value)


def _median_us(fn, calls: int, counter: list) -> tuple[float, float]:
    """(median microseconds of ``calls`` calls of fn, no-op launches per call)."""
    spent, counter[0] = [], 0
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e6, counter[0] / calls


def _profile(fn, calls: int, rows: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def measure(name: str, calls: int, warmup: int, profile_rows: int = 0) -> dict:
    """One op's row: ``{"op", "forward_us", "forward_launches", "backward_us", "backward_launches"}`` (the backward
    entries None for an op without one), and ``"profiles"`` (forward, backward cProfile text) with ``profile_rows``.

    >>> measure("l2_norm", 5, 1)["forward_launches"]  # doctest: +SKIP
    1.0
    """
    counter = [0]
    for key, value in SHAPE.items():
        setattr(op_host, key, value)
    with no_launches(counter):
        case = op_host.cases("cpu", torch.bfloat16)[name]()
        forward = case.run
        backward = None
        if case.leaves:
            outs = case.run()
            backward = lambda: torch.autograd.grad(outs, case.leaves, case.cotangents, retain_graph=True)  # noqa: E731
        row = {"op": name, "profiles": []}
        for mode, fn in (("forward", forward), ("backward", backward)):
            if fn is None:
                row[f"{mode}_us"] = row[f"{mode}_launches"] = None
                continue
            for _ in range(warmup):
                fn()
            row[f"{mode}_us"], row[f"{mode}_launches"] = _median_us(fn, calls, counter)
            if profile_rows:
                row["profiles"].append(f"--- {name} {mode}\n" + _profile(fn, calls, profile_rows))
    return row


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS), help="comma-separated ops of op_host.py's cases")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per op and direction")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print the N costliest functions of each op and direction by tottime")
    args = parser.parse_args(argv)
    known = op_host.cases("cpu", torch.float32)
    unknown = sorted(set(args.ops.split(",")) - set(known))
    if unknown:
        parser.error(f"--ops: unknown {', '.join(unknown)}")
    torch.set_num_threads(1)
    print(f"linmem's Python per call, launches no-ops (CPU proxy; bf16, T = {SHAPE['T']}, H = {SHAPE['H']}, "
          f"D = {SHAPE['D']}, width {SHAPE['WIDTH']}; median of {args.calls} calls; torch {torch.__version__})")
    print(f"{'op':20s} {'forward us':>10s} {'launches':>8s} {'backward us':>11s} {'launches':>8s}")
    rows = []
    for name in args.ops.split(","):
        row = measure(name, args.calls, args.warmup, args.cprofile)
        rows.append(row)
        cells = [f"{row[k]:10.1f}" if row[k] is not None else f"{'-':>10s}" for k in ("forward_us", "backward_us")]
        print(f"{name:20s} {cells[0]} {row['forward_launches']:8.1f} {cells[1]:>11s} "
              f"{row['backward_launches'] if row['backward_launches'] is not None else '-':>8}", flush=True)
    for row in rows:
        for text in row["profiles"]:
            print(text)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
