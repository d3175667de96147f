"""A/B timing of the recurrence's Triton kernels against another revision of them, in one process on one GPU.

A kernel change is judged by its time beside the code it replaces, measured in the same process (a separate run
moves by a few percent). This script loads a second copy of ``linmem/ops/recurrence/triton`` (the kernel modules
and their launchers, which import nothing outside the folder but torch and triton) as its own package, runs one
forward+backward of each memory op through both pipelines in turn, and prints per op and shape: the time of the
whole call (median of interleaved rounds), the GPU time of each kernel (torch.profiler), and how far the new
revision's outputs and gradients lie from the base's (rms of the difference over rms of the base)::

    mkdir -p /tmp/base && git archive HEAD linmem/ops/recurrence/triton | tar -x -C /tmp/base
    python dev/kernels/kernel_ab.py --base /tmp/base/linmem/ops/recurrence/triton --ops kda,gated_deltanet

``--try`` times variants of the working tree's launch settings beside it, without editing: each is a label and
entries of ``configs.py``'s tables (``configs.override``), e.g. ``--try "wy3:LAUNCH.wy_grads_vector=4,3"`` or
``--try "cap:MAX_REGISTERS.prep_vector=168"``. A timing is a benchmark, never a test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from linmem.bench.ops import MEMORY_OPS, memory_inputs
from linmem.ops.recurrence.triton import configs
from linmem.ops.recurrence.triton import pipeline as head_pipeline
from linmem.ops.recurrence.triton.switches import Decay

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_base(folder: str, index: int):
    """The pipeline module (``chunk_forward``, ``chunk_backward``) of the kernel copy in ``folder``, imported as the
    package ``ab_base<index>``."""
    name = f"ab_base{index}"
    spec = importlib.util.spec_from_file_location(name, Path(folder) / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    return importlib.import_module(f"{name}.pipeline")


def parse_try(text: str) -> tuple[str, dict]:
    """'label:SETTING.key=a,b;SETTING.key=n' -> (label, {SETTING: {key: value}}), for ``configs.override``."""
    label, _, body = text.partition(":")
    changes: dict = {}
    for part in filter(None, body.split(";")):
        target, _, value = part.partition("=")
        setting, _, key = target.partition(".")
        if not hasattr(getattr(configs, setting, None), "keys"):
            raise SystemExit(f"--try {text!r}: configs.{setting} is not a table")
        numbers = tuple(int(x) for x in value.split(","))
        changes.setdefault(setting, {})[key] = numbers if len(numbers) > 1 else numbers[0]
    return label, changes


class Variant:
    """A pipeline module, run with launch settings changed (``configs.override``) where ``changes`` says so."""

    def __init__(self, label: str, module, changes: dict):
        self.label, self.module, self.changes = label, module, changes

    def __enter__(self):
        self.context = configs.override(**self.changes) if self.changes else contextlib.nullcontext()
        self.context.__enter__()

    def __exit__(self, *exc):
        self.context.__exit__(*exc)


def packed_lengths(total: int, parts: int) -> torch.Tensor:
    """``cu_seqlens`` (int32) of ``parts`` sequences of uneven lengths that fill ``total`` tokens: lengths in the
    ratios 1, 2, ..., parts, so that chunks straddle sequence ends."""
    weights = torch.arange(1, parts + 1, dtype=torch.float64)
    ends = (weights.cumsum(0) / weights.sum() * total).round().long()
    return torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32)


def gate_argument(backward, g) -> tuple:
    """``(g,)`` for a revision whose ``chunk_backward`` takes the log decay g (before it read only the saved
    cumulative gates G), else ``()``."""
    return (g,) if "g" in inspect.signature(backward).parameters else ()


def call(module, op_args: dict, decay: int, do: torch.Tensor, cu_seqlens=None):
    """One forward+backward through ``module``'s launchers: (o, dq, dk, dv, dg, dbeta, du); with ``cu_seqlens``
    the inputs (B = 1) are packed sequences."""
    a = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in op_args.items()}
    q, k, v = a["q"], a["k"], a["v"]
    g = a.get("log_decay")
    if g is not None:
        g = g.float().contiguous()
    beta, u = a.get("beta"), a.get("bonus")
    scale = q.shape[-1] ** -0.5
    o, _, saved = module.chunk_forward(q, k, v, g, beta, u, None, cu_seqlens, scale, decay, False)
    grads = module.chunk_backward(q, k, v, *gate_argument(module.chunk_backward, g), beta, u, None, cu_seqlens,
                                  saved, do, None, scale, decay)
    return (o, *grads[:6])


def median_ms(fn, rounds: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn, iters: int = 10) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.name] += event.device_time_total / iters / 1000
    return out


def add_case_args(parser: argparse.ArgumentParser, ops: str) -> None:
    """The options that pick the cases (also ``kernel_reruns.py``'s): ops, shapes, dtype, heads, head size,
    packed sequences."""
    parser.add_argument("--ops", default=ops)
    parser.add_argument("--shapes", default="4x4096", help="BxT,BxT,...")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--varlen", type=int, default=0, metavar="N",
                        help="pack each shape's B x T tokens as N sequences of uneven lengths (cu_seqlens)")
    parser.add_argument("--gates", type=float, default=1.0, metavar="X",
                        help="log decays X times the bench's (logsigmoid(randn) / 10): from about 10 up, per-channel "
                             "chunks fall past configs.CHUNK_SPAN and take intra_grads_kernel's paths")


def cases(args: argparse.Namespace, device: str = "cuda"):
    """Per op and shape of ``add_case_args``' options: ``(label, op inputs, decay code, do, cu_seqlens)``, the
    inputs as ``linmem bench ops`` makes them (seed 0), made one case at a time."""
    for shape in args.shapes.split(","):
        B, T = map(int, shape.split("x"))
        for op in args.ops.split(","):
            kind = MEMORY_OPS[op][0]
            if kind == "constant":
                raise SystemExit(f"{op}: a constant decay reaches the kernels expanded to a scalar one; take mamba2")
            torch.manual_seed(0)
            b, t, cu = B, T, None
            if args.varlen:
                b, t = 1, B * T
                cu = packed_lengths(t, args.varlen).to(device)
            op_args = memory_inputs(op, b, t, args.heads, args.dim, DTYPES[args.dtype], device, args.gates)
            label = f"{op} {B}x{T}" + (f" as {args.varlen} packed sequences" if args.varlen else "") + (
                f", gates x{args.gates:g}" if args.gates != 1.0 else "")
            yield label, op_args, Decay.of(kind), torch.randn_like(op_args["v"]), cu


def rel(x, ref) -> float:
    if x is None or ref is None:
        return float("nan")
    d = (x.double() - ref.double()).pow(2).mean().sqrt()
    return (d / ref.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", action="append", default=[],
                        help="folder of kernel modules to compare against, labelled by its name; the first is the "
                             "reference of the differences (repeatable; none: the working tree alone)")
    add_case_args(parser, "kda,gla,gated_deltanet,deltanet,mamba2")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds per variant")
    parser.add_argument("--try", dest="tries", action="append", default=[], help="label:SETTING.key=value;...")
    args = parser.parse_args()
    variants = [Variant("new", head_pipeline, {})]
    variants += [Variant(label, head_pipeline, changes) for label, changes in map(parse_try, args.tries)]
    variants[:0] = [Variant(Path(folder).name, load_base(folder, i), {}) for i, folder in enumerate(args.base)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, H = {args.heads}, "
          f"K = V = {args.dim}; variants: {', '.join(v.label for v in variants)}")
    for label, op_args, decay, do, cu in cases(args):
        results, times, kernels = {}, defaultdict(list), {}
        for v in variants:
            with v:
                results[v.label] = call(v.module, op_args, decay, do, cu)
                kernels[v.label] = kernel_ms(lambda: call(v.module, op_args, decay, do, cu))
        for _ in range(args.rounds):
            for v in variants:
                with v:
                    times[v.label].append(median_ms(lambda: call(v.module, op_args, decay, do, cu), 1))
        ref = results[variants[0].label]
        print(f"\n{label}: fwd+bwd ms " + "  ".join(
            f"{v.label} {statistics.median(times[v.label]):.3f}" for v in variants))
        names = sorted(set().union(*kernels.values()), key=lambda n: -kernels[variants[-1].label].get(n, 0))
        for name in names:
            print(f"    {name[:40]:40s}" + "".join(f" {kernels[v.label].get(name, 0):8.3f}" for v in variants))
        for v in variants[1:]:
            diffs = "  ".join(f"{n} {rel(x, r):.1e}" for n, x, r in
                              zip(("o", "dq", "dk", "dv", "dg", "dbeta", "du"), results[v.label], ref)
                              if r is not None)
            print(f"    {v.label} against {variants[0].label}: {diffs}")
        del results
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
