"""PNG plots of runs: loss curves, MQAR accuracy against kv pairs and model width, and evaluations over seeds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import matplotlib

from ..train.metrics import read_metrics

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from .seeds import RunEvals

__all__ = ["plot_loss_curves", "plot_mqar_accuracy", "plot_seed_curves", "read_metrics"]


def plot_loss_curves(runs: dict[str, Path], out: Path, *, title: str = "training loss") -> Path:
    """One curve of training loss per run (name -> metrics.jsonl)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, path in runs.items():
        rows = [r for r in read_metrics(path) if "loss" in r]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name)
    ax.set(xlabel="step", ylabel="loss", title=title, yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_mqar_accuracy(rows: Sequence[dict], out: Path) -> Path:
    """Accuracy vs kv pairs (left) and vs model width at the largest kv setting (right).

    ``rows``: dicts with keys model, width, kv, accuracy.
    """
    models = sorted({r["model"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    fig, (by_kv, by_width) = plt.subplots(1, 2, figsize=(11, 4))
    for model in models:
        for width in widths:
            mine = sorted((r["kv"], r["accuracy"]) for r in rows if r["model"] == model and r["width"] == width)
            if mine:
                by_kv.plot(*zip(*mine), marker="o", label=f"{model} d={width}")
        hardest = max(r["kv"] for r in rows)
        mine = sorted((r["width"], r["accuracy"]) for r in rows if r["model"] == model and r["kv"] == hardest)
        by_width.plot(*zip(*mine), marker="o", label=model)
    by_kv.set(xlabel="kv pairs", ylabel="recall accuracy", title="MQAR accuracy vs kv pairs", xscale="log",
              ylim=(0, 1.02))
    by_width.set(xlabel="model width", ylabel="recall accuracy", ylim=(0, 1.02),
                 title=f"MQAR accuracy vs width (kv = {max(r['kv'] for r in rows)})")
    kvs = sorted({r["kv"] for r in rows})
    by_kv.set_xticks(kvs, [str(kv) for kv in kvs])
    by_kv.minorticks_off()
    by_width.set_xticks(widths)
    for ax in (by_kv, by_width):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_seed_curves(runs: Sequence["RunEvals"], out: Path) -> Path:
    """One panel per evaluation metric against the step: per recipe the mean over its seeds at the steps all of
    them evaluated, and the band between their min and max (:mod:`linmem.eval.seeds`)."""
    from .seeds import metric_order

    metrics = sorted({m for r in runs for v in r.evals.values() for m in v}, key=metric_order)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for recipe in dict.fromkeys(r.recipe for r in runs):
            mine = [r for r in runs if r.recipe == recipe and r.evals]
            steps = sorted(set.intersection(*(set(s for s, v in r.evals.items() if metric in v) for r in mine))) \
                if mine else []
            if not steps:
                continue
            values = [[r.evals[s][metric] for r in mine] for s in steps]
            line, = ax.plot(steps, [sum(v) / len(v) for v in values], label=f"{recipe} ({len(mine)})")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                            alpha=0.2)
        ax.set(xlabel="step", ylabel=metric.split("/")[0], title=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
