"""The built-in default job (``linmem demo``): a small memory study on one CPU.

1. MQAR: softmax attention, Gated DeltaNet, GLA, linear attention and a hybrid at width 64
   (attention also at width 32), trained on a mix of kv-pair counts at sequence length 64 (more
   queries per example = more signal per step on a CPU); prints the recall table and writes
   ``mqar_accuracy.png`` and ``mqar_loss.png``. The vocabulary is 64 tokens instead of Zoology's
   8192 so that small models learn it in minutes; the price is that random filler tokens often
   repeat a key (see ``docs/mqar.md``).
2. Text: a small hybrid (Gated DeltaNet + softmax attention) trained on bytes of the Python
   standard library's sources; prints held-out perplexity and a sample.

The runs are independent and small, so they run side by side in worker processes, one per core.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .eval.plots import plot_loss_curves, plot_mqar_accuracy
from .train import Trainer, load_config
from .train.runs import load_run


@dataclass(frozen=True)
class DemoModel:
    """One model of the study: its config overrides and the training settings tuned for it."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)  # model.* overrides
    widths: tuple[int, ...] = (64,)  # model widths trained
    lr: float = 2e-3  # peak learning rate (tuned per model, as Zoology sweeps it)
    steps: int = 1000  # training steps
    warmup: int = 50  # warm-up steps of the learning rate


MQAR_MODELS = [
    DemoModel("attention", {"layer_pattern": "NN", "attention": "softmax"}, widths=(64, 32), lr=1e-3),
    DemoModel("gated_deltanet", {"layer_pattern": "LL", "memory": "gated_deltanet"}, steps=1200, warmup=30),
    DemoModel("gla", {"layer_pattern": "LL", "memory": "gla"}),
    DemoModel("linear_attention", {"layer_pattern": "LL", "memory": "linear_attention"}),
    DemoModel("hybrid gdn+swa", {"layer_pattern": "LN", "memory": "gated_deltanet", "attention": "swa",
                                 "options.mixer.window": 16}),
]
WIDTHS = (64, 32)
TRAIN_SETTINGS = [[64, 4], [64, 8], [64, 16]]
EVAL_SETTINGS = TRAIN_SETTINGS
#: relative CPU time of one training step per unit of width (measured on 2 cores), to start the slow runs first
STEP_COST = {"gla": 3.0, "gated_deltanet": 2.3, "hybrid gdn+swa": 1.4, "attention": 0.9, "linear_attention": 0.9}
MQAR_VOCAB = 64
TEXT_STEPS = 400


def _overrides(prefix: str, values: dict[str, Any]) -> list[str]:
    return [f"{prefix}.{key}={value}" for key, value in values.items()]


def _log_every(quick: bool) -> int:
    """Steps between metric lines: every step of the short --quick runs, so each loss curve has points."""
    return 1 if quick else 10


def _mqar_overrides(steps: int, quick: bool, warmup: int = 50) -> list[str]:
    """The MQAR data, optimiser and run settings every demo model shares."""
    return [
        "data.task=mqar", f"data.mqar.settings={TRAIN_SETTINGS}", f"data.mqar.eval_settings={EVAL_SETTINGS}",
        f"data.mqar.vocab_size={MQAR_VOCAB}", f"data.mqar.train_examples={500 if quick else 20000}",
        f"data.mqar.eval_examples={64 if quick else 500}",
        "data.batch_size=64", f"schedule.steps={steps}", f"schedule.warmup_steps={min(warmup, steps)}",
        "optim.weight_decay=0.1", f"run.log_every={_log_every(quick)}", "run.save_every=0", "run.progress=false",
    ]


def _worker_setup(threads: int) -> None:
    """A worker's torch threads, and no per-file progress bars of transformers between the result lines."""
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()


@dataclass(frozen=True)
class MQARJob:
    """One MQAR training run of the study, as a worker process receives it."""

    model: str
    width: int
    steps: int
    run_dir: Path
    overrides: tuple[str, ...]
    threads: int  # torch threads of the worker


