"""Atomic, verified checkpoints.

A checkpoint is a folder ``step_XXXXXXXX`` of one of two kinds:

* one process: the model (``model.safetensors``) and the optimiser state (``optimizer.pt``);
* several ranks (torchrun): every rank's shards of the model and the optimiser, written by
  ``torch.distributed.checkpoint`` (``.metadata`` and one ``__R_0.distcp`` per rank), recorded by
  their global shapes;

and in both the RNG states (``rng.pt``; ``torch.load(weights_only=True)``: nothing is unpickled),
the trainer state (JSON) and a manifest of sizes and SHA-256 sums written last. Either kind loads
into a run on any number of ranks: shards reshard, and one process's files are sharded on load.
A checkpoint is written under a temporary name (``.step_XXXXXXXX.tmp-PID``) and renamed into
place, so a crash leaves either the whole checkpoint or none (the temporary folders of processes
that died are removed by the next save or resume); loading verifies the manifest first (exactly
the expected files, sizes and sums), so a truncated or corrupted checkpoint is refused with an
error that names the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, load_model, save_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ..distributed import read_shards

logger = logging.getLogger("linmem.train")

MANIFEST = "manifest.json"
PREFIX = "step_"
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json")  # what the manifest lists
SHARDED_FILES = (".metadata", "rng.pt", "trainer_state.json")  # ... of several ranks, beside the shard files
SHARD = re.compile(r"__\d+_\d+\.distcp")  # one rank's shard file (DCP's name)


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
    """Write checkpoint ``step`` of one process into ``directory`` atomically; keep the newest ``keep``."""
    tmp = begin_checkpoint(directory, step)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    return finish_checkpoint(tmp, step, scheduler=scheduler, trainer_state=trainer_state, rng_state=rng_state,
                             keep=keep)


def begin_checkpoint(directory: Path, step: int) -> Path:
    """The empty temporary folder that checkpoint ``step`` is written into (stale ones removed first).

    Under torchrun rank 0 makes it and every rank writes its shards there
    (:func:`linmem.distributed.write_shards`); then rank 0 calls :func:`finish_checkpoint`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    tmp = directory / f".{PREFIX}{step:08d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def finish_checkpoint(
    tmp: Path,
    step: int,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict[str, Any],
    rng_state: dict[str, Any],
    keep: int,
) -> Path:
    """Add the RNG and trainer states and the manifest to the weights in ``tmp``, rename it to
    ``step_XXXXXXXX`` and keep the newest ``keep`` checkpoints; returns the final path."""
    torch.save(rng_state, tmp / "rng.pt")
    state = {**trainer_state, "step": step, "scheduler": scheduler.state_dict()}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    files = sorted(p for p in tmp.iterdir())
    for path in files:
        _fsync(path)
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    directory = tmp.parent
    final = directory / f"{PREFIX}{step:08d}"
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
    if not isinstance(manifest, dict) or not _expected_files(manifest):
        listed = sorted(manifest) if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists {listed}, expected {sorted(FILES)} (one "
                              f"process) or {sorted(SHARDED_FILES)} and the ranks' __R_0.distcp (several)")
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


def _expected_files(manifest: dict) -> bool:
    """Whether ``manifest`` lists exactly the files of one kind of checkpoint."""
    names = set(manifest)
    if names == set(FILES):
        return True
    shards = {name for name in names if SHARD.fullmatch(name)}
    return bool(shards) and names - shards == set(SHARDED_FILES)


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at ``path`` was written by several ranks (DCP shards)."""
    return (path / ".metadata").exists()


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
    verify: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify (unless ``verify`` is off: the caller did), then restore; returns (trainer_state, rng_state).

    ``model`` may be a plain model or one parallelised for any number of ranks (then every rank
    calls this), whichever kind of checkpoint ``path`` is.
    """
    if verify:
        verify_checkpoint(path)
    if is_sharded(path):
        read_shards(path, model, optimizer)
    elif any(isinstance(p, DTensor) for p in model.parameters()):
        _load_whole_into_shards(path, model, optimizer)
    else:
        try:
            missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        except RuntimeError as err:  # a parameter of another shape
            raise CheckpointError(f"checkpoint {path} does not fit the model: {' '.join(str(err).split())}") from err
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing}, "
                                  f"unexpected {unexpected}")
        if optimizer is not None:
            optimizer.load_state_dict(_torch_load(path / "optimizer.pt", map_location="cpu"))
    state = json.loads((path / "trainer_state.json").read_text())
    if scheduler is not None:
        scheduler.load_state_dict(_fit_groups(state["scheduler"], len(scheduler.optimizer.param_groups), path))
    rng = _torch_load(path / "rng.pt")
    return state, rng


def _torch_load(file: Path, **kwargs: Any) -> Any:
    """``torch.load`` with weights only; a file it refuses (a pickle of arbitrary objects) is a CheckpointError."""
    try:
        return torch.load(file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint file {file} holds objects a weights-only load refuses: "
                              f"{str(err).splitlines()[0]}") from err


def _fit_groups(scheduler_state: dict[str, Any], groups: int, path: Path) -> dict[str, Any]:
    """A scheduler state for ``groups`` optimiser groups. The trainer's groups share one learning rate and
    differ in number between layouts (split by device mesh under expert parallelism), so the per-group
    lists of a checkpoint with other groups hold one value, repeated here."""
    fitted = dict(scheduler_state)
    for key, values in scheduler_state.items():
        if isinstance(values, list) and len(values) != groups:
            if any(value != values[0] for value in values):
                raise CheckpointError(f"checkpoint {path}: its {len(values)} optimiser groups have different "
                                      f"scheduler values {key} = {values}; this run has {groups} groups")
            fitted[key] = values[:1] * groups
    return fitted


def _load_whole_into_shards(path: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """A one-process checkpoint into a parallelised model: every rank reads the whole files and keeps its shards.

    The optimiser state of one process is keyed by the parameters' places in its groups, which the
    trainer fills in the order of :func:`optimizer_order`; here it is keyed by name.
    """
    weights = load_file(str(path / "model.safetensors"))
    missing = [name for name in model.state_dict() if name not in weights]
    if missing != ["lm_head.weight"] * len(missing) or (missing and not model.config.tie_word_embeddings):
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing}")
    for name in missing:  # a tied head is stored once, as the embedding
        weights[name] = weights["model.embed_tokens.weight"]
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(model, weights, options=options)
        return
    saved = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    name_of = dict(enumerate(optimizer_order(model)))
    groups = [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]]
    state = {name_of[i]: value for i, value in saved["state"].items()}
    set_state_dict(model, optimizer, model_state_dict=weights,
                   optim_state_dict={"state": state, "param_groups": groups}, options=options)


def weight_decayed(name: str, parameter: torch.nn.Parameter) -> bool:
    """Whether AdamW decays ``parameter``: matrices, not norms, biases or embeddings (stacked per-memory
    biases of MoM are 2-D)."""
    return parameter.dim() >= 2 and not name.endswith("bias") and "embed" not in name


def optimizer_order(model: torch.nn.Module) -> list[str]:
    """The trained parameters' names in the order of a one-process run's optimiser: decayed ones first."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [name for decayed in (True, False) for name, p in named if weight_decayed(name, p) == decayed]
