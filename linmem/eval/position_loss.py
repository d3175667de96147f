"""Held-out loss as a function of token position, up to and beyond the training length.

The measurement of the Forgetting Transformer paper (Lin et al. 2025, arXiv 2503.02130, Fig. 2):
windows of ``L`` consecutive tokens of held-out text go through the model in one pass; the loss
of the token at position ``t`` (predicted from the ``t`` tokens before it) is averaged over the
windows, then over position bins. A model that uses its context well has a loss that keeps
falling with the position; a model that cannot extrapolate has a loss that rises once ``t``
passes the length it was trained on.

Windows are cut from single documents, so that position ``t`` really has ``t`` tokens of the
same document before it: a document of ``n`` tokens gives ``n // (L + 1)`` disjoint windows (the
extra token is the last target). ``concat=True`` instead cuts windows from all documents joined
into one stream, for corpora of short documents.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from .inference import inference_mode, next_token_scores
from .tables import write_table

Document = Union[Sequence[int], torch.Tensor]


class PositionLossError(ValueError):
    """Documents or settings that cannot give a per-position loss."""


@dataclass
class PositionCurve:
    """Loss per position bin of windows of ``length`` tokens."""

    length: int  # tokens per window (positions 0 .. length - 1 are predicted)
    windows: int  # how many windows the averages are over
    bin_starts: list[int]  # first position of each bin
    bin_ends: list[int]  # one past the last position of each bin
    loss: list[float]  # mean loss (nats per token) of each bin
    mean_loss: float  # over every position of every window

    def loss_between(self, start: int, end: int) -> float:
        """Mean loss of the bins inside [start, end), weighted by their widths."""
        pairs = [(e - s, v) for s, e, v in zip(self.bin_starts, self.bin_ends, self.loss) if s >= start and e <= end]
        if not pairs:
            raise PositionLossError(f"no bin lies inside [{start}, {end}) of a curve of length {self.length}")
        width = sum(w for w, _ in pairs)
        return sum(w * v for w, v in pairs) / width


def window_tokens(documents: Sequence[Document], concat: bool) -> int:
    """The most tokens one window can span: the longest document's, or with ``concat`` all of them together.

    Example:
        >>> window_tokens([[1, 2, 3], [4, 5]], concat=False), window_tokens([[1, 2, 3], [4, 5]], concat=True)
        (3, 5)
    """
    lengths = [len(d) for d in documents]
    return sum(lengths) if concat else max(lengths, default=0)


def _windows(documents: Sequence[Document], length: int, max_windows: int, concat: bool) -> torch.Tensor:
    """[W, length + 1] token windows (see the module docstring)."""
    arrays = [np.asarray(d.tolist() if isinstance(d, torch.Tensor) else d, dtype=np.int64) for d in documents]
    if any(a.ndim != 1 for a in arrays):
        raise PositionLossError("documents must be 1-D sequences of token ids")
    span = length + 1
    if concat:
        stream = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
        found = [stream[i:i + span] for i in range(0, len(stream) - span + 1, span)]
    else:
        found = [a[i:i + span] for a in arrays for i in range(0, len(a) - span + 1, span)]
    if not found:
        raise PositionLossError(
            f"no window of {length} + 1 tokens: " + (f"the documents hold {window_tokens(arrays, True)} tokens"
                                                     if concat else
                                                     f"the longest document has {window_tokens(arrays, False)} tokens;"
                                                     " pass concat=True to cut windows across document boundaries"))
    return torch.from_numpy(np.stack(found[:max_windows]))


def position_loss(
    model: nn.Module,
    documents: Sequence[Document],
    *,
    lengths: Sequence[int],
    bins: int = 32,
    max_windows: int = 64,
    batch_size: int = 4,
    concat: bool = False,
    device: Optional[str] = None,
    progress: bool = True,
) -> list[PositionCurve]:
    """Per-position held-out loss of ``model`` for windows of each of ``lengths`` tokens.

    ``documents``: held-out token id sequences (e.g. a text run's validation documents).
    Positions 0 .. L - 1 of each window are predicted (position t from tokens 0 .. t) and grouped
    into ``bins`` equal bins (fewer when L < bins); at most ``max_windows`` windows per length.
    ``device`` moves the model there first. Returns one :class:`PositionCurve` per length.

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> model = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=16, num_heads=2, layer_pattern="L"))
        >>> docs = [torch.randint(0, 32, (100,)) for _ in range(3)]
        >>> curves = position_loss(model, docs, lengths=[16, 64], bins=4, progress=False)
        >>> [c.windows for c in curves], len(curves[1].loss)
        ([15, 3], 4)
    """
    if not lengths or any(int(n) < 2 for n in lengths):
        raise PositionLossError(f"lengths must be token counts >= 2, got {list(lengths)}")
    if bins < 1 or max_windows < 1 or batch_size < 1:
        raise PositionLossError(f"bins, max_windows and batch_size must be >= 1; got {bins}, {max_windows}, "
                                f"{batch_size}")
    if device is not None:
        model.to(device)
    from tqdm.auto import tqdm

    windows = {int(n): _windows(documents, int(n), max_windows, concat) for n in lengths}
    bar = tqdm(total=sum(len(w) for w in windows.values()), desc="position loss", unit="window",
               disable=not progress, dynamic_ncols=True)
    curves = []
    with inference_mode(model):
        for length, spans in windows.items():
            total = torch.zeros(length, dtype=torch.float64)
            for start in range(0, len(spans), batch_size):
                batch = spans[start:start + batch_size]
                inputs = batch[:, :-1]
                targets = batch[:, 1:]  # targets[:, t] follows inputs[:, :t + 1]
                logprob, _ = next_token_scores(model, inputs, targets)
                total += -logprob.double().sum(0).cpu()
                bar.update(len(batch))
            per_position = total / len(spans)
            edges = np.unique(np.linspace(0, length, min(bins, length) + 1).round().astype(int))
            loss = [float(per_position[s:e].mean()) for s, e in zip(edges[:-1], edges[1:])]
            curves.append(PositionCurve(length=length, windows=len(spans), bin_starts=edges[:-1].tolist(),
                                        bin_ends=edges[1:].tolist(), loss=loss,
                                        mean_loss=float(per_position.mean())))
    bar.close()
    return curves


def extrapolation_rows(curves: Sequence[PositionCurve], train_length: Optional[int] = None) -> list[dict]:
    """One row per window length: mean loss, perplexity, and (given ``train_length``) the loss before and past it.

    Example:
        >>> curve = PositionCurve(8, 1, [0, 4], [4, 8], [2.0, 1.0], 1.5)
        >>> extrapolation_rows([curve], train_length=4)[0]["loss_past_train"]
        1.0
    """
    rows = []
    for c in curves:
        row = {"length": c.length, "windows": c.windows, "loss": c.mean_loss, "ppl": math.exp(min(c.mean_loss, 50.0)),
               "loss_last_bin": c.loss[-1]}
        if train_length is not None:
            inside = [s for s, e in zip(c.bin_starts, c.bin_ends) if e <= train_length]
            past = [s for s in c.bin_starts if s >= train_length]
            row["loss_within_train"] = c.loss_between(0, train_length) if inside else float("nan")
            row["loss_past_train"] = c.loss_between(train_length, c.length) if past else float("nan")
        rows.append(row)
    return rows


def write_position_loss(curves: Sequence[PositionCurve], path: Union[str, Path],
                        train_length: Optional[int] = None) -> Path:
    """JSON of the curves and the extrapolation rows at ``path`` (.json), and the bins as a table (.csv/.md)."""
    path = Path(path).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"train_length": train_length, "curves": [asdict(c) for c in curves],
            "summary": extrapolation_rows(curves, train_length)}
    path.write_text(json.dumps(data, indent=2) + "\n")
    rows = [{"length": c.length, "bin_start": s, "bin_end": e, "loss": v}
            for c in curves for s, e, v in zip(c.bin_starts, c.bin_ends, c.loss)]
    write_table(rows, path.with_name(path.stem + "_bins"))
    return path


def plot_position_loss(
    runs: Mapping[str, Sequence[PositionCurve]], out: Union[str, Path], *, train_length: Optional[int] = None,
    title: str = "held-out loss by position",
) -> Path:
    """Loss against position, one curve per run (its longest window length); a dashed line at ``train_length``.

    Example:
        >>> runs = {"fox": fox_curves, "transformer": transformer_curves}  # doctest: +SKIP
        >>> plot_position_loss(runs, "pos.png", train_length=512)  # doctest: +SKIP
    """
    from .plots import plt

    if not runs:
        raise PositionLossError("runs is empty: nothing to plot")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, curves in runs.items():
        c = max(curves, key=lambda curve: curve.length)
        middles = [(s + e - 1) / 2 for s, e in zip(c.bin_starts, c.bin_ends)]
        ax.plot(middles, c.loss, marker=".", label=f"{name} (L={c.length})")
    if train_length is not None:
        ax.axvline(train_length, color="gray", linestyle="--", linewidth=1, label=f"training length {train_length}")
    ax.set(xlabel="token position", ylabel="loss (nats / token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
