"""Host (CPU) microseconds per call of each op on its Triton kernels: the fused ops, attention, the recurrence.

At a tiny shape an op's GPU work is shorter than its host work (argument checks, autograd, allocations, kernel
launches), so ``--calls`` calls enqueued back to back without a synchronisation, after ``--warmup`` calls,
measure the host time per call. Each op runs in two modes: ``forward`` (with inputs that require gradients, as in
training) and ``forward+backward`` (``torch.autograd.grad`` of its outputs for fixed cotangents). One table
(op, mode, host us/call) goes to stdout and ``op_host.json`` to ``--out``; with ``--cprofile`` the calls of each
(op, mode) run once more under cProfile, and ``op_host_<op>_<mode>.txt`` (sorted by tottime) goes to ``--out``.

Compare with the dispatcher launching every kernel by running it again under ``LINMEM_TRITON_FAST_LAUNCH=0``::

    python dev/gpu/tools/op_host.py --out $OUT
    LINMEM_TRITON_FAST_LAUNCH=0 python dev/gpu/tools/op_host.py --out $OUT/dispatcher --ops rms_norm,swiglu_down
    python dev/gpu/tools/op_host.py --out $OUT --cprofile --ops recurrence_gdn

The first run on a machine also compiles every kernel (Triton keeps them in its cache for the next).
``--device cpu`` with ``TRITON_INTERPRET=1`` runs the kernels in the interpreter (a smoke test of the script;
its times are the interpreter's). A timing is a benchmark, never a test.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from linmem.bench.ops import memory_inputs
from linmem.layers.moe import swiglu_down
from linmem.ops import bayes_filter, linear_recurrence, triton_launch
from linmem.ops.attention import cached_attention, forgetting_attention
from linmem.ops.fused import gated_rms_norm, l2_norm, linear_cross_entropy, rms_norm, rotary, short_conv, swiglu
from linmem.ops.gates import mamba2_log_decay

MODES = ("forward", "forward+backward")
#: tokens, heads, head dim and width of the tiny shape
T, H, D, WIDTH = 64, 4, 64, 256


class Case:
    """One op call: ``run()`` returns its differentiable outputs; ``leaves`` get the gradients (none: an op without
    a backward, timed in the forward mode only)."""

    def __init__(self, run: Callable[[], tuple], leaves: list[torch.Tensor]):
        self.run, self.leaves = run, leaves
        self.modes = MODES if leaves else MODES[:1]
        self.cotangents = [torch.randn_like(o) for o in run()]

    def call(self, mode: str) -> None:
        outs = self.run()
        if mode == "forward+backward":
            torch.autograd.grad(outs, self.leaves, self.cotangents)


def cases(device: str, dtype: torch.dtype) -> dict[str, Callable[[], Case]]:
    """Each op at the tiny shape, built on demand (on ``device``; ``backend="triton"`` wherever an op takes it)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def leaf(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dt).requires_grad_(True)

    kernels = dict(backend="triton")

    def rms():
        x, w, res = leaf(1, T, WIDTH), leaf(WIDTH), leaf(1, T, WIDTH)
        return Case(lambda: rms_norm(x, w, residual=res, residual_out=True, **kernels), [x, w, res])

    def gated_rms():
        x, g, w = leaf(1, T, H, D), leaf(1, T, H, D), leaf(D)
        return Case(lambda: (gated_rms_norm(x, g, w, **kernels),), [x, g, w])

    def l2():
        x = leaf(1, T, H, D)
        return Case(lambda: (l2_norm(x, **kernels),), [x])

    def glu():
        gate, up = leaf(1, T, 4 * WIDTH), leaf(1, T, 4 * WIDTH)
        return Case(lambda: (swiglu(gate, up, **kernels),), [gate, up])

    def glu_down():  # the MLP's end on the kernels (backend "auto": CUDA only)
        projected, w = leaf(1, T, 8 * WIDTH), leaf(WIDTH, 4 * WIDTH, scale=0.02)
        return Case(lambda: (swiglu_down(*projected.chunk(2, dim=-1), w),), [projected, w])

    def conv():
        x, w, b = leaf(1, T, WIDTH), leaf(WIDTH, 4), leaf(WIDTH)
        return Case(lambda: short_conv(x, w, b, activation="silu", **kernels)[:1], [x, w, b])

    def rope():
        q, k = leaf(1, T, H, D), leaf(1, T, H, D)
        positions = torch.arange(T, device=device)[None]
        return Case(lambda: rotary(q, k, positions, **kernels), [q, k])

    def cross_entropy():
        hidden, w = leaf(T, WIDTH), leaf(1000, WIDTH, scale=0.02)
        labels = torch.randint(0, 1000, (T,), generator=gen).to(device)
        return Case(lambda: (linear_cross_entropy(hidden, w, labels, **kernels),), [hidden, w])

    def mamba2_decay():
        x, A_log, dt_bias = leaf(1, T, H, 1), leaf(H, dt=torch.float32), leaf(H, 1, dt=torch.float32)
        return Case(lambda: (mamba2_log_decay(x, A_log, dt_bias),), [x, A_log, dt_bias])

    def attention():
        q, k, v = leaf(1, T, H, D), leaf(1, T, H, D), leaf(1, T, H, D)
        forget = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 4).to(device).requires_grad_(True)
        return Case(lambda: (forgetting_attention(q, k, v, log_forget=forget, **kernels),), [q, k, v, forget])

    def decode():  # a decoding step: no backward
        q, k, v = (x.detach() for x in (leaf(2, 1, H, D), leaf(2, 256, H, D), leaf(2, 256, H, D)))
        return Case(lambda: (cached_attention(q, k, v, **kernels),), [])

    def recurrence(op: str):
        def build():
            t = memory_inputs(op, 1, T, H, D, dtype, device)
            leaves = [x.requires_grad_(True) for x in t.values()
                      if isinstance(x, torch.Tensor) and x.is_floating_point()]
            return Case(lambda: linear_recurrence(**t, backend="triton")[:1], leaves)
        return build

    def bayes():
        q, k, v = leaf(1, T, H, D), leaf(1, T, H, D), leaf(1, T, H, D)
        decay = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 3).to(device).requires_grad_(True)
        noise = (F.softplus(torch.randn(1, T, H, generator=gen)) + 0.1).to(device).requires_grad_(True)
        return Case(lambda: bayes_filter(q, k, v, log_decay=decay, obs_noise=noise, **kernels)[:1],
                    [q, k, v, decay, noise])

    return {"rms_norm": rms, "gated_rms_norm": gated_rms, "l2_norm": l2, "swiglu": glu, "swiglu_down": glu_down,
            "short_conv": conv, "rotary": rope, "cross_entropy": cross_entropy, "mamba2_log_decay": mamba2_decay,
            "attention": attention, "attention_decode": decode, "recurrence_gla": recurrence("gla"),
            "recurrence_gdn": recurrence("gated_deltanet"), "bayes_filter": bayes}


