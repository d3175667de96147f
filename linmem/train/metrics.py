"""A run's metrics: ``metrics.jsonl`` (one JSON object per line, ``step`` first) and TensorBoard.

A line cut short by a crash or a full disk is dropped with a warning when the file is read
(it can only be the last one: lines are appended whole).

Example:
    >>> rows = read_metrics(Path("runs/demo/text-hybrid/metrics.jsonl"))  # doctest: +SKIP
    >>> [r["loss"] for r in rows if "loss" in r][:3]  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger("linmem.train")


class MetricsError(ValueError):
    """A metrics file damaged before its last line."""


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a torn last line is dropped with a warning."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                logger.warning("%s: dropped its torn last line (%d characters; the run stopped while writing it)",
                               path, len(line))
                continue
            raise MetricsError(f"{path} line {number} is not valid JSON ({err.msg}); remove or repair it") from err
    return rows


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when installed and enabled)."""

    def __init__(self, out_dir: Path, tensorboard: bool) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (left by a run that stopped after its last checkpoint)
        and a torn last line; the file is replaced atomically."""
        if not self.path.exists():
            return
        kept = [row for row in read_metrics(self.path) if row["step"] <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)

    def write(self, step: int, values: dict[str, float | str]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.writer is not None:
            for name, value in values.items():
                if not isinstance(value, str):  # a label such as the step's mode goes to metrics.jsonl only
                    self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