def train_mqar(job: MQARJob) -> tuple[dict[str, float], float]:
    """Run one job (in a worker process); return its final metrics and its seconds."""
    _worker_setup(job.threads)
    config = load_config(overrides=list(job.overrides))
    started = time.perf_counter()
    result = Trainer(config).train()
    return result.metrics, time.perf_counter() - started


def parallelism(jobs: int) -> tuple[int, int]:
    """(worker processes, torch threads each) for ``jobs`` independent small runs on this machine.

    Small models use a second thread poorly (1.5x faster on 2 cores), so the cores go to separate
    runs first: on 2 cores, two runs at once with one thread each get through the job ~1.3x sooner.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(jobs, cpus))
    return workers, max(1, cpus // workers)


def mqar_job(model: DemoModel, width: int, folder: Path, *, quick: bool, threads: int,
             extra: tuple[str, ...] = ()) -> MQARJob:
    """The run of ``model`` at ``width`` under ``folder``; a bad override raises here, not in a worker."""
    run_dir = folder / f"{model.name.replace(' ', '_').replace('+', '_')}-d{width}"
    steps = 10 if quick else model.steps
    overrides = (_mqar_overrides(steps, quick, model.warmup)
                 + _overrides("model", {**model.fields, "hidden_size": width})
                 + [f"optim.lr={model.lr}", f"run.out_dir={run_dir}", "run.resume=false", *extra])
    load_config(overrides=overrides)
    return MQARJob(model.name, width, steps, run_dir, tuple(overrides), threads)


def mqar_jobs(out: Path, *, quick: bool, threads: int) -> list[MQARJob]:
    """Every demo model at every width, in the order of the table."""
    return [mqar_job(model, width, out / "mqar", quick=quick, threads=threads)
            for width in WIDTHS for model in MQAR_MODELS if width in model.widths]


def _report(job: MQARJob, metrics: dict[str, float], seconds: float) -> list[dict]:
    """Print one finished run's line; return its rows of (model, width, seq_len, kv, accuracy)."""
    rows = [{"model": job.model, "width": job.width, "seq_len": s, "kv": k, "accuracy": metrics[f"mqar_acc/L{s}_kv{k}"]}
            for s, k in map(tuple, EVAL_SETTINGS)]
    accs = "  ".join(f"{r['accuracy']:.3f}" for r in rows)
    print(f"  {job.model:<28} d={job.width:<4} {seconds:6.1f} s   accuracy {accs}", flush=True)
    return rows


def mqar_study(out: Path, pool: Executor, jobs: list[MQARJob],
               others: Optional[dict[Future, Callable[[Any], None]]] = None) -> list[dict]:
    """Train the jobs on the pool (the slowest first), print each result as it comes, write the
    plots; return rows of (model, width, seq_len, kv, accuracy) in the order of ``jobs``.

    ``others``: futures already on the pool, each with what to do with its result when it comes
    (between the MQAR results, in the order they finish)."""
    order = sorted(jobs, key=lambda j: -STEP_COST.get(j.model, 1.0) * j.width * j.steps)
    futures = {pool.submit(train_mqar, job): job for job in order}
    others = others or {}
    rows_of = {}
    for future in as_completed([*futures, *others]):
        if future in others:
            others[future](future.result())
            continue
        job = futures[future]
        rows_of[job] = _report(job, *future.result())
    rows = [row for job in jobs for row in rows_of[job]]
    plot_loss_curves({f"{job.model} d={job.width}": job.run_dir / "metrics.jsonl" for job in jobs},
                     out / "mqar_loss.png", title="MQAR training loss")
    plot_mqar_accuracy(rows, out / "mqar_accuracy.png")
    return rows


MOM_MODELS = [
    DemoModel("gated_deltanet", {"layer_pattern": "LL", "memory": "gated_deltanet"}),
    DemoModel("mom gated_deltanet 4x top-2", {"layer_pattern": "LL", "memory": "mom",
                                             "options.mom.memory": "gated_deltanet",
                                             "options.mom.num_memories": 4, "options.mom.top_k": 2}),
]