def host_us(case: Case, mode: str, calls: int, warmup: int, sync: Callable[[], None]) -> float:
    """Host microseconds per call: ``calls`` calls enqueued back to back after ``warmup`` (and a synchronisation)."""
    for _ in range(warmup):
        case.call(mode)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        case.call(mode)
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


def profile_text(case: Case, mode: str, calls: int, rows: int = 40) -> str:
    """cProfile of ``calls`` calls, by tottime."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        case.call(mode)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="folder for the results")
    parser.add_argument("--ops", default="all", help="comma-separated case names, or all")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cprofile", action="store_true", help="also write a cProfile of each (op, mode)")
    args = parser.parse_args(argv)
    names = list(cases(args.device, torch.float32))  # the builders only: no tensor is made
    known = names if args.ops == "all" else args.ops.split(",")
    unknown = sorted(set(known) - set(names))
    if unknown:
        parser.error(f"--ops: unknown {', '.join(unknown)}")
    if args.calls < 1 or args.warmup < 0:
        parser.error("--calls must be >= 1 and --warmup >= 0")
    args.ops = known
    return args


def main(argv: list[str]) -> list[dict]:
    args = parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    args.out.mkdir(parents=True, exist_ok=True)
    builders = cases(args.device, dtype)
    print(f"fast launch: {triton_launch.FAST_LAUNCH}; {args.calls} calls after {args.warmup}, {args.dtype}, "
          f"T = {T}, H = {H}, D = {D}, width {WIDTH}")
    print(f"{'op':20s} {'mode':18s} {'host us/call':>12s}")
    rows = []
    for name in args.ops:
        case = builders[name]()
        for mode in case.modes:
            us = host_us(case, mode, args.calls, args.warmup, sync)
            rows.append({"op": name, "mode": mode, "host_us": round(us, 1)})
            print(f"{name:20s} {mode:18s} {us:12.1f}", flush=True)
            if args.cprofile:
                text = profile_text(case, mode, args.calls)
                (args.out / f"op_host_{name}_{mode.replace('+', '_')}.txt").write_text(text)
                sync()
    (args.out / "op_host.json").write_text(json.dumps({
        "fast_launch": triton_launch.FAST_LAUNCH, "calls": args.calls, "warmup": args.warmup, "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
