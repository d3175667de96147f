"""Parallel training on 1, 2 and 4 GPUs of one host: correctness first, then throughput.

Launched by ``distributed_bench.sh`` (``torchrun --nproc-per-node N``); each launch runs every
measurement of its GPU count and appends rows to ``$OUT/distributed_bench_N.json``; ``--mode table``
joins them into one table (efficiencies against the one-GPU rows) and ``distributed_bench.json``.

* check (N GPUs): the sequence-parallel ops (recurrence on the GPU backends in fp32 and bf16,
  attention over gathered keys) and an expert-parallel MoE layer against one GPU; a hybrid model
  under sequence parallelism against one GPU when the layers consult ``linmem.ops.parallel``.
* sp: weak scaling, every GPU a piece of ``--pieces`` tokens of one sequence (sequence = piece * N)
  for the ~340M Gated DeltaNet and its hybrid (LLLN) (``--sp-models``), activation checkpointing, bf16,
  FSDP2 units of ``--unit`` blocks.
* dp: data-parallel throughput of the Gated DeltaNet (FSDP2, ``--dp-rows`` x 4096 tokens per GPU); on more
  than one GPU four times: blocks resharded one by one after the forward (``parallel.fsdp=true``,
  ``blocks_per_unit=1``, gathered again for the backward), kept gathered (``fsdp=false``: one all-gather a
  step fewer, more memory), resharded in units of 4 blocks (``blocks_per_unit=4``, the default: a quarter
  of FSDP2's hooks and copies), and with every block compiled (``compile_blocks``, ``run.compile`` under
  torchrun; its compilation falls in the warm-up).
  On one GPU the eager and the compiled rows (sharding options have nothing to act on there). ``--dp-layouts``
  picks among them; the table sets compiled rows against the compiled one-GPU row.
* ``--profile``: after a row's timed steps, rank 0 records one more step with ``torch.profiler`` and writes
  the ops by self CUDA time and by self CPU time to ``$OUT/profile_<mode>_<N>gpu_<model>_<seq>_fsdp<0|1>_unit<k>.txt``.
* ep: the Linear-MoE A0.3B-2B recipe with its 64 experts split over the N GPUs (4 x 2048 tokens per GPU),
  FSDP2 units of ``--unit`` blocks.
* tp: tensor parallelism x FSDP2 (``--tp-models``, the ~340M Gated DeltaNet and its hybrid): for every ``tp`` of
  ``--tp-sizes`` that divides N and the model's heads, ``dp = N / tp`` data ranks of ``--tp-rows`` x 4096 tokens
  (the ``tp`` ranks of a data rank share its tokens), FSDP2 units of ``--unit`` blocks; the one-GPU row is the
  unsharded model on ``--tp-rows`` x 4096 tokens. The checks add a tensor-parallel hybrid model against one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from linmem.distributed import (
    ParallelConfig,
    SequenceParallel,
    build_mesh,
    clip_grad_norm_,
    expert_parallel,
    init_distributed,
    parallelize,
    sequence_parallel,
    shard_sequence,
    sp_attention,
    sp_linear_recurrence,
)
from linmem.layers.moe import MoEArgs, MoEFeedForward
from linmem.models import LinmemConfig, LinmemForCausalLM, model_recipe
from linmem.ops import linear_recurrence, parallel
from linmem.ops.attention import forgetting_attention

GDN, HYBRID, MOE = "gated_deltanet-340m", "hybrid-gdn-340m", "linear-moe-a0.3b-2b"
#: the data-parallel layouts: (parallel.fsdp, parallel.blocks_per_unit, compiled blocks)
DP_LAYOUTS = {"units1": (True, 1, False), "gathered": (False, 1, False), "units4": (True, 4, False),
              "compiled": (True, 1, True)}
DEV = "cuda"  # "cpu" with --smoke: tiny models on gloo, to try the script without GPUs
OUT_DIR = Path("out")  # --out
SMOKE = {"hidden_size": 64, "num_heads": 2, "vocab_size": 256,
         "moe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}}


def log(*parts) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def size(gpu: int, cpu: int) -> int:
    return gpu if DEV == "cuda" else cpu


def worst_over_ranks(value: float) -> float:
    t = torch.tensor([value], device=DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ---------------------------------------------------------------------------------------------- checks


def check_recurrence(dtype: torch.dtype, varlen: bool) -> float:
    """Gated DeltaNet-shaped inputs, one sequence of 1024 tokens per rank; every rank compares its piece."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device=DEV).manual_seed(0)
    T, H, K = size(1024, 64) * world, 4, size(128, 16)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q, k, v = rnd(1, T, H, K).to(dtype), F.normalize(rnd(1, T, H, K), dim=-1).to(dtype), rnd(1, T, H, K).to(dtype)
    g = F.logsigmoid(rnd(1, T, H) + 4)
    beta = torch.sigmoid(rnd(1, T, H)).to(dtype)
    cu = torch.tensor([0, T // 4, T - T // 3, T], device=DEV) if varlen else None
    o_ref, S_ref = linear_recurrence(q, k, v, log_decay=g, beta=beta, cu_seqlens=cu, output_final_state=True)
    L = T // world
    piece = lambda x: x[:, rank * L:(rank + 1) * L]  # noqa: E731
    kw = {}
    if varlen:
        from linmem.distributed import split_packing

        local, prefix = split_packing(cu, T, rank, world)
        kw = dict(cu_seqlens=local, prefix_length=prefix)
    o, _ = sp_linear_recurrence(piece(q), piece(k), piece(v), group=dist.group.WORLD, log_decay=piece(g),
                                beta=piece(beta), **kw)
    return worst_over_ranks(rel(o, piece(o_ref)))


def check_attention(window) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device=DEV).manual_seed(1)
    T = size(2048, 64) * world
    q, k, v = (torch.randn(1, T, 8, 64, generator=gen, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    ref = forgetting_attention(q, k, v, window=None if window is None else size(window, 8))
    L = T // world
    piece = lambda x: x[:, rank * L:(rank + 1) * L]  # noqa: E731
    o = sp_attention(piece(q), piece(k), piece(v), group=dist.group.WORLD,
                     window=None if window is None else size(window, 8))
    return worst_over_ranks(rel(o, piece(ref)))


def check_experts() -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    D = size(256, 32)
    reference = MoEFeedForward(MoEArgs(hidden_size=D, intermediate_size=2 * D, num_experts=8 * world,
                                       num_experts_per_tok=4)).to(DEV)
    layer = MoEFeedForward(reference.args).to(DEV)
    layer.load_state_dict(reference.state_dict())
    mesh = torch.distributed.device_mesh.init_device_mesh(DEV, (world,), mesh_dim_names=("ep",))
    expert_parallel(layer, mesh["ep"], dist.group.WORLD)
    x = torch.randn(world * 4, size(256, 16), D, generator=torch.Generator(device=DEV).manual_seed(2), device=DEV)
    mine = slice(rank * 4, (rank + 1) * 4)
    return worst_over_ranks(rel(layer(x[mine]), reference(x)[mine]))


def layers_consult_hook() -> bool:
    """Whether the layers reach the ops through linmem.ops.parallel (else whole models are not sequence-parallel)."""
    seen = set()

    class Recorder:
        def linear_recurrence(self, q, k, v, **kwargs):
            seen.add("recurrence")
            with parallel.local_ops():
                return linear_recurrence(q, k, v, **kwargs)

        def attention(self, q, k, v, **kwargs):
            seen.add("attention")
            with parallel.local_ops():
                return forgetting_attention(q, k, v, **kwargs)

        def halo(self, x, size, cu_seqlens):
            seen.add("halo")
            return x.new_zeros(x.shape[0], size, *x.shape[2:])

    model = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=64, num_heads=2, layer_pattern="LN")).to(DEV)
    with parallel.sequence_parallel(Recorder()):
        model(torch.zeros(1, 8, dtype=torch.long, device=DEV), use_cache=False)
    return seen == {"recurrence", "attention", "halo"}


def check_model() -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    config = model_recipe(HYBRID).build_config(layer_pattern="LLLN", hidden_size=size(256, 64), num_heads=2,
                                               vocab_size=size(32000, 256))
    model = LinmemForCausalLM(config).to(DEV)
    T = size(1024, 64) * world
    ids = torch.randint(0, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(3)).to(DEV)
    batch = {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, T // 10, T - T // 3, T], device=DEV)}
    with torch.no_grad():
        ref = model(ids, cu_seqlens=batch["cu_seqlens"], use_cache=False).logits
        piece, layout = shard_sequence(batch, rank, world)
        with sequence_parallel(SequenceParallel(dist.group.WORLD, layout, piece["cu_seqlens"])):
            got = model(piece["input_ids"], position_ids=piece["position_ids"], cu_seqlens=piece["cu_seqlens"],
                        use_cache=False).logits
    L = T // world
    return worst_over_ranks(rel(got, ref[:, rank * L:(rank + 1) * L]))


def check_tensor_parallel() -> float:
    """The hybrid's logits with its heads and hidden units split over every GPU (tp = N), against one GPU, fp32."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    config = model_recipe(HYBRID).build_config(layer_pattern="LLLN", hidden_size=size(256, 64), num_heads=world * 2,
                                               vocab_size=size(32000, 256), intermediate_size=size(512, 64))
    reference = LinmemForCausalLM(config).to(DEV)
    model = LinmemForCausalLM(config).to(DEV)
    model.load_state_dict(reference.state_dict())
    layout = ParallelConfig(tp=world)
    model = parallelize(model, build_mesh(layout, DEV), layout)
    ids = torch.randint(0, config.vocab_size, (2, size(1024, 32)), generator=torch.Generator().manual_seed(4)).to(DEV)
    with torch.no_grad():
        return worst_over_ranks(rel(model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits))


def run_checks() -> list[dict]:
    rows = []
    checks = [
        ("recurrence gated delta fp32", lambda: check_recurrence(torch.float32, False), 1e-4),
        ("recurrence gated delta bf16", lambda: check_recurrence(torch.bfloat16, False), 5e-3),
        ("recurrence gated delta bf16 packed", lambda: check_recurrence(torch.bfloat16, True), 5e-3),
        ("attention causal bf16", lambda: check_attention(None), 5e-3),
        ("attention window 512 bf16", lambda: check_attention(512), 5e-3),
        ("expert-parallel MoE fp32", check_experts, 1e-4),
        ("tensor-parallel hybrid model fp32", check_tensor_parallel, 1e-4),
    ]
    if layers_consult_hook():
        checks.append(("hybrid model, packed, fp32", check_model, 1e-4))
    else:
        rows.append({"mode": "check", "what": "hybrid model", "result": "not run: the layers do not consult "
                     "linmem.ops.parallel"})
    for name, fn, tol in checks:
        err = fn()
        rows.append({"mode": "check", "what": name, "error_ratio": err, "ok": err < tol})
        log(f"check {name}: error ratio {err:.2e} ({'ok' if err < tol else 'FAIL'}, limit {tol:g})")
    return rows


# ---------------------------------------------------------------------------------------------- timing


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group) -> torch.Tensor:
    """The global-batch share of the cross-entropy without materialising all logits (8K tokens at a time);
    ``group`` None: this process's mean."""
    total = hidden.new_zeros((), dtype=torch.float32)

    def ce(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(h, weight).float().flatten(0, 1), t.flatten(), reduction="sum")

    for s in range(0, hidden.shape[1], 8192):
        total = total + checkpoint(ce, hidden[:, s:s + 8192], targets[:, s:s + 8192], use_reentrant=False)
    count = (targets != -100).sum().float()
    if group is None:
        return total / count
    dist.all_reduce(count, group=group)
    return total * dist.get_world_size(group) / count


def timed_training(name: str, config: ParallelConfig, model_config: LinmemConfig, rows: int, seq: int,
                   steps: int, warmup: int = 2, profile: bool = False, compiled: bool = False) -> dict:
    world = dist.get_world_size()
    if DEV == "cuda":
        torch.cuda.empty_cache()  # the previous measurement's model is gone
        torch.cuda.reset_peak_memory_stats()
    mesh = build_mesh(config)
    torch.manual_seed(0)
    model = parallelize(LinmemForCausalLM(model_config).to(DEV), mesh, config, compile_blocks=compiled)
    # the trainer's optimizer: fused on GPU (one kernel launch, no DTensor dispatch per foreach op), a group per
    # device mesh (tensor parallelism alone leaves the replicated parameters plain tensors beside its DTensors)
    by_mesh: dict = {}
    for p in model.parameters():
        by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    optimizer = torch.optim.AdamW([{"params": group} for group in by_mesh.values()], lr=1e-4, fused=DEV == "cuda",
                                  foreach=DEV == "cpu")
    group = mesh.data.get_group()
    dp_rank, sp_rank = mesh.dp.get_local_rank(), mesh.sp.get_local_rank()
    gen = torch.Generator().manual_seed(dp_rank)

    def step() -> None:
        ids = torch.randint(0, model_config.vocab_size, (rows, seq), generator=gen).to(DEV)
        piece, layout = shard_sequence({"input_ids": ids, "labels": ids}, sp_rank, config.sp)
        handler = SequenceParallel(mesh.sp.get_group(), layout, None)
        with sequence_parallel(handler) if config.sp > 1 else nullcontext():
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
                out = model(piece["input_ids"], position_ids=piece["position_ids"], use_cache=False,
                            output_hidden_states=True, logits_to_keep=1)
                loss = chunked_loss(out.hidden_states[-1], model.lm_head.weight, piece["targets"], group)
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss
            loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    row = {"mode": name, "model": model_config.name_or_path, "gpus": world, "config": str(config), "seq": seq,
           "fsdp": config.fsdp, "blocks_per_unit": config.blocks_per_unit, "compiled": compiled, "tp": config.tp,
           "tokens_per_gpu": rows * seq // config.sp}  # a data rank's; its tp ranks share them
    try:
        for _ in range(warmup):
            step()
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize()
        seconds = (time.perf_counter() - start) / steps
        tokens = rows * seq * config.dp  # the global batch
        row.update(step_s=seconds, tokens_per_s=tokens / seconds, tokens_per_s_per_gpu=tokens / seconds / world,
                   peak_gb=peak_gb())
        if profile:
            profiled_step(step, f"{name}_{world}gpu_{model_config.name_or_path}_{seq}_fsdp{int(config.fsdp)}"
                                f"_unit{config.blocks_per_unit}{'_compiled' if compiled else ''}")
    except torch.cuda.OutOfMemoryError:
        row.update(result="out of memory", peak_gb=peak_gb())
    log(json.dumps(row))
    return row


def profiled_step(step, label: str) -> None:
    """One more step, recorded on rank 0 (the others run it unrecorded: the collectives need every rank)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=activities) if dist.get_rank() == 0 else nullcontext() as recorded:
        dist.barrier()
        start = time.perf_counter()
        step()
        synchronize()
        wall = time.perf_counter() - start
    if dist.get_rank() == 0:
        averages = recorded.key_averages()
        text = [f"{label}: one step, {wall * 1e3:.1f} ms wall (under the profiler)"]
        for key in (["self_device_time_total"] if DEV == "cuda" else []) + ["self_cpu_time_total"]:
            text += ["", f"sorted by {key}", averages.table(sort_by=key, row_limit=30, max_name_column_width=70)]
        (OUT_DIR / f"profile_{label}.txt").write_text("\n".join(text))


def synchronize() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0


def recipe_config(name: str) -> LinmemConfig:
    small = dict(SMOKE, layer_pattern=model_recipe(name).config["layer_pattern"][:4]) if DEV == "cpu" else {}
    config = model_recipe(name).build_config(**small)
    config.name_or_path = name
    return config


def run_timing(args) -> list[dict]:
    world = dist.get_world_size()
    rows = []
    if args.modes == "all" or "sp" in args.modes:
        wired = layers_consult_hook()
        for name in args.sp_models:
            for piece in args.pieces:
                if world > 1 and not wired:
                    rows.append({"mode": "sp", "model": name, "gpus": world, "seq": piece * world,
                                 "result": "not run: the layers do not consult linmem.ops.parallel"})
                    continue
                config = ParallelConfig(dp=1, sp=world, activation_checkpointing=True, blocks_per_unit=args.unit)
                rows.append(timed_training("sp", config, recipe_config(name), 1, piece * world, args.steps,
                                           profile=args.profile))
    if args.modes == "all" or "dp" in args.modes:
        # on one GPU the model is not sharded: every eager layout is the one unsharded row
        chosen = dict.fromkeys(DP_LAYOUTS[name if world > 1 or name == "compiled" else "units1"]
                               for name in args.dp_layouts)
        for fsdp, unit, compiled in chosen:
            rows.append(timed_training("dp", ParallelConfig(dp=world, fsdp=fsdp, blocks_per_unit=unit),
                                       recipe_config(GDN), args.dp_rows, 4096, args.steps, profile=args.profile,
                                       compiled=compiled))
    if args.modes == "all" or "ep" in args.modes:
        config = ParallelConfig(dp=world, ep=world, blocks_per_unit=args.unit)
        rows.append(timed_training("ep", config, recipe_config(MOE), 4, 2048, args.steps, profile=args.profile))
    if args.modes == "all" or "tp" in args.modes:
        for name in args.tp_models:
            model_config = recipe_config(name)
            sizes = [1] if world == 1 else [tp for tp in args.tp_sizes
                                            if world % tp == 0 and model_config.num_heads % tp == 0]
            for tp in sizes:
                config = ParallelConfig(dp=world // tp, tp=tp, blocks_per_unit=args.unit)
                rows.append(timed_training("tp", config, model_config, args.tp_rows, 4096, args.steps,
                                           profile=args.profile))
    return rows


# ---------------------------------------------------------------------------------------------- table


def tp_note(row: dict) -> str:
    tp = row.get("tp", 1)
    return f", tp {tp} x dp {row['gpus'] // tp}" if tp > 1 else ""


def table(out: Path) -> None:
    rows = []
    for path in sorted(out.glob("distributed_bench_*.json")):
        rows += json.loads(path.read_text())
    key = lambda r: (r["mode"], r.get("model"), r.get("tokens_per_gpu"), r.get("compiled", False))  # noqa: E731
    base = {key(r): r for r in rows if r.get("gpus") == 1 and "tokens_per_s" in r}  # compiled against compiled
    print(f"{'mode':6} {'model':22} {'GPUs':>4} {'seq':>8} {'tok/s':>10} {'tok/s/GPU':>10} {'eff.':>6} "
          f"{'step s':>7} {'peak GB':>8}  note")
    for r in rows:
        if r["mode"] == "check":
            print(f"check  {r['what']:40} " + (f"error ratio {r['error_ratio']:.2e} {'ok' if r['ok'] else 'FAIL'}"
                                              if "error_ratio" in r else r["result"]))
            continue
        one = base.get(key(r))
        eff = ""
        if one is not None and "tokens_per_s" in r:
            eff = f"{r['tokens_per_s_per_gpu'] / one['tokens_per_s_per_gpu']:.0%}"
            r["efficiency"] = r["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
        if "tokens_per_s" in r:
            print(f"{r['mode']:6} {r['model']:22} {r['gpus']:>4} {r['seq']:>8} {r['tokens_per_s']:>10,.0f} "
                  f"{r['tokens_per_s_per_gpu']:>10,.0f} {eff:>6} {r['step_s']:>7.2f} {r['peak_gb']:>8.1f}  "
                  f"{'' if r.get('fsdp', True) else 'blocks kept gathered (fsdp=false)'}"
                  f"{f'units of {u} blocks' if (u := r.get('blocks_per_unit', 1)) > 1 else ''}"
                  f"{'compiled blocks' if r.get('compiled') else ''}"
                  f"{tp_note(r)}")
        else:
            print(f"{r['mode']:6} {r.get('model', ''):22} {r.get('gpus', ''):>4} {r.get('seq', ''):>8}  "
                  f"{r['result']}")
    (out / "distributed_bench.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--modes", default="all", help="all, or a comma list of check, sp, dp, ep, tp; table joins")
    parser.add_argument("--pieces", type=int, nargs="+", default=[32768, 65536], help="sp: tokens per GPU")
    parser.add_argument("--sp-models", nargs="+", default=[GDN, HYBRID], help="sp: the recipes to time")
    parser.add_argument("--unit", type=int, default=ParallelConfig().blocks_per_unit,
                        help="sp, ep: parallel.blocks_per_unit")
    parser.add_argument("--dp-rows", type=int, default=8, help="dp: sequences of 4096 tokens per GPU")
    parser.add_argument("--dp-layouts", nargs="+", default=list(DP_LAYOUTS), choices=list(DP_LAYOUTS),
                        help="dp: the layouts to time (one GPU: every eager one is the unsharded model)")
    parser.add_argument("--tp-models", nargs="+", default=[GDN, HYBRID], help="tp: the recipes to time")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[2, 4],
                        help="tp: tensor-parallel sizes (those dividing the GPUs and the model's heads)")
    parser.add_argument("--tp-rows", type=int, default=4, help="tp: sequences of 4096 tokens per data rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="a profiled step after each timed row (rank 0)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU (gloo): try the script")
    args = parser.parse_args()
    global DEV, OUT_DIR
    if args.smoke:
        DEV = "cpu"
    OUT_DIR = args.out
    args.out.mkdir(parents=True, exist_ok=True)
    if args.modes == "table":
        table(args.out)
        return
    init_distributed(DEV)
    rows = []
    if dist.get_world_size() > 1 and (args.modes == "all" or "check" in args.modes):
        rows += run_checks()
    rows += run_timing(args)
    if dist.get_rank() == 0:
        path = args.out / f"distributed_bench_{dist.get_world_size()}.json"
        previous = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(previous + rows, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
