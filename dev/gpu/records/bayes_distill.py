"""Memory by Design's distillation at a size one GPU affords: a trained Gated DeltaNet turned into Bayesian layers
over the same weights (``linmem.linearize.gated_deltanet_to_bayes``), fine-tuned briefly, against the source.

Record: run by ``dev/gpu/records/bayes_distill.sh`` (its header has the date, command and result).

    python dev/gpu/records/bayes_distill.py --out out/distill-text --task text --seeds 0,1,2   # one GPU, minutes
    python dev/gpu/records/bayes_distill.py --out /tmp/distill --task text --seeds 0 --smoke   # the CPU, 7 minutes
    python dev/gpu/records/bayes_distill.py --out /tmp/distill --task mqar --seeds 0 --smoke   # the CPU, 15 minutes

Per seed (``run.seed``; one process each, ``--jobs`` at a time, stopped at ``--budget-s``):

1. **source**: a Gated DeltaNet trained from scratch (``--task text``: bytes of the Python standard library's
   sources, the default corpus; ``--task mqar``: the recipe ``update-mqar-gated_deltanet``), with ``linmem train``'s
   trainer;
2. **converted**: the source with every memory layer made Bayesian, every shared weight copied (no training);
3. **source+ft**: the source trained on for the fine-tuning steps (the matched-compute control);
4. **converted+ft**: the converted model trained for the same steps, data and learning rate.

Each is scored on the same held-out data by the task's own metric (text: held-out loss ``val_loss``; MQAR: recall
at the trained length and twice it) and, for text, RULER-style needle retrieval (``linmem.eval.niah``:
``niah_single_1`` in a noise haystack, ``niah_single_2`` in text, at the training length and twice it). Writes
``OUT/seed<S>/result.json`` as each model is scored (a seed stopped by the budget keeps what it finished), then
``OUT/distill.md`` and ``OUT/distill.json``: per model and metric the mean ± sample std [min, max] over the seeds
that scored it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from linmem.eval.seeds import Spread, metric_order, run_processes  # noqa: E402

#: the models of one seed, in the order they are scored
MODELS = ("source", "converted", "source+ft", "converted+ft")
NIAH_TASKS = ("niah_single_1", "niah_single_2")


@dataclass(frozen=True)
class Preset:
    """The sizes of one task at one scale."""

    recipe: Optional[str]  # the source's recipe (None: the defaults plus `source`)
    source: tuple[str, ...]  # overrides of the source run
    source_steps: int
    finetune_steps: int
    finetune_lr: float
    niah_lengths: tuple[int, ...] = ()  # text: the training length and twice it
    niah_depths: int = 5
    niah_samples: int = 4


_TEXT_GPU = ("data.task=text", "model.hidden_size=256", "model.num_heads=4", "model.layer_pattern=LLLL",
             "model.memory=gated_deltanet", "data.max_document_tokens=512", "data.tokens_per_batch=16384",
             "optim.lr=0.002")
_TEXT_SMOKE = ("data.task=text", "model.hidden_size=64", "model.num_heads=2", "model.layer_pattern=LL",
               "model.memory=gated_deltanet", "data.max_document_tokens=256", "data.tokens_per_batch=2048",
               "data.text.max_files=80", "optim.lr=0.003")
PRESETS = {
    ("text", "gpu"): Preset(None, _TEXT_GPU, source_steps=1500, finetune_steps=300, finetune_lr=5e-4,
                            niah_lengths=(512, 1024)),
    ("text", "smoke"): Preset(None, _TEXT_SMOKE, source_steps=150, finetune_steps=30, finetune_lr=1e-3,
                              niah_lengths=(512,), niah_depths=2, niah_samples=2),
    ("mqar", "gpu"): Preset("update-mqar-gated_deltanet", (), source_steps=2000, finetune_steps=400,
                            finetune_lr=1e-3),
    ("mqar", "smoke"): Preset("update-mqar-gated_deltanet", ("data.mqar.train_examples=5000",),
                              source_steps=1200, finetune_steps=120, finetune_lr=1e-3),
}


def log(message: str) -> None:
    print(f"[distill {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_config(preset: Preset, device: str, out: Path, steps: int, *extra: str):
    from linmem.train import load_config

    overrides = [*preset.source, f"schedule.steps={steps}", f"schedule.warmup_steps={max(1, steps // 20)}",
                 f"run.device={device}", f"run.out_dir={out}", "run.progress=false", "run.tensorboard=false",
                 "run.save_every=0", "run.eval_every=0", "run.log_every=50", *extra]
    return load_config(recipe=preset.recipe, overrides=overrides)


def score(name: str, model, task, device, preset: Preset) -> dict[str, float]:
    """The task's held-out metric, and for text the NIAH accuracy per task and length."""
    from linmem.eval.niah import run_niah

    started = time.perf_counter()
    metrics = task.evaluate(model.to(device).eval(), device)
    if task.codec is not None:
        result = run_niah(model, task.codec.encode, task.codec.decode, tasks=NIAH_TASKS, lengths=preset.niah_lengths,
                          depths=preset.niah_depths, samples=preset.niah_samples, max_new_tokens=12,
                          eos_token_id=task.codec.eos_token_id, progress=False)
        metrics.update({f"niah/{t}/L{n}": result.accuracy(t, n) for t in NIAH_TASKS for n in preset.niah_lengths})
    log(f"{name}: {json.dumps({k: round(v, 4) for k, v in metrics.items()})} ({time.perf_counter() - started:.0f} s)")
    return metrics


