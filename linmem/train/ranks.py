"""The processes a run trains on: one, or the ranks that torchrun launched.

:class:`Ranks` is what the trainer asks of them, the same calls on one process (where they do no
communication) and on many: which rank writes the run directory (rank 0), an action of rank 0
whose result or error every rank receives, a step's logged values averaged over all ranks, and
whether any rank received a stop signal (so that every rank takes the same decisions).

Example (under ``torchrun --nproc-per-node 2``)::

    ranks = join(ParallelConfig(dp=2), "cuda")
    finished = ranks.on_main(check_run_directory, config)   # rank 0 reads; its error is every rank's
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from ..distributed import ParallelConfig, ParallelMesh, build_mesh, init_distributed

logger = logging.getLogger("linmem.train")

Result = TypeVar("Result")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the signals that end training with a checkpoint


class Ranks:
    """The processes of a run and the few collectives the trainer needs.

    Args:
        device: this rank's device.
        mesh: the parallel layout's meshes; None for one process.
    """

    def __init__(self, device: torch.device, mesh: Optional[ParallelMesh] = None) -> None:
        self.device, self.mesh = device, mesh
        self.world = dist.get_world_size() if mesh is not None else 1
        self.rank = dist.get_rank() if mesh is not None else 0

    @property
    def is_main(self) -> bool:
        """Whether this rank writes the run directory (metrics, config, checkpoint records, progress)."""
        return self.rank == 0

    def on_main(self, action: Callable[..., Result], *args: Any) -> Result:
        """``action(*args)`` on rank 0; every rank returns its result or raises its error.

        Checks of the run directory and writes into it happen once, yet a refusal stops all ranks
        alike instead of leaving the others waiting in their next collective.
        """
        if self.mesh is None:
            return action(*args)
        outcome: list[Any] = [None]
        if self.is_main:
            try:
                outcome = [(True, action(*args))]
            except Exception as err:  # every rank raises it below
                outcome = [(False, _portable(err))]
                error = err
        dist.broadcast_object_list(outcome, src=0)
        ok, value = outcome[0]
        if ok:
            return value
        if self.is_main:
            raise error
        raise value

    def average(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` (the same names on every rank) averaged over all ranks: one all-reduce."""
        if self.mesh is None:
            return dict(values)
        total = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return {name: value / self.world for name, value in zip(values, total.tolist())}

    def data_parallel_sum(self, values: list[float]) -> list[float]:
        """Each of ``values`` summed over the data-parallel ranks (what every rank holds of its own batches)."""
        if self.mesh is None:
            return [float(v) for v in values]
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.mesh.dp.get_group())
        return total.tolist()

    def any_signal(self, signum: Optional[int]) -> Optional[int]:
        """The stop signal if any rank received one (SIGINT before SIGTERM), the same on every rank."""
        if self.mesh is None:
            return signum
        received = torch.tensor([float(signum == s) for s in STOP_SIGNALS], device=self.device)
        dist.all_reduce(received)
        return next((s for s, count in zip(STOP_SIGNALS, received.tolist()) if count > 0), None)


def _portable(err: Exception) -> Exception:
    """``err`` if it survives pickling (to reach the other ranks), else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"rank 0: {type(err).__name__}: {err}")


def join(parallel: ParallelConfig, device_type: str) -> Ranks:
    """Join torchrun's process group (``parallel.timeout_minutes`` on its collectives) and build the
    meshes of ``parallel``; this rank's device is ``cuda:LOCAL_RANK`` or the CPU. Ranks other than 0
    log warnings and errors only."""
    init_distributed(device_type, parallel.timeout_minutes)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if device_type == "cuda" else torch.device("cpu")
    mesh = build_mesh(parallel, device_type)
    if dist.get_rank() != 0:  # rank 0 reports progress; the others only what goes wrong
        logging.getLogger("linmem").setLevel(logging.WARNING)
    return Ranks(device, mesh)
