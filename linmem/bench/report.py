"""What the model-level benchmarks write: the environment line, aligned text tables, Markdown tables
and the JSON file, rewritten after every cell so that a run cut short keeps what it measured.

Example:
    >>> print(text_table(["model", "2K"], [["fla gla", "126.0 (16.9)"]]))
    model    2K
    -------  ------------
    fla gla  126.0 (16.9)
    >>> length_label(32768), length_label(1000)
    ('32K', '1000')
"""

from __future__ import annotations

import datetime
import importlib
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch


def length_label(n: int) -> str:
    """32768 -> "32K"; lengths that are not a whole number of K stay as they are."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def environment(device: str) -> dict:
    """Date, device, versions (torch, triton, transformers, fla, flash-attn) and linmem's commit."""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": torch.cuda.get_device_name() if str(device).startswith("cuda") else "cpu",
           "torch": torch.__version__}
    for name in ("triton", "transformers", "fla", "flash_attn"):
        try:
            env[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except ImportError:
            env[name] = "not installed"
    try:
        env["linmem"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        env["linmem"] = "unknown"
    return env


def command_line(prog: str, argv: Optional[Sequence[str]]) -> str:
    """The command a bench was run with, as a result file records it (``argv`` None: this process's arguments).

    Example:
        >>> command_line("linmem bench models", ["--seq-lens", "2048,32768", "--peers"])
        'linmem bench models --seq-lens 2048,32768 --peers'
    """
    return " ".join([prog, shlex.join(sys.argv[1:] if argv is None else argv)]).strip()


def environment_line(env: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in env.items())


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, a dashed rule under the header."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` as indented JSON (through a temporary file, so a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(path)
