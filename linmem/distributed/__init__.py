"""Training on many ranks: data (FSDP2), sequence, expert and tensor parallelism, applied from outside.

Model code is written for one device; this package parallelises it (as torchtitan does):

* :func:`build_mesh` / :class:`ParallelConfig`: the ``parallel`` section (``dp``, ``sp``, ``ep``, ``tp``,
  ``fsdp``, ``activation_checkpointing``) and its device mesh;
* :func:`parallelize`: expert-parallel MoE layers, tensor parallelism, activation checkpointing, regional
  compilation and FSDP2 per block, one step each (:func:`apply_expert_parallel`, :func:`apply_tp`,
  :func:`apply_activation_checkpointing`, :func:`apply_compile`, :func:`apply_fsdp`; one process uses the
  checkpointing and the compilation);
* :class:`SequenceParallel` + :func:`sequence_parallel`: the handler the ops consult so that
  memory layers, attention layers and short convolutions run over sequences split between ranks;
  :func:`sp_linear_recurrence`, :func:`sp_bayes_filter`, :func:`sp_attention`, :func:`sp_halo` are its ops;
* :func:`shard_sequence`, :class:`DataParallelBatches`, :func:`global_lm_loss`: each rank's share
  of the batch and the loss over the global batch;
* :func:`save_distributed` / :func:`load_distributed` (DCP, reshardable; :func:`write_shards` /
  :func:`read_shards` for the shards alone) and :func:`export_pretrained`.

Launch: ``torchrun --nproc-per-node N ...``; NCCL on GPU, gloo on CPU. Names load on first use, so that
the ``parallel`` config section (:mod:`linmem.distributed.config`) imports without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "attention": ("sp_attention",),
    "bayes": ("sp_bayes_filter",),
    "batch": ("DataParallelBatches", "global_lm_loss", "next_token_targets", "shard_sequence", "split_packing"),
    "checkpoint": ("export_pretrained", "load_distributed", "read_shards", "save_distributed", "write_shards"),
    "config": ("ParallelConfig", "ParallelConfigError", "ParallelMesh", "build_mesh", "init_distributed"),
    "expert": ("ExpertParallelMoE", "expert_parallel", "global_router_stats"),
    "handler": ("SequenceParallel", "sequence_parallel"),
    "parallelize": ("apply_activation_checkpointing", "apply_compile", "apply_expert_parallel", "apply_fsdp",
                    "check_model", "clip_grad_norm_", "compile_refusal", "parallelize"),
    "sequence": ("PieceLayout", "sp_halo", "sp_linear_recurrence"),
    "tensor": ("apply_tp", "tensor_parallel_refusal"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DataParallelBatches",
    "ExpertParallelMoE",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelMesh",
    "PieceLayout",
    "SequenceParallel",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_tp",
    "build_mesh",
    "check_model",
    "clip_grad_norm_",
    "compile_refusal",
    "expert_parallel",
    "export_pretrained",
    "global_lm_loss",
    "global_router_stats",
    "init_distributed",
    "load_distributed",
    "next_token_targets",
    "parallelize",
    "read_shards",
    "save_distributed",
    "sequence_parallel",
    "shard_sequence",
    "sp_attention",
    "sp_bayes_filter",
    "sp_halo",
    "sp_linear_recurrence",
    "split_packing",
    "tensor_parallel_refusal",
    "write_shards",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = import_module(f"{__name__}.{_WHERE[name]}")
    for exported in _EXPORTS[_WHERE[name]]:  # all of them: the function parallelize replaces its module's name,
        globals()[exported] = getattr(module, exported)  # which the import just bound here
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