def pipeline(out: Path, task_name: str, scale: str, seed: int, device_name: str) -> None:
    """One seed: train the source, convert, fine-tune both, score all four; ``out/result.json`` after each."""
    import torch

    from linmem.linearize import gated_deltanet_to_bayes
    from linmem.models import LinmemForCausalLM
    from linmem.train import Trainer
    from linmem.train.tasks import build_task
    from linmem.train.trainer import resolve_device

    preset = PRESETS[(task_name, scale)]
    device = resolve_device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(1)
    seed_args = (f"run.seed={seed}",)
    record = {"seed": seed, "task": task_name, "scale": scale, "device": str(device), "preset": asdict(preset),
              "seconds": {}, "models": {}}

    def save() -> None:
        (out / "result.json").write_text(json.dumps(record, indent=2) + "\n")

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    source_cfg = run_config(preset, device_name, out / "source", preset.source_steps, *seed_args)
    Trainer(source_cfg).train()
    record["seconds"]["source"] = time.perf_counter() - started
    task = build_task(source_cfg.data)
    source = LinmemForCausalLM.from_pretrained(out / "source" / "model")
    record["models"]["source"] = score("source", source, task, device, preset)
    save()

    converted, conversion = gated_deltanet_to_bayes(source)
    converted.save_pretrained(out / "converted")
    record["conversion"] = {"copied": len(conversion.copied), "initialised": sorted(conversion.initialised)}
    record["models"]["converted"] = score("converted", converted, task, device, preset)
    save()
    del source, converted

    for name, start in (("source+ft", out / "source" / "model"), ("converted+ft", out / "converted")):
        began = time.perf_counter()
        folder = out / name.replace("+", "_")
        Trainer(run_config(preset, device_name, folder, preset.finetune_steps, *seed_args,
                           f"model.pretrained={start}", f"optim.lr={preset.finetune_lr}")).train()
        record["seconds"][name] = time.perf_counter() - began
        model = LinmemForCausalLM.from_pretrained(folder / "model")
        record["models"][name] = score(name, model, task, device, preset)
        save()
        del model


def table(results: list[dict]) -> list[dict]:
    """Per model and metric, the spread over the seeds that scored it."""
    rows = []
    for model in MODELS:
        scored = [r for r in results if model in r["models"]]
        metrics = sorted({m for r in scored for m in r["models"][model]}, key=metric_order)
        for metric in metrics:
            values = [r["models"][model][metric] for r in scored if metric in r["models"][model]]
            rows.append({"model": model, "metric": metric, "seeds": [r["seed"] for r in scored],
                         **asdict(Spread.of(values))})
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per model, one column per metric (perplexity left out: it is exp(val_loss))."""
    metrics = [m for m in dict.fromkeys(r["metric"] for r in rows) if m != "val_ppl"]
    head = ["model", "seeds", *metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = {r["metric"]: r for r in rows if r["model"] == model}
        seeds = max(len(c["seeds"]) for c in cells.values())
        lines.append(f"| {model} | {seeds} | " + " | ".join(
            Spread(**{k: cells[m][k] for k in ("mean", "std", "min", "max", "n")}).text(4) if m in cells else "-"
            for m in metrics) + " |")
    return "\n".join(lines) + "\n\nmean ± std [min, max] over seeds; std: the sample standard deviation (ddof 1).\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--task", choices=("text", "mqar"), default="text")
    parser.add_argument("--seeds", default="0,1,2", help="run.seed values, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, for a CPU")
    parser.add_argument("--device", default="auto", help="run.device of every run (auto: cuda when there is one)")
    parser.add_argument("--jobs", type=int, default=None, help="seeds at once (default: all)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds until running seeds are stopped")
    parser.add_argument("--gpus", type=int, default=1, help="spread the seeds over this many GPUs (round robin)")
    parser.add_argument("--one-seed", type=int, default=None, help=argparse.SUPPRESS)  # a seed's own process
    args = parser.parse_args(argv)
    scale = "smoke" if args.smoke else "gpu"
    if args.one_seed is not None:
        pipeline(args.out, args.task, scale, args.one_seed, args.device)
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    commands = {f"seed{s}": [sys.executable, __file__, "--out", str(args.out / f"seed{s}"), "--task", args.task,
                             "--device", args.device, "--one-seed", str(s), *(["--smoke"] if args.smoke else [])]
                for s in seeds}
    log(f"{args.task} ({scale}): seeds {seeds}, budget {args.budget_s:.0f} s")
    done = run_processes(commands, jobs=args.jobs or len(seeds), budget_s=args.budget_s, logs=args.out / "logs",
                         gpus=args.gpus, cwd=ROOT)
    results = [json.loads(p.read_text()) for s in seeds if (p := args.out / f"seed{s}" / "result.json").is_file()]
    rows = table(results)
    report = markdown(rows) if rows else "no seed scored a model\n"
    (args.out / "distill.md").write_text(report)
    (args.out / "distill.json").write_text(json.dumps({"task": args.task, "scale": scale, "runs": results,
                                                       "status": {n: asdict(r) for n, r in done.items()},
                                                       "table": rows}, indent=2) + "\n")
    print(report)
    for name, result in done.items():
        print(f"{name}: {result.status} ({result.seconds:.0f} s)")
    return 1 if any(r.status == "failed" for r in done.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
