"""PNG plots of runs: loss curves, and MQAR accuracy against kv pairs and model width."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

from ..train.metrics import read_metrics

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_loss_curves", "plot_mqar_accuracy", "read_metrics"]


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
