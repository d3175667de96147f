"""A/B of revisions of the recurrence's Triton kernel package on one GPU, in one process: the same bits, and the

Record: run by ``dev/gpu/records/triton_ab.sh`` (its header has the date, command and result).
forward+backward time of each revision beside the others.

Each revision is a copy of ``linmem/ops/recurrence/triton`` (``git archive`` of a commit), loaded as a package of
its own; its forward and backward launchers (``pipeline.chunk_forward`` and ``chunk_backward``, or ``launch.*`` in
revisions before the package was split by stage) run one forward+backward of each memory op of ``linmem bench
ops`` on the bench's inputs (seed 0). Printed per op and shape: each revision's median ms over interleaved rounds
(CUDA events around the launchers alone, no autograd), its ratio to the first revision, and the largest
difference of its outputs and gradients from the first revision's (0 where the bits agree)::

    python dev/gpu/records/triton_ab.py --rev base=/tmp/ab/base --rev head=/tmp/ab/head --shapes 8x2048,1x16384

``dev/gpu/records/triton_ab.sh`` extracts the revisions and runs this with the GPU suite.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import statistics
import sys
from pathlib import Path

import torch

from linmem.bench.ops import MEMORY_OPS, memory_inputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DECAY_CODES = {"none": 0, "constant": 1, "scalar": 1, "vector": 2}  # the kernels' decay kinds (a constant expanded)


def load_revision(label: str, folder: Path):
    """(forward, backward) launchers of the kernel package copied in ``folder``, imported as its own package."""
    name = f"triton_ab_{label}"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    entry = "pipeline" if (folder / "pipeline.py").exists() else "launch"
    module = importlib.import_module(f"{name}.{entry}")
    return module.chunk_forward, module.chunk_backward


def gate_argument(backward, g) -> tuple:
    """``(g,)`` for a revision whose ``chunk_backward`` takes the log decay g (before it read only the saved
    cumulative gates G), else ``()``."""
    return (g,) if "g" in inspect.signature(backward).parameters else ()


def call(revision, t: dict, decay: int, do: torch.Tensor) -> tuple:
    """One forward+backward through a revision's launchers: (o, dq, dk, dv, dg, dbeta, du)."""
    forward, backward = revision
    q, k, v = t["q"], t["k"], t["v"]
    g, beta, u = t.get("log_decay"), t.get("beta"), t.get("bonus")
    if g is not None:
        g = (g[None, None, :].expand(*q.shape[:3]) if g.dim() == 1 else g).float().contiguous()
    scale = q.shape[-1] ** -0.5
    o, _, saved = forward(q, k, v, g, beta, u, None, None, scale, decay, False)
    return (o, *backward(q, k, v, *gate_argument(backward, g), beta, u, None, None, saved, do, None, scale,
                         decay)[:6])


def largest_difference(a: tuple, b: tuple) -> float:
    return max(((x.float() - y.float()).abs().max().item() for x, y in zip(a, b) if x is not None), default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", action="append", required=True, metavar="LABEL=FOLDER",
                        help="a revision's kernel package folder (repeatable; the first is the reference)")
    parser.add_argument("--ops", default="linear_attention,retention,mamba2,gla,rwkv6,deltanet,gated_deltanet,kda")
    parser.add_argument("--shapes", default="8x2048,4x4096,2x8192,1x16384")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    parser.add_argument("--gates", type=float, default=1.0,
                        help="log decays this many times the bench's (10, 100: the per-channel block, pairwise paths)")
    args = parser.parse_args()
    revisions = {}
    for item in args.rev:
        label, _, folder = item.partition("=")
        revisions[label] = load_revision(label, Path(folder))
    labels = list(revisions)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, H = {args.heads}, "
          f"K = V = {args.dim}, gates x{args.gates:g}; fwd+bwd ms (launchers alone), median of {args.rounds} "
          "interleaved rounds")
    print(f"{'op':16s} {'shape':9s} " + " ".join(f"{x:>10s}" for x in labels) + "   ratios to " + labels[0]
          + "   largest difference from " + labels[0])
    worst = 1.0
    for shape in args.shapes.split(","):
        B, T = map(int, shape.split("x"))
        for op in args.ops.split(","):
            torch.manual_seed(0)
            made = memory_inputs(op, B, T, args.heads, args.dim, DTYPES[args.dtype], "cuda", args.gates)
            t = {n: (x.detach() if isinstance(x, torch.Tensor) else x) for n, x in made.items()}
            decay = DECAY_CODES[MEMORY_OPS[op][0]]
            do = torch.randn_like(t["v"])
            results = {x: call(revisions[x], t, decay, do) for x in labels}  # also the warm-up (compiles)
            times = {x: [] for x in labels}
            for _ in range(args.rounds):
                for x in labels:
                    start.record()
                    call(revisions[x], t, decay, do)
                    end.record()
                    end.synchronize()
                    times[x].append(start.elapsed_time(end))
            ms = {x: statistics.median(times[x]) for x in labels}
            ratios = {x: ms[x] / ms[labels[0]] for x in labels[1:]}
            worst = max([worst, *ratios.values()])
            diffs = {x: largest_difference(results[x], results[labels[0]]) for x in labels[1:]}
            print(f"{op:16s} {shape:9s} " + " ".join(f"{ms[x]:10.3f}" for x in labels) + "   "
                  + " ".join(f"{x} {r:.3f}" for x, r in ratios.items()) + "   "
                  + " ".join(f"{x} {d:.1e}" for x, d in diffs.items()), flush=True)
            del results
            torch.cuda.empty_cache()
    print(f"slowest ratio to {labels[0]}: {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
