"""Host time of one forward+backward through the recurrence's Triton backend, split by the launcher's functions.

At small shapes, and for the fast rules even at 4 x 4096, a call is bound by its host work rather than by its
kernels. This script puts timers around the functions that a forward+backward
passes through and prints, per op and shape, the median over ``--calls`` calls of each part, in microseconds:

- forward: the whole ``linear_recurrence`` call; of it ``triton_recurrence`` (after the input checks and the
  backend's dispatch) and ``pipeline.chunk_forward`` (after the autograd Function's apply and the inputs'
  preparation);
- backward: the whole ``o.backward(g)``; of it ``_gradients`` (what the autograd engine runs of ours) and
  ``pipeline.chunk_backward``;
- launches: every ``launch.run_kernel`` (kernel launches, their count) and of them ``triton_launch._cache_key``.

Example, on a CUDA machine::

    python dev/kernels/host_time.py --ops mamba2,deltanet --shapes 1x256,4x4096

With ``--base DIR`` (repeatable) it compares instead the host time of launcher copies at other revisions (as
``kernel_ab.py --base`` loads them) with the working tree's, in one process, interleaved: per variant the median
of one forward+backward through the launchers alone (``chunk_forward`` + ``chunk_backward``) and through
``linear_recurrence`` and autograd (the backend's ``pipeline`` module swapped for the variant's). At shapes where the
GPU idles (1 x 256) that is the host time::

    mkdir -p /tmp/base && git archive HEAD linmem/ops/recurrence/triton | tar -x -C /tmp/base
    python dev/kernels/host_time.py --base /tmp/base/linmem/ops/recurrence/triton --shapes 1x256

The cases take ``kernel_ab.py``'s options (``--ops``, ``--shapes``, ``--dtype``, ``--heads``, ``--dim``, and
``--varlen N`` for N packed sequences). ``--device cpu`` with ``TRITON_INTERPRET=1`` runs the Triton interpreter
(tiny shapes; the times are then the interpreter's). A timing is a benchmark, never a test.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import add_case_args, call, cases, load_base  # noqa: E402

from linmem.bench.ops import grad_leaves  # noqa: E402
from linmem.ops import linear_recurrence, triton_launch  # noqa: E402
from linmem.ops.recurrence.triton import launch, pipeline  # noqa: E402
from linmem.ops.recurrence.triton import ops as triton_ops  # noqa: E402

#: (module, function name, label) of the timed functions; each is looked up by the module's name at call time
TIMED = ((triton_ops, "triton_recurrence", "triton_recurrence"), (pipeline, "chunk_forward", "chunk_forward"),
         (triton_ops, "_gradients", "_gradients"), (pipeline, "chunk_backward", "chunk_backward"),
         (launch, "run_kernel", "launches"), (triton_launch, "_cache_key", "cache keys"))


@contextlib.contextmanager
def timers(totals: dict, counts: dict) -> Iterator[None]:
    """The functions of ``TIMED`` wrapped so that each call adds its seconds to ``totals[label]`` and one to
    ``counts[label]``; the originals are back on exit."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in TIMED]

    def timed(fn, label):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
                counts[label] += 1
        return run

    try:
        for (module, name, fn), (_, _, label) in zip(originals, TIMED):
            setattr(module, name, timed(fn, label))
        yield
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def host_parts(op_args: dict, cu_seqlens: Optional[torch.Tensor], do: torch.Tensor, device: str,
               calls: int) -> tuple[dict[str, float], int]:
    """Median microseconds per part of one forward+backward of ``linear_recurrence(**op_args)`` (the triton
    backend; op_args as ``linmem bench ops`` makes them, do: the output's gradient) over ``calls`` calls after
    ``calls // 8 + 1`` untimed ones, and the kernel launches per call.

    >>> from linmem.bench.ops import memory_inputs
    >>> t = memory_inputs("mamba2", 1, 64, 2, 32, torch.float32, "cpu")  # doctest: +SKIP
    >>> parts, launches = host_parts(t, None, torch.randn_like(t["v"]), "cpu", 1)  # doctest: +SKIP
    >>> parts["chunk_forward"] <= parts["forward"]  # doctest: +SKIP
    True
    """
    leaves = grad_leaves(op_args)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows, launches = defaultdict(list), 0
    totals, counts = defaultdict(float), defaultdict(int)
    with timers(totals, counts):
        for i in range(calls // 8 + 1 + calls):
            for x in leaves:
                x.grad = None
            totals.clear()
            counts.clear()
            sync()
            start = time.perf_counter()
            o = linear_recurrence(**op_args, cu_seqlens=cu_seqlens, backend="triton")[0]
            mid = time.perf_counter()
            o.backward(do)
            end = time.perf_counter()
            if i > calls // 8:
                rows["forward"].append(mid - start)
                rows["backward"].append(end - mid)
                for _, _, label in TIMED:
                    rows[label].append(totals[label])
                launches = counts["launches"]
    return {label: statistics.median(v) * 1e6 for label, v in rows.items()}, launches


def host_ab(variants: list, op_args: dict, decay: int, cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
            device: str, rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    """Per variant ``(label, pipeline module)``: the median microseconds of one forward+backward through its
    launchers alone and through ``linear_recurrence`` and autograd, over ``rounds`` interleaved rounds of
    ``calls`` calls each (each round's median; a synchronisation after each round's calls, untimed).

    >>> from linmem.bench.ops import memory_inputs
    >>> t = memory_inputs("mamba2", 1, 64, 2, 32, torch.float32, "cpu")  # doctest: +SKIP
    >>> host_ab([("new", pipeline)], t, 1, None, torch.randn_like(t["v"]), "cpu", 1, 1)["new"][0] > 0  # doctest: +SKIP
    True
    """
    leaves = grad_leaves(op_args)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {label: ([], []) for label, _ in variants}

    def full():
        for x in leaves:
            x.grad = None
        linear_recurrence(**op_args, cu_seqlens=cu_seqlens, backend="triton")[0].backward(do)

    def median_us(fn) -> float:
        spent = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
        sync()
        return statistics.median(spent) * 1e6

    try:
        for i in range(rounds + 1):  # the first round warms every variant up, untimed
            for label, module in variants:
                triton_ops.pipeline = module
                alone = median_us(lambda: call(module, op_args, decay, do, cu_seqlens))
                through = median_us(full)
                if i:
                    times[label][0].append(alone)
                    times[label][1].append(through)
    finally:
        triton_ops.pipeline = pipeline
    return {label: (statistics.median(a), statistics.median(f)) for label, (a, f) in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(parser, "mamba2,deltanet,gla")
    parser.set_defaults(shapes="1x256,4x4096")
    parser.add_argument("--calls", type=int, default=None,
                        help="calls timed per case (default 200), or per round with --base (default 20)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 (small shapes)")
    parser.add_argument("--base", action="append", default=[],
                        help="folder of a kernel package copy to compare with the working tree's (repeatable)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per variant (with --base)")
    args = parser.parse_args()
    if args.calls is None:
        args.calls = 20 if args.base else 200
    if args.base:
        variants = [(Path(f).name, load_base(f, i)) for i, f in enumerate(args.base)] + [("new", pipeline)]
        print(f"host us per forward+backward, launchers alone | through autograd; median of {args.rounds} "
              f"rounds of {args.calls} calls ({args.dtype}, H = {args.heads}, K = V = {args.dim}, {args.device})")
        for label, op_args, decay, do, cu in cases(args, args.device):
            times = host_ab(variants, op_args, decay, cu, do, args.device, args.rounds, args.calls)
            print(f"{label:32s} " + "  ".join(f"{v} {a:7.1f}" for v, (a, _) in times.items()) + "  |  "
                  + "  ".join(f"{v} {f:7.1f}" for v, (_, f) in times.items()), flush=True)
        return
    order = ("forward", "triton_recurrence", "chunk_forward", "backward", "_gradients", "chunk_backward",
             "launches", "cache keys")
    print(f"host us per forward+backward, median of {args.calls} calls ({args.dtype}, H = {args.heads}, "
          f"K = V = {args.dim}, {args.device})")
    print(f"{'case':32s} " + " ".join(f"{name:>17s}" for name in order) + "  kernels")
    for label, op_args, _, do, cu in cases(args, args.device):
        parts, launches = host_parts(op_args, cu, do, args.device, args.calls)
        print(f"{label:32s} " + " ".join(f"{parts[name]:17.1f}" for name in order) + f"  {launches:7d}", flush=True)


if __name__ == "__main__":
    main()
