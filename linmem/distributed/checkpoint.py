"""Checkpoints of parallel runs through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its shards of the model and the optimizer; DCP records them by their global
shapes, so a checkpoint loads on another number of ranks or another layout (resharding). The
trainer's own state (step, data position, RNG) is a JSON file that rank 0 writes beside them.
A checkpoint directory appears under its final name only once complete (written to a temporary
name, then renamed by rank 0 after every rank finished). :func:`export_pretrained` gathers the full
weights to rank 0 and writes a folder that ``from_pretrained`` loads on one device.

DCP records each rank's shard as one block of the global tensor. Under tensor parallelism a SwiGLU's
``[gate; up]`` weight is split by halves (``_StridedShard`` on the ``tp`` mesh dimension: rank r holds block r
of both halves, two blocks), so it and its optimizer state are written and read as plain blocks of the global
tensor (:func:`~linmem.distributed.tensor.halves_to_blocks` and back), and the files are those of any other layout;
:func:`export_pretrained` gathers them the same way.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .tensor import blocks_to_halves, full_tensor, halves_to_blocks

__all__ = ["save_distributed", "load_distributed", "write_shards", "read_shards", "export_pretrained"]

TRAINER_STATE = "trainer_state.json"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


#: The optimizer's state and its groups' settings keyed by parameter name ("param_groups.<name>.lr"), so that
#: a run whose groups differ (split by device mesh under expert parallelism, or not) loads them.
_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """The model's (and optimizer's) state keyed by parameter names, as this rank holds it (shards)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer, options=_BY_NAME)
    return {"model": model_state, "optim": optim_state}


def _blockwise(state: dict[str, Any]) -> dict[str, DTensor]:
    """The entries of a (flat) state dict split by halves over ``tp``, as plain blocks of the global tensor
    (:func:`~linmem.distributed.tensor.halves_to_blocks`)."""
    blocks = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            block = halves_to_blocks(value)
            if block is not value:
                blocks[name] = block
    return blocks


def write_shards(path: Union[str, Path], model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Every rank writes its shards of ``model`` (and ``optimizer``) into the folder ``path`` (DCP).

    The files record global shapes: :func:`read_shards` loads them on any number of ranks, or on
    one process without a process group.
    """
    state = _state(model, optimizer)
    dcp.save({part: {**values, **_blockwise(values)} for part, values in state.items()}, checkpoint_id=str(path))


def read_shards(path: Union[str, Path], model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Load what :func:`write_shards` wrote into ``model`` (and ``optimizer``), whatever layout wrote it.

    ``model`` is parallelised (and ``optimizer`` built) as for training, or a plain model on one
    process (no process group needed): DCP reshards.
    """
    state = _state(model, optimizer)
    halves = {}  # the placements of the entries split by halves, to go back to after the load
    for part, values in state.items():  # DCP loads into these very dicts (the values that are not tensors too)
        blocks = _blockwise(values)
        halves[part] = {name: values[name].placements for name in blocks}
        values.update(blocks)
    with warnings.catch_warnings():  # one process loads without a process group, as intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=str(path))
    for part, placements in halves.items():  # back to the halves' layout
        for name, placement in placements.items():
            state[part][name] = blocks_to_halves(state[part][name], placement)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_BY_NAME)


def save_distributed(
    path: Union[str, Path], model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
    trainer_state: Optional[dict[str, Any]] = None,
) -> Path:
    """Write a checkpoint of ``model`` (and ``optimizer``) at ``path`` from every rank; returns the path.

    Args:
        path: the checkpoint directory (created; must not exist yet).
        model, optimizer: the parallelised model and its optimizer.
        trainer_state: JSON-ready values (step, data source state, ...) written by rank 0.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"save_distributed: {path} exists already; a checkpoint is written once")
    partial = path.with_name(path.name + ".partial")
    if _is_main() and partial.exists():
        shutil.rmtree(partial)
    _barrier()
    write_shards(partial, model, optimizer)
    if _is_main():
        (partial / TRAINER_STATE).write_text(json.dumps(trainer_state or {}))
    _barrier()
    if _is_main():
        partial.rename(path)
    _barrier()
    return path


def load_distributed(
    path: Union[str, Path], model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_distributed` into ``model`` (and ``optimizer``), whatever
    the number of ranks or the layout it was written with; returns the trainer state.

    ``model`` must be parallelised (and ``optimizer`` built) as for training before loading.
    """
    path = Path(path)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"load_distributed: {path} is not a complete checkpoint (no {TRAINER_STATE})")
    read_shards(path, model, optimizer)
    return json.loads((path / TRAINER_STATE).read_text())


def export_pretrained(model: nn.Module, path: Union[str, Path]) -> Optional[Path]:
    """Gather the full weights on rank 0 and write ``path`` (config + safetensors) for ``from_pretrained``.

    Call on every rank; returns the path on rank 0 and None elsewhere. The folder holds the
    model's own class (not its FSDP wrapper) with plain tensors.
    """
    full = {}
    for name, value in get_model_state_dict(model).items():  # one tensor gathered at a time, rank 0 keeps it
        value = full_tensor(value)
        if _is_main():
            full[name] = value.detach().cpu()
    path = Path(path)
    if _is_main():
        cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
        with torch.device("meta"):
            plain = cls(model.config)
        plain.load_state_dict(full, assign=True, strict=False)
        plain.tie_weights()  # a tied head shares the embedding's tensor, which the state dict holds once
        left = [name for name, p in plain.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"export_pretrained: the gathered state dict lacks {left}")
        plain.save_pretrained(path)
    _barrier()
    return path if _is_main() else None
