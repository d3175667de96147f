"""The ``parallel`` configuration and the device mesh it builds.

A run on ``world = dp * sp * tp`` ranks: ``dp`` data-parallel ranks (each its own share of the global
batch) times ``sp`` sequence-parallel ranks (each a contiguous piece of every sequence of its
share) times ``tp`` tensor-parallel ranks (each the same tokens and ``1/tp`` of every layer's heads
and hidden units). Expert parallelism splits every MoE layer's experts over ``ep`` of the
data-parallel ranks (``ep`` divides ``dp``). The mesh has the dimensions ``("edp", "sp", "ep", "tp")``
of sizes ``(dp / ep, sp, ep, tp)`` with ``dp = edp * ep``, ``tp`` innermost (neighbouring ranks, the
fastest links); FSDP shards the parameters over the ``edp * sp * ep`` ranks of one tensor-parallel
index (every rank when ``tp = 1``) and the experts over the ``edp * sp`` ranks that hold the same experts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

from ..settings import setting

if TYPE_CHECKING:  # torch loads when a mesh is built: the config section alone imports without it
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelConfig", "ParallelMesh", "ParallelConfigError", "TORCHRUN_ENVIRONMENT", "build_mesh",
           "init_distributed", "world_size"]


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run: sizes that do not fit the ranks, the sequence or the experts."""


