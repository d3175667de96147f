"""Result tables of the studies: rows of dicts as CSV and as a Markdown table."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence


def _cell(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def write_table(rows: Sequence[dict], path: Path) -> tuple[Path, Path]:
    """Write ``rows`` (dicts with the same keys) to ``path`` with suffixes .csv and .md; returns both paths.

    Example:
        >>> import tempfile
        >>> csv_path, md_path = write_table([{"n": 1, "loss": 0.5}], Path(tempfile.mkdtemp()) / "t")
        >>> md_path.read_text().splitlines()[2]
        '| 1 | 0.5 |'
    """
    if not rows:
        raise ValueError("write_table: no rows to write")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0])
    csv_path, md_path = path.with_suffix(".csv"), path.with_suffix(".md")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row[key]) for key in keys) + " |" for row in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path