def mom_study(out: Path, *, device: str = "auto", width: int = 64, quick: bool = False) -> list[dict]:
    """MoM (Gated DeltaNet memories, 4 memories, top-2, shared) against one Gated DeltaNet memory
    of the same width, on the demo's MQAR settings; returns rows of (model, width, kv, accuracy)."""
    jobs = [mqar_job(model, width, out / "mom", quick=quick, threads=torch.get_num_threads(),
                     extra=(f"run.device={device}",)) for model in MOM_MODELS]
    return [row for job in jobs for row in _report(job, *train_mqar(job))]


def print_table(rows: list[dict]) -> None:
    """One line per (model, width), one column per evaluated (seq_len, kv) setting."""
    header = "".join(f"  L={s} kv={k}".rjust(14) for s, k in EVAL_SETTINGS)
    print(f"\nMQAR recall accuracy (trained on {TRAIN_SETTINGS}, vocab {MQAR_VOCAB}, held-out examples)")
    print(f"{'model':<30}{'width':>6}{header}")
    for name, width in dict.fromkeys((r["model"], r["width"]) for r in rows):
        accs = [r["accuracy"] for r in rows if r["model"] == name and r["width"] == width]
        print(f"{name:<30}{width:>6}" + "".join(f"{a:>14.3f}" for a in accs))


def text_run(out: Path, *, quick: bool, threads: Optional[int] = None) -> list[str]:
    """A small hybrid on bytes of the Python standard library; returns the lines to print
    (data, size, held-out perplexity and a sample). ``threads``: torch threads (a worker's)."""
    if threads is not None:
        _worker_setup(threads)
    run_dir = out / "text-hybrid"
    config = load_config(overrides=[
        "data.task=text", "data.tokens_per_batch=2048", "data.max_document_tokens=256",
        f"data.text.max_files={10 if quick else 400}",
        "model.layer_pattern=LLN", "model.memory=gated_deltanet", "model.attention=softmax",
        "model.hidden_size=96", "model.num_heads=2",
        f"schedule.steps={10 if quick else TEXT_STEPS}", "schedule.warmup_steps=10", "optim.lr=3e-3",
        f"run.log_every={_log_every(quick)}", f"run.save_every={0 if quick else 200}", "run.progress=false",
        f"run.out_dir={run_dir}", "run.resume=false",
    ])
    started = time.perf_counter()
    trainer = Trainer(config)
    lines = [f"{trainer.task.describe()}; model {trainer.parameter_count() / 1e6:.2f}M parameters"]
    result = trainer.train()
    lines.append(f"  {result.steps} steps in {time.perf_counter() - started:.0f} s; held-out byte perplexity "
                 f"{result.metrics['val_ppl']:.2f}")
    sample = load_run(run_dir).generate("def ", max_new_tokens=160, temperature=0.7, seed=0)
    lines.append("  sample:\n" + "\n".join("    | " + line for line in sample.splitlines()))
    return lines


def _print_text(lines: list[str]) -> None:
    print("  " + "\n".join(lines), flush=True)


def run_demo(out: Path, *, quick: bool = False) -> None:
    """The whole default job; everything it writes goes under ``out``.

    The MQAR runs and the text run are independent, so they share a pool of worker processes
    (:func:`parallelism`); each result is printed as its run finishes, the table when all MQAR runs
    are in.
    """
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = sum(len(m.widths) for m in MQAR_MODELS)
    workers, threads = parallelism(runs + 1)
    print(f"linmem demo: MQAR study ({len(MQAR_MODELS)} models, {runs} runs) and a text model, {workers} runs at "
          f"a time ({threads} thread{'s' if threads > 1 else ''} each); output in {out}", flush=True)
    jobs = mqar_jobs(out, quick=quick, threads=threads)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        text = pool.submit(text_run, out, quick=quick, threads=threads)  # the longest run: first
        try:
            rows = mqar_study(out, pool, jobs, others={text: _print_text})
        except KeyboardInterrupt:  # Ctrl-C: the runs under way stop after their step, no new one starts
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        print_table(rows)
        print(f"plots: {out / 'mqar_accuracy.png'}, {out / 'mqar_loss.png'}", flush=True)
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