@dataclass
class ParallelConfig:
    """How a run spreads over ranks (the ``parallel`` config section): ``dp * sp * tp`` processes launched by
    torchrun."""

    dp: int = setting(1, "data-parallel ranks: each its own share of the global batch")
    sp: int = setting(1, "sequence-parallel ranks: each a contiguous piece of every sequence")
    ep: int = setting(1, "expert-parallel ranks (among the dp ranks): each 1/ep of every MoE layer's experts")
    tp: int = setting(1, "tensor-parallel ranks: the same tokens, each 1/tp of every layer's heads and hidden units")
    fsdp: bool = setting(True, "shard parameters also between forward and backward (off: keep them gathered)")
    blocks_per_unit: int = setting(4, "consecutive blocks FSDP gathers as one unit: fewer hooks and copies, more "
                                      "gathered")
    activation_checkpointing: bool = setting(False, "recompute each block's activations in the backward pass "
                                                    "(also on one process)")
    timeout_minutes: float = setting(10.0, "a collective waiting longer fails the run (a rank that died or hangs)")

    @property
    def world_size(self) -> int:
        return self.dp * self.sp * self.tp

    def validate(
        self,
        world_size: Optional[int] = None,
        *,
        seq_len: Optional[int] = None,
        num_experts: Optional[int] = None,
    ) -> "ParallelConfig":
        """Refuse layouts that cannot run, before any work; returns self.

        Args:
            world_size: the ranks launched (``torchrun --nproc-per-node``); must be ``dp * sp * tp``.
            seq_len: tokens per sequence (per packed row); ``sp`` must divide it.
            num_experts: experts per MoE layer; ``ep`` must divide it.
        """
        for name in ("dp", "sp", "ep", "tp", "blocks_per_unit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"parallel.{name} must be an int >= 1, got {value!r}")
        for name in ("fsdp", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ParallelConfigError(f"parallel.{name} must be true or false, got {getattr(self, name)!r}")
        timeout = self.timeout_minutes
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ParallelConfigError(f"parallel.timeout_minutes must be a number > 0, got {timeout!r}")
        if world_size is not None and world_size != self.world_size:
            launch = (f": launch with torchrun --nproc-per-node {self.world_size} -m linmem.cli train ..., or set "
                      "parallel.dp=1 parallel.sp=1 parallel.tp=1 to train on one process") if world_size == 1 else ""
            product = (f"parallel.dp * parallel.sp = {self.dp} * {self.sp}" if self.tp == 1 else
                       f"parallel.dp * parallel.sp * parallel.tp = {self.dp} * {self.sp} * {self.tp}")
            raise ParallelConfigError(
                f"{product} = {self.world_size} must equal the number of processes launched, {world_size}{launch}"
            )
        if self.dp % self.ep:
            raise ParallelConfigError(f"parallel.ep = {self.ep} must divide parallel.dp = {self.dp} (expert-parallel "
                                      "ranks are data-parallel ranks)")
        if seq_len is not None and seq_len % self.sp:
            raise ParallelConfigError(f"parallel.sp = {self.sp} must divide the sequence length {seq_len} (every rank "
                                      "holds an equal piece)")
        if num_experts is not None and num_experts % self.ep:
            raise ParallelConfigError(f"parallel.ep = {self.ep} must divide the number of experts {num_experts}")
        return self


@dataclass
class ParallelMesh:
    """The device meshes of a run (all cut from one root mesh, so DTensors on them compose)."""

    config: ParallelConfig
    root: DeviceMesh  # ("edp", "sp", "ep", "tp")
    dp: DeviceMesh  # data-parallel ranks (edp * ep): each its own batch share
    sp: DeviceMesh  # sequence-parallel ranks: pieces of the same sequences
    ep: DeviceMesh  # expert-parallel ranks: each holds 1/ep of the experts
    tp: DeviceMesh  # tensor-parallel ranks: the same tokens, each 1/tp of the heads and hidden units
    data: DeviceMesh  # the ranks of one tensor-parallel index (edp * sp * ep): where parameters are sharded and
    #                   gradients averaged, and over which the loss is a mean (every rank when tp = 1)
    expert_data: DeviceMesh  # the ranks (edp * sp) holding the same experts: where experts are sharded

    @property
    def device_type(self) -> str:
        return self.root.device_type


def build_mesh(config: ParallelConfig, device_type: Optional[str] = None) -> ParallelMesh:
    """The meshes of ``config`` over the launched processes (``torch.distributed`` must be initialised).

    Args:
        config: the layout; validated against the world size here.
        device_type: ``"cuda"`` or ``"cpu"``; default CUDA when available (NCCL), else CPU (gloo).

    Example (under ``torchrun --nproc-per-node 4``):
        >>> mesh = build_mesh(ParallelConfig(dp=2, sp=2))  # doctest: +SKIP
        >>> mesh.sp.size(), mesh.data.size()  # doctest: +SKIP
        (2, 4)
        >>> mesh = build_mesh(ParallelConfig(dp=2, tp=2))  # doctest: +SKIP
        >>> mesh.tp.size(), mesh.data.size()  # doctest: +SKIP
        (2, 2)
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise ParallelConfigError(
            "build_mesh: no process group; launch with `torchrun --nproc-per-node N ...` and call "
            "torch.distributed.init_process_group (or linmem.distributed.init_distributed) first"
        )
    config.validate(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # ep after edp and sp: the experts' meshes (expert_data, ep) then keep the root's dimension order; tp
    # innermost, so that a tensor-parallel group is neighbouring ranks (one host, the fastest links)
    root = init_device_mesh(device_type, (config.dp // config.ep, config.sp, config.ep, config.tp),
                            mesh_dim_names=("edp", "sp", "ep", "tp"))
    return ParallelMesh(
        config=config, root=root, dp=root["edp", "ep"]._flatten("dp"), sp=root["sp"], ep=root["ep"], tp=root["tp"],
        data=root["edp", "sp", "ep"]._flatten("data"), expert_data=root["edp", "sp"]._flatten("expert_data"),
    )


def world_size() -> int:
    """The number of processes launched (torchrun's ``WORLD_SIZE``; 1 without torchrun).

    Example:
        >>> world_size()  # doctest: +SKIP
        1
    """
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ParallelConfigError(f"WORLD_SIZE={text!r} is not a number of processes")
    return int(text)


#: What torchrun sets for every process; without them there is no process group to join.
TORCHRUN_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(device_type: Optional[str] = None, timeout_minutes: float = 10.0) -> None:
    """Initialise the default process group from torchrun's environment: NCCL on GPU (one device per
    local rank), gloo on CPU. Does nothing when already initialised.

    ``timeout_minutes``: a collective that waits longer raises on its rank (NCCL: the watchdog ends
    the process) instead of hanging after another rank died.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_ENVIRONMENT if name not in os.environ]
    if missing:
        raise ParallelConfigError(f"init_distributed: no torchrun environment ({', '.join(missing)} unset); launch "
                                  "with `torchrun --nproc-per-node N ...`")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(minutes=timeout_minutes))
