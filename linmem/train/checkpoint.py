"""Atomic, verified checkpoints.

A checkpoint is a folder ``step_XXXXXXXX`` holding the model (safetensors), the
optimiser state and RNG states (``torch.load(weights_only=True)``: nothing is
unpickled), the trainer state (JSON) and a manifest of sizes and SHA-256 sums written
last. It is written under a temporary name (``.step_XXXXXXXX.tmp-PID``) and renamed into
place, so a crash leaves either the whole checkpoint or none (the temporary folders of
processes that died are removed by the next save or resume); loading verifies the
manifest first (exactly the expected files, sizes and sums), so a truncated or corrupted
checkpoint is refused with an error that names the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_model, save_model

logger = logging.getLogger("linmem.train")

MANIFEST = "manifest.json"
PREFIX = "step_"
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json")  # what the manifest lists


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, truncated or corrupted."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict[str, Any],
    rng_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` into ``directory`` atomically; keep the newest ``keep``."""
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    final = directory / f"{PREFIX}{step:08d}"
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state, tmp / "rng.pt")
    state = {**trainer_state, "step": step, "scheduler": scheduler.state_dict()}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    files = sorted(p for p in tmp.iterdir())
    for path in files:
        _fsync(path)
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(directory)
    _prune(directory, keep)
    return final


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove ``.step_*.tmp-PID`` folders of processes no longer running (a kill during a save); returns them."""
    removed = []
    if not directory.is_dir():
        return removed
    for path in directory.glob(f".{PREFIX}*.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by process %s that stopped during a save", path, pid)
            removed.append(path)
    return removed


def _prune(directory: Path, keep: int) -> None:
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders in ``directory``, oldest first (unverified)."""
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file of the manifest is present and intact."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupted ({err})") from err
    if not isinstance(manifest, dict) or set(manifest) != set(FILES):
        listed = sorted(manifest) if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists {listed}, expected {sorted(FILES)}")
    for name, entry in manifest.items():
        file = path / name
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(
                entry.get("sha256"), str):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} entry of {name} is corrupted")
        if not file.exists():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} is truncated ({size} of {entry['bytes']} bytes)")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} is corrupted (SHA-256 mismatch)")


def latest_valid_checkpoint(directory: Path) -> Optional[Path]:
    """The newest checkpoint that verifies; invalid newer ones are reported and left in place.

    None when there is no checkpoint; a CheckpointError listing each checkpoint and why it
    failed when there are checkpoints but none verifies.
    """
    failures = []
    for path in reversed(list_checkpoints(directory)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as err:
            logger.warning("skipping %s", err)
            failures.append(str(err))
    if failures:
        raise CheckpointError(f"no checkpoint in {directory} verifies: {'; '.join(failures)}")
    return None


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify, then restore; returns (trainer_state, rng_state)."""
    verify_checkpoint(path)
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")
    state = json.loads((path / "trainer_state.json").read_text())
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = torch.load(path / "rng.pt", weights_only=True)
    return state, rng
