"""Where a Triton kernel of the recurrence spends its time, per line of Python, from Nsight Compute.

Two steps. On the GPU machine, profile one forward+backward of an op (ours or fla's) and export
the source page, whose rows are the kernels' Python lines (Triton keeps line information) with the
SASS instructions under each::

    ncu --profile-from-start off --clock-control none --set full --import-source yes -o gla \\
        python dev/kernels/ncu_lines.py run ours gla 8 2048
    ncu -i gla.ncu-rep --page source --print-source cuda,sass --csv > gla.csv
    ncu -i gla.ncu-rep --page details > gla.txt      # occupancy, registers, stall summary

Anywhere, rank the lines of one kernel by warp-stall samples (a sample is a warp seen waiting or
issuing on that line, so the share is the share of the kernel's time), with the instructions they
executed and their three main stall reasons; ``--sass`` splits chosen lines by instruction::

    python dev/kernels/ncu_lines.py lines gla.csv grads_kernel
    python dev/kernels/ncu_lines.py lines gla.csv grads_kernel --sass numerics.py:LINE

A function inlined into a kernel is charged to its own line (``masked_exp2`` in numerics.py, not
the line in the kernel that called it).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Line:
    """One Python line of one kernel: warp samples, executed warp instructions, stall counts."""

    source: str
    samples: float = 0.0
    instructions: float = 0.0
    stalls: Counter = field(default_factory=Counter)
    sass: Counter = field(default_factory=Counter)  # opcode -> samples


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_source_page(path: str) -> dict[str, dict[str, Line]]:
    """kernel name -> ``file:line`` -> Line, from ``ncu --page source --print-source cuda,sass --csv``.

    A kernel launched more than once keeps the sums of all its launches.
    """
    kernels: dict[str, dict[str, Line]] = {}
    kernel = file = header = None
    line: Line | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                file = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Function Name":
                kernel = row[1]
            elif row[0] == "Line No":
                header = {name: i for i, name in enumerate(row)}
            elif row[0].isdigit() and header is not None and kernel is not None:
                line = kernels.setdefault(kernel, {}).setdefault(f"{file}:{row[0]}", Line(row[1].strip()))
            elif row[0] == "" and line is not None and header is not None and len(row) > 4 and row[2] != "...":
                samples = _number(row[header["Warp Stall Sampling (All Samples)"]])
                line.samples += samples
                line.instructions += _number(row[header["Instructions Executed"]])
                for name, i in header.items():
                    if name.startswith("stall_") and "Not Issued" not in name:
                        line.stalls[name[len("stall_"):]] += _number(row[i])
                words = row[3].split()
                if words:
                    line.sass[words[1] if words[0].startswith("@") and len(words) > 1 else words[0]] += samples
    return kernels


def report(lines: dict[str, Line], top: int, sass: tuple[str, ...] = ()) -> list[str]:
    """The ``top`` lines by samples: share of samples, share of instructions, place, source, stalls."""
    samples = sum(x.samples for x in lines.values()) or 1.0
    instructions = sum(x.instructions for x in lines.values()) or 1.0
    stalls = Counter()
    for x in lines.values():
        stalls.update(x.stalls)
    out = [f"samples {samples:.0f}, warp instructions {instructions:.3g}; stalls: "
           + ", ".join(f"{k} {v / samples:.0%}" for k, v in stalls.most_common(6))]
    for place, x in sorted(lines.items(), key=lambda kv: -kv[1].samples)[:top]:
        reasons = ", ".join(f"{k} {v / x.samples:.0%}" for k, v in x.stalls.most_common(3)) if x.samples else ""
        out.append(f"{x.samples / samples:6.1%} {x.instructions / instructions:6.1%}  {place:18s} "
                   f"{x.source[:80]:80s} | {reasons}")
    for place in sass:
        x = lines.get(place)
        if x is not None:
            out.append(f"{place}: " + ", ".join(f"{op} {v / samples:.1%}" for op, v in x.sass.most_common(8)))
    return out


def _run(who: str, op: str, B: int, T: int, gates: float = 1.0) -> None:
    """One forward+backward of ``op`` between cudaProfilerStart/Stop, after three warm-up calls (log decays
    ``gates`` times the bench's, as ``linmem bench ops --gates``)."""
    import torch

    from linmem.bench.ops import FLA_PEERS, _fla_call, memory_inputs
    from linmem.ops import linear_recurrence

    args = memory_inputs(op, B, T, 16, 128, torch.bfloat16, "cuda", gates)
    fn = (lambda: linear_recurrence(**args, backend="triton")[0]) if who == "ours" else _fla_call(FLA_PEERS[op], args)
    grad = torch.randn_like(fn())
    for _ in range(3):
        fn().backward(grad)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn().backward(grad)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="one profiled forward+backward (run it under ncu)")
    run.add_argument("who", choices=["ours", "fla"])
    run.add_argument("op", help="a memory op of linmem bench ops (gla, deltanet, ...)")
    run.add_argument("B", type=int)
    run.add_argument("T", type=int)
    run.add_argument("--gates", type=float, default=1.0, help="log decays this many times the bench's")
    lines = sub.add_parser("lines", help="rank a kernel's Python lines in an exported source page")
    lines.add_argument("csv")
    lines.add_argument("kernel", nargs="?", help="kernel name (all kernels if left out)")
    lines.add_argument("--top", type=int, default=25)
    lines.add_argument("--sass", default="", help="file:line,... to split by SASS opcode")
    args = parser.parse_args()
    if args.cmd == "run":
        _run(args.who, args.op, args.B, args.T, args.gates)
        return
    for name, per_line in read_source_page(args.csv).items():
        if args.kernel in (None, name):
            print(f"== {name}")
            print("\n".join(report(per_line, args.top, tuple(p for p in args.sass.split(",") if p))))


if __name__ == "__main__":
    main()
