"""A run directory: what it holds, who may write it, and whether a config may continue it.

Layout (``run.out_dir``)::

    config.yaml       the config of the run (rewritten on resume: only RESUMABLE_KEYS may change)
    metrics.jsonl     one JSON line per logged step and evaluation
    checkpoints/      step_XXXXXXXX folders (linmem.train.checkpoint)
    model/            the latest weights (+ tokenizer), loadable with from_pretrained
    finished.json     written last: the final step and evaluation of a finished run
    tensorboard/      events, when tensorboard is installed and run.tensorboard is on
    .lock             the PID of the process training in it (held with flock while it runs)

Example:
    >>> with RunLock(Path("runs/x")):  # doctest: +SKIP
    ...     finished = check_run_directory(config)
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from .checkpoint import process_alive, list_checkpoints
from .config import RESUMABLE_KEYS, ConfigError, TrainConfig, config_differences, read_config_file

logger = logging.getLogger("linmem.train")

CONFIG = "config.yaml"
FINISHED = "finished.json"
LOCK = ".lock"
#: What a run writes into its directory (removed when a run starts over with run.resume=false).
RUN_OUTPUTS = (CONFIG, "metrics.jsonl", "checkpoints", "model", FINISHED, "tensorboard")


class RunError(RuntimeError):
    """A run directory that this run may not use as asked (in use, or holding another run)."""


class RunLock:
    """Exclusive use of a run directory by one process: ``.lock`` holds its PID under ``flock``.

    The kernel drops the lock when the process dies, so the lock of a crashed run is taken
    over (with a warning naming the PID it left); a live holder is refused by PID.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.path = Path(out_dir), Path(out_dir) / LOCK
        self.fd: Optional[int] = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock (RunError naming the holder's PID when a live process holds it)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunError(f"{self.out_dir} is in use by another linmem run (PID {holder}); "
                           f"wait for it to end or choose another run.out_dir") from None
        previous = os.read(fd, 64).decode(errors="replace").strip()
        if previous.isdigit() and int(previous) != os.getpid() and not process_alive(int(previous)):
            logger.warning("%s: taking over the lock left by process %s, which is no longer running",
                           self.out_dir, previous)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Give the lock back (nothing when not held)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def finished_record(out_dir: Path) -> Optional[dict[str, Any]]:
    """``{"step", "metrics"}`` of a finished run, None if the run has not finished."""
    path = Path(out_dir) / FINISHED
    return json.loads(path.read_text()) if path.exists() else None


def check_run_directory(config: TrainConfig) -> Optional[dict[str, Any]]:
    """Read-only check of ``run.out_dir`` before a run touches it.

    With ``run.resume`` on and a run there (a checkpoint or a finished record), the config
    must equal the saved config.yaml except for :data:`RESUMABLE_KEYS`; otherwise a RunError
    lists the differing keys. Returns the finished record when the run already reached
    ``schedule.steps`` (nothing to do), else None.
    """
    out_dir = Path(config.run.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"run.out_dir {out_dir} is a file, not a folder: choose another run.out_dir")
    if not config.run.resume or not (out_dir / CONFIG).exists():
        return None
    finished = finished_record(out_dir)
    if finished is None and not list_checkpoints(out_dir / "checkpoints"):
        return None  # nothing to continue: the run starts from step 0
    try:
        saved = read_config_file(out_dir / CONFIG)
    except ConfigError as err:
        raise RunError(f"{err}: the run cannot be continued; repair the file, or set run.resume=false to start "
                       f"over (removes its checkpoints and metrics)") from err
    differences = config_differences(saved, config)
    if differences:
        raise RunError(f"{out_dir} holds a run with another config: {'; '.join(differences)}. Only "
                       f"{', '.join(RESUMABLE_KEYS)} may change on resume: choose another run.out_dir, "
                       f"or set run.resume=false to start over (removes its checkpoints and metrics)")
    if finished is not None and finished["step"] >= config.schedule.steps:
        return finished
    return None


def start_over(out_dir: Path) -> None:
    """Remove what an earlier run wrote into ``out_dir`` (run.resume=false); other files stay."""
    removed = []
    for name in RUN_OUTPUTS:
        path = Path(out_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    if removed:
        logger.info("run.resume=false: removed %s of the earlier run in %s", ", ".join(removed), out_dir)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def mark_finished(out_dir: Path, step: int, metrics: dict[str, float]) -> None:
    write_atomically(Path(out_dir) / FINISHED, json.dumps({"step": step, "metrics": metrics}, indent=1))
