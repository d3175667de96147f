"""Where a training step's time goes on one GPU: host time per launch, wall against GPU time, op by op.

For each model (``linmem.bench.peers`` architectures at the table's ~370M shape) and mode (eager, compiled blocks,
CUDA-graph micro-steps), one step as ``linmem bench models`` times it (bf16 weights, fused AdamW):

* ``wall_ms``: the median of ``--steps`` synchronised steps;
* ``host_ms``: the time the Python step takes to return with a synchronisation only at the end, i.e. to
  enqueue every kernel (the GPU runs behind it; the launch queue holds thousands of launches);
* ``gpu_ms``: the sum of the step's kernel times in the profiler, ``launches``: its kernel launches
  (``cudaLaunchKernel``, ``cuLaunchKernelEx`` and graph launches counted as the kernels they run);
* ``host_us_per_launch`` = host_ms / launches, and ``wall / gpu``;
* with ``--ops``: the eager step's 25 costliest ops by host time per call (self and total), to
  ``ops_<model>.txt``, and its 30 costliest kernels by GPU time, to ``kernels_<model>.txt``;
* with ``--recompute-states``: each step again with the recurrence's chunk states recomputed in the backward
  (``configs.KEEP_STATES=False``), mode ``<mode>+recompute``.

    python dev/gpu/tools/step_profile.py --models gated_deltanet,hybrid --modes eager,compiled,graph --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from linmem.bench.peers import ModelShape, build_model  # noqa: E402
from linmem.bench.models import training_step  # noqa: E402
from linmem.ops.recurrence.triton import configs  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def measure(key: str, mode: str, B: int, T: int, steps: int, ops_file: Path | None) -> dict:
    torch.manual_seed(0)
    model, _ = build_model(key, ModelShape(), device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, ModelShape().vocab_size, (B, T), device="cuda")
    step = training_step(model, mode, ids)
    start = time.perf_counter()
    for _ in range(3):  # compile, tune, capture
        step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    walls, hosts = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    graph_launches = sum(e.count for e in events if e.key.startswith("cudaGraphLaunch"))
    if ops_file is not None:
        ops = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.count),
                     key=lambda e: e.cpu_time_total, reverse=True)[:25]
        lines = [f"{'op':60s} {'calls':>6s} {'total us/call':>14s} {'self us/call':>13s}"]
        lines += [f"{e.key[:60]:60s} {e.count:6d} {e.cpu_time_total / e.count:14.1f} "
                  f"{e.self_cpu_time_total / e.count:13.1f}" for e in ops]
        ops_file.write_text("\n".join(lines) + "\n")
        kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.count),
                         key=lambda e: e.self_device_time_total, reverse=True)[:30]
        lines = [f"{'kernel':70s} {'calls':>6s} {'total ms':>9s} {'us/call':>9s}"]
        lines += [f"{e.key[:70]:70s} {e.count:6d} {e.self_device_time_total / 1e3:9.2f} "
                  f"{e.self_device_time_total / e.count:9.1f}" for e in kernels]
        ops_file.with_name(ops_file.name.replace("ops_", "kernels_", 1)).write_text("\n".join(lines) + "\n")
    host_ms, wall_ms, gpu_ms = 1e3 * statistics.median(hosts), 1e3 * statistics.median(walls), gpu_us / 1e3
    row = {"model": key, "mode": mode, "B": B, "T": T, "wall_ms": round(wall_ms, 2), "host_ms": round(host_ms, 2),
           "gpu_ms": round(gpu_ms, 2), "launches": launches, "graph_launches": graph_launches,
           "host_us_per_launch": round(1e3 * host_ms / max(launches, 1), 1),
           "wall_over_gpu": round(wall_ms / gpu_ms, 3) if gpu_ms else None,
           "ktok_s": round(B * T / wall_ms, 1), "first_3_steps_s": round(first_s, 1),
           "peak_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
    del model, step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gated_deltanet,hybrid")
    parser.add_argument("--modes", default="eager,compiled,graph")
    parser.add_argument("--shapes", default="8x2048", help="comma-separated BxT")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ops", action="store_true", help="the eager step's costliest ops per model")
    parser.add_argument("--recompute-states", action="store_true",
                        help="each mode again with the chunk states recomputed in the backward")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for key in args.models.split(","):
        for shape in args.shapes.split(","):
            B, T = map(int, shape.split("x"))
            for mode, keep in itertools.product(args.modes.split(","), (True, False) if args.recompute_states
                                                 else (True,)):
                tag = f"{key}_{shape}" + ("" if keep else "_recompute")
                ops = args.out / f"ops_{tag}.txt" if args.ops and mode == "eager" else None
                try:
                    with configs.override(KEEP_STATES=keep):
                        row = measure(key, mode, B, T, args.steps, ops)
                    row["mode"] = mode + ("" if keep else "+recompute")
                except Exception as err:  # a mode that fails says so in its row
                    row = {"model": key, "mode": mode, "B": B, "T": T, "error": f"{type(err).__name__}: {err}"[:300]}
                    torch._dynamo.reset()
                    torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                rows.append(row)
                (args.out / "step_profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
