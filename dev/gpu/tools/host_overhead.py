"""Host (CPU) cost of one data-parallel training step: what FSDP2 wrapping adds to the eager model.

The ``gated_deltanet-340m`` recipe's architecture (all its layers) at a tiny width and a tiny batch,
on CPU with gloo: every op's arithmetic takes microseconds, so a step's time is the per-op host work
(Python, dispatch, FSDP2's hooks, DTensor) plus gloo's transfers. One step is the one
``distributed_bench.py::timed_training`` runs: forward, loss, backward, ``clip_grad_norm_``,
``optimizer.step()``, ``zero_grad``; each phase is timed on its own (all synchronous on CPU).

Variants (``--variants``, each ``layout[+knob...]``):

* layouts: ``plain`` (the model without wrapping; under several processes every rank trains its own
  copy, no collectives), ``fsdp`` (``parallelize(..., ParallelConfig(dp=world))``) and ``gathered``
  (the same with ``fsdp=False``: blocks kept gathered from forward to backward);
* knobs: ``fused`` (AdamW ``fused=True`` instead of ``foreach=True``), ``dtclip`` (the gradient norm
  through DTensor ops, as ``torch.nn.utils.get_total_norm`` computes it on sharded gradients, instead
  of ``linmem.distributed.clip_grad_norm_``), ``bf16`` (parameters gathered in bf16 under CPU autocast,
  the casts a GPU run makes), ``unit4`` (``blocks_per_unit=4``: FSDP2 units of 4 blocks), ``compiled``
  (``torch.compile`` of every block, inside its FSDP unit; compilation falls in the warm-up).

``--profile``: one more step per variant on rank 0 under ``torch.profiler``; the ops by self CPU time,
with the time in gloo's collectives (``record_param_comms``, ``gloo:*``, ``c10d::*``, waits) summed
apart, go to ``--out``.

``--fake 2``: one process plays rank 0 of 2 on torch's fake process group (collectives return at
once, their outputs uninitialised): the FSDP2 variants' time is then their host work alone, free of
gloo's transfers and of waiting for the other rank.

Usage::

    torchrun --standalone --nproc-per-node 2 dev/gpu/tools/host_overhead.py
    python dev/gpu/tools/host_overhead.py            # one process: the plain model only
    python dev/gpu/tools/host_overhead.py --fake 2 --variants plain fsdp gathered
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from distributed_bench import chunked_loss  # this folder's bench: the step's loss is its loss
from torch.distributed.tensor import DTensor

from linmem.distributed import ParallelConfig, build_mesh, clip_grad_norm_, init_distributed, parallelize
from linmem.models import LinmemForCausalLM, model_recipe

RECIPE = "gated_deltanet-340m"
PHASES = ("forward", "backward", "clip", "optimizer")
TINY = {"hidden_size": 64, "num_heads": 2, "vocab_size": 256}
FAKE = False  # --fake: collectives return at once
COMMS = ("record_param_comms", "gloo:", "c10d::", "c10d:", "wait", "barrier")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def log(*parts) -> None:
    if rank() == 0:
        print(*parts, flush=True)


@torch.no_grad()
def dtensor_clip(parameters, max_norm: float) -> torch.Tensor:
    """The gradient norm through DTensor ops (torch's ``get_total_norm`` on sharded gradients), then the clip."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.nn.utils.clip_grads_with_norm_([p for p in parameters if p.grad is not None], max_norm, norm)
    return norm


class Variant:
    """One model + optimizer + step, built from ``layout[+knob...]``."""

    def __init__(self, spec: str, seq: int, rows: int, layers: Optional[int]):
        layout, *knobs = spec.split("+")
        unknown = set(knobs) - {"fused", "dtclip", "bf16", "unit4", "compiled"}
        if layout not in ("plain", "fsdp", "gathered") or unknown:
            raise ValueError(f"--variants: expected layout plain|fsdp|gathered and knobs fused|dtclip|bf16|unit4|compiled, "
                             f"got {spec!r}")
        if layout != "plain" and world() == 1:
            raise ValueError(f"--variants {spec!r} needs several processes (torchrun --nproc-per-node 2)")
        self.spec, self.rows, self.seq = spec, rows, seq
        self.bf16 = "bf16" in knobs
        overrides = dict(TINY)
        if layers is not None:
            overrides["layer_pattern"] = model_recipe(RECIPE).config["layer_pattern"][:layers]
        config = model_recipe(RECIPE).build_config(**overrides)
        self.vocab = config.vocab_size
        torch.manual_seed(0)
        model = LinmemForCausalLM(config)
        self.group = None
        if layout != "plain":
            parallel = ParallelConfig(dp=world(), fsdp=layout == "fsdp", blocks_per_unit=4 if "unit4" in knobs else 1)
            mesh = build_mesh(parallel, "cpu")
            model = parallelize(model, mesh, parallel, param_dtype=torch.bfloat16 if self.bf16 else None,
                                compile_blocks="compiled" in knobs)
            self.group = mesh.data.get_group()
        elif "compiled" in knobs:
            for block in model.model.layers:
                block.compile()
        self.model = model
        self.parameters = list(model.parameters())
        kind = {"fused": True} if "fused" in knobs else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.parameters, lr=1e-4, **kind)
        self.clip: Callable = dtensor_clip if "dtclip" in knobs else (
            clip_grad_norm_ if layout != "plain" else torch.nn.utils.clip_grad_norm_)
        self.gen = torch.Generator().manual_seed(rank())
        self.param_count = sum(p.numel() for p in model.parameters())

    def step(self, times: Optional[dict] = None) -> None:
        cpu, wall = time.thread_time, time.perf_counter
        ids = torch.randint(0, self.vocab, (self.rows, self.seq + 1), generator=self.gen)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        w0, t0 = wall(), cpu()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            out = self.model(inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
            loss = chunked_loss(out.hidden_states[-1], self.model.lm_head.weight, targets, self.group)
        t1 = cpu()
        loss.backward()
        t2 = cpu()
        self.clip(self.parameters, 1.0)
        t3 = cpu()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t4, w4 = cpu(), wall()
        if times is not None:
            for name, dt in zip(PHASES + ("step", "wall"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, w4 - w0)):
                times[name].append(dt)


COLUMNS = PHASES + ("step", "wall")


def measure(variants: list[Variant], steps: int, warmup: int) -> list[dict[str, float]]:
    """Median ms per phase for every variant, their steps interleaved (a change of the machine's load
    meets them all alike). Phases in this thread's CPU time: the host work, without waits for the
    other ranks or gloo's threads; ``wall``: the whole step by the clock."""
    for _ in range(warmup):
        for variant in variants:
            variant.step()
    times = [{name: [] for name in COLUMNS} for _ in variants]
    for _ in range(steps):
        for variant, record in zip(variants, times):
            if world() > 1 and not FAKE:
                dist.barrier()  # every rank starts the step together
            variant.step(record)
    rows = []
    for record in times:
        medians = [statistics.median(record[name]) * 1e3 for name in COLUMNS]
        if world() > 1 and not FAKE:  # the slower rank sets the pace
            t = torch.tensor(medians)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            medians = t.tolist()
        rows.append(dict(zip(COLUMNS, medians)))
    return rows


def profile(variant: Variant, out: Path, rows: int) -> None:
    """One profiled step on rank 0 (the others run it unrecorded); self CPU time by op, comms summed apart."""
    from torch.profiler import ProfilerActivity, profile as record

    with record(activities=[ProfilerActivity.CPU]) if rank() == 0 else nullcontext() as recorded:
        if world() > 1:
            dist.barrier()
        start = time.perf_counter()
        variant.step()
        wall = (time.perf_counter() - start) * 1e3
    if rank() != 0:
        return
    averages = recorded.key_averages()
    comms = sum(e.self_cpu_time_total for e in averages if e.key.startswith(COMMS)) / 1e3
    total = sum(e.self_cpu_time_total for e in averages) / 1e3
    name = variant.spec.replace("+", "_")
    text = [f"{variant.spec}: one step, {wall:.1f} ms wall under the profiler; self CPU {total:.1f} ms, of which "
            f"{comms:.1f} ms in collectives and waits ({', '.join(COMMS)})", "",
            averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)]
    (out / f"host_overhead_{name}_{world()}proc.txt").write_text("\n".join(text))
    log(text[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=None,
                        help="layout[+knob...]; default plain (1 process) or plain fsdp gathered")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None, help="the recipe's first N layers (default all)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=40)
    parser.add_argument("--fake", type=int, default=0, metavar="WORLD",
                        help="one process as rank 0 of WORLD ranks on torch's fake process group: collectives "
                             "do nothing, so a step's time is host work only (the numbers are garbage)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    torch.set_num_threads(1)  # host cost per op, not intra-op threading (and one core per process)
    if args.fake:
        global FAKE
        FAKE = True
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake)
    elif "RANK" in os.environ:
        init_distributed("cpu")
    variants = args.variants or (["plain"] if world() == 1 else ["plain", "fsdp", "gathered"])
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"{RECIPE} at {TINY}, {args.rows} x {args.seq} tokens per rank, {world()} "
        f"{'ranks simulated on the fake process group' if args.fake else 'process(es)'}, "
        f"median of {args.steps} steps after {args.warmup}")
    built = [Variant(spec, args.seq, args.rows, args.layers) for spec in variants]
    rows = measure(built, args.steps, args.warmup)
    log(f"{'variant':24} " + " ".join(f"{p:>9}" for p in COLUMNS) + "   (ms: thread CPU per phase; wall per step)")
    for variant, m in zip(built, rows):
        log(f"{variant.spec:24} " + " ".join(f"{m[p]:9.1f}" for p in COLUMNS))
    if args.profile:
        for variant in built:
            profile(variant, args.out, args.profile_rows)
    if world() > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
