"""The built-in default job (``linmem demo``): a small memory study on one CPU.

1. MQAR: softmax attention, Gated DeltaNet, GLA, linear attention and a hybrid at
   width 64 (attention and Gated DeltaNet also at width 32), trained on a mix of kv-pair counts at sequence length 64 (more
   queries per example = more signal per step on a CPU); prints the recall table and
   writes ``mqar_accuracy.png`` and ``mqar_loss.png``. The vocabulary is 64 tokens
   instead of Zoology's 8192 so that small models learn it in minutes.
2. Text: a small hybrid (Gated DeltaNet + softmax attention) trained on bytes of the
   Python standard library's sources; prints held-out perplexity and a sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .eval.plots import plot_loss_curves, plot_mqar_accuracy
from .train import Trainer, load_config
from .train.runs import load_run
from .train.tasks import MQARTask


@dataclass(frozen=True)
class DemoModel:
    name: str
    fields: dict[str, Any] = field(default_factory=dict)  # model.* overrides
    widths: tuple[int, ...] = (64,)  # model widths trained
    lr: float = 2e-3  # peak learning rate (tuned per model, as Zoology sweeps it)


MQAR_MODELS = [
    DemoModel("attention", {"layer_pattern": "NN", "attention": "softmax"}, widths=(64, 32), lr=1e-3),
    DemoModel("gated_deltanet", {"layer_pattern": "LL", "memory": "gated_deltanet"}, widths=(64, 32)),
    DemoModel("gla", {"layer_pattern": "LL", "memory": "gla"}),
    DemoModel("linear_attention", {"layer_pattern": "LL", "memory": "linear_attention"}),
    DemoModel("hybrid gdn+swa", {"layer_pattern": "LN", "memory": "gated_deltanet", "attention": "swa",
                                 "options.window": 16}),
]
WIDTHS = (64, 32)
TRAIN_SETTINGS = [[64, 4], [64, 8], [64, 16]]
EVAL_SETTINGS = TRAIN_SETTINGS
MQAR_STEPS = 1000
MQAR_VOCAB = 64
TEXT_STEPS = 400


def _overrides(prefix: str, values: dict[str, Any]) -> list[str]:
    return [f"{prefix}.{key}={value}" for key, value in values.items()]


def _mqar_overrides(steps: int, quick: bool) -> list[str]:
    """The MQAR data, optimiser and run settings every demo model shares."""
    return [
        "data.task=mqar", f"data.mqar.settings={TRAIN_SETTINGS}", f"data.mqar.eval_settings={EVAL_SETTINGS}",
        f"data.mqar.vocab_size={MQAR_VOCAB}", f"data.mqar.train_examples={500 if quick else 20000}",
        f"data.mqar.eval_examples={64 if quick else 500}",
        "data.batch_size=64", f"schedule.steps={steps}", "schedule.warmup_steps=50", "optim.weight_decay=0.1", "run.log_every=10", "run.save_every=0", "run.progress=false",
    ]


def mqar_study(out: Path, *, quick: bool) -> list[dict]:
    """Train every demo model at every width; return rows of (model, width, kv, accuracy)."""
    steps = 10 if quick else MQAR_STEPS
    base = _mqar_overrides(steps, quick)
    task = None
    rows, curves = [], {}
    for width in WIDTHS:
        for model in (m for m in MQAR_MODELS if width in m.widths):
            run_dir = out / "mqar" / f"{model.name.replace(' ', '_').replace('+', '_')}-d{width}"
            config = load_config(overrides=base + _overrides("model", {**model.fields, "hidden_size": width})
                                 + [f"optim.lr={model.lr}", f"run.out_dir={run_dir}", "run.resume=false"])
            if task is None:
                task = MQARTask(config.data)
            started = time.perf_counter()
            result = Trainer(config, task=task).train()
            seconds = time.perf_counter() - started
            for (seq_len, kv) in map(tuple, EVAL_SETTINGS):
                rows.append({"model": model.name, "width": width, "seq_len": seq_len, "kv": kv,
                             "accuracy": result.metrics[f"mqar_acc/L{seq_len}_kv{kv}"]})
            curves[f"{model.name} d={width}"] = run_dir / "metrics.jsonl"
            accs = "  ".join(f"{r['accuracy']:.3f}" for r in rows[-len(EVAL_SETTINGS):])
            print(f"  {model.name:<18} d={width:<4} {seconds:6.1f} s   accuracy {accs}", flush=True)
    plot_loss_curves(curves, out / "mqar_loss.png", title="MQAR training loss")
    plot_mqar_accuracy(rows, out / "mqar_accuracy.png")
    return rows


MOM_MODELS = [
    DemoModel("gated_deltanet", {"layer_pattern": "LL", "memory": "gated_deltanet"}),
    DemoModel("mom gated_deltanet 4x top-2", {"layer_pattern": "LL", "memory": "mom",
                                             "options.mom_memory": "gated_deltanet", "options.num_memories": 4,
                                             "options.mom_top_k": 2}),
]


def mom_study(out: Path, *, device: str = "auto", width: int = 64, quick: bool = False) -> list[dict]:
    """MoM (Gated DeltaNet memories, 4 memories, top-2, shared) against one Gated DeltaNet memory
    of the same width, on the demo's MQAR settings; returns rows of (model, width, kv, accuracy)."""
    steps = 10 if quick else MQAR_STEPS
    rows = []
    for model in MOM_MODELS:
        run_dir = out / "mom" / f"{model.name.replace(' ', '_')}-d{width}"
        config = load_config(overrides=_mqar_overrides(steps, quick)
                             + _overrides("model", {**model.fields, "hidden_size": width})
                             + [f"optim.lr={model.lr}", f"run.out_dir={run_dir}", "run.resume=false",
                                f"run.device={device}"])
        started = time.perf_counter()
        result = Trainer(config).train()
        for seq_len, kv in map(tuple, EVAL_SETTINGS):
            rows.append({"model": model.name, "width": width, "seq_len": seq_len, "kv": kv,
                         "accuracy": result.metrics[f"mqar_acc/L{seq_len}_kv{kv}"]})
        accs = "  ".join(f"{r['accuracy']:.3f}" for r in rows[-len(EVAL_SETTINGS):])
        print(f"  {model.name:<28} {time.perf_counter() - started:6.1f} s   accuracy {accs}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    """One line per (model, width), one column per evaluated (seq_len, kv) setting."""
    header = "".join(f"  L={s} kv={k}".rjust(14) for s, k in EVAL_SETTINGS)
    print(f"\nMQAR recall accuracy (trained on {TRAIN_SETTINGS}, vocab {MQAR_VOCAB}, held-out examples)")
    print(f"{'model':<30}{'width':>6}{header}")
    for name, width in dict.fromkeys((r["model"], r["width"]) for r in rows):
        accs = [r["accuracy"] for r in rows if r["model"] == name and r["width"] == width]
        print(f"{name:<30}{width:>6}" + "".join(f"{a:>14.3f}" for a in accs))


def text_run(out: Path, *, quick: bool) -> None:
    """A small hybrid on bytes of the Python standard library; perplexity and a sample."""
    run_dir = out / "text-hybrid"
    config = load_config(overrides=[
        "data.task=text", "data.tokens_per_batch=2048", "data.max_document_tokens=256",
        f"data.text.max_files={10 if quick else 400}",
        "model.layer_pattern=LLN", "model.memory=gated_deltanet", "model.attention=softmax",
        "model.hidden_size=96", "model.num_heads=2",
        f"schedule.steps={10 if quick else TEXT_STEPS}", "schedule.warmup_steps=10", "optim.lr=3e-3",
        "run.log_every=10", f"run.save_every={0 if quick else 200}", "run.progress=false",
        f"run.out_dir={run_dir}", "run.resume=false",
    ])
    started = time.perf_counter()
    trainer = Trainer(config)
    print(f"\n{trainer.task.describe()}; model {trainer.parameter_count() / 1e6:.2f}M parameters")
    result = trainer.train()
    print(f"  {result.steps} steps in {time.perf_counter() - started:.0f} s; held-out byte perplexity "
          f"{result.metrics['val_ppl']:.2f}")
    run = load_run(run_dir)
    sample = run.generate("def ", max_new_tokens=160, temperature=0.7, seed=0)
    print("  sample:\n" + "\n".join("    | " + line for line in sample.splitlines()))


def run_demo(out: Path, *, quick: bool = False) -> None:
    """The whole default job; everything it writes goes under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    started = time.perf_counter()
    runs = sum(len(m.widths) for m in MQAR_MODELS)
    print(f"linmem demo: MQAR study ({len(MQAR_MODELS)} models, {runs} runs), then a text model; output in {out}")
    rows = mqar_study(out, quick=quick)
    print_table(rows)
    print(f"plots: {out / 'mqar_accuracy.png'}, {out / 'mqar_loss.png'}")
    text_run(out, quick=quick)
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
