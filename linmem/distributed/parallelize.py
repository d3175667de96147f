"""``parallelize(model, mesh, config)``: data, expert, tensor and (with the sequence handler) sequence
parallelism applied to a single-device :class:`~linmem.models.LinmemForCausalLM` from outside.

In order, on every block of the stack:

1. MoE feed-forwards become :class:`~linmem.distributed.expert.ExpertParallelMoE` (experts split over
   ``ep`` ranks; balancing statistics over the global batch) whenever the run has several ranks;
2. tensor parallelism (:func:`~linmem.distributed.tensor.apply_tp`): the mixers' heads and the
   feed-forwards' hidden units split over ``tp`` ranks, their parameters DTensors on the ``tp`` mesh;
3. activation checkpointing (``torch.distributed._composable.checkpoint``: the block recomputes its
   activations in the backward pass; parameter names do not change), then, with ``compile_blocks``,
   ``torch.compile`` of the block;
4. FSDP2 (``fully_shard``) over the data ranks (those of one tensor-parallel index), 2-D with the
   tensor-parallel DTensors inside as torchtitan does: the router in fp32 and, under expert parallelism,
   the shared experts and the experts as units of their own (the experts sharded over the ranks holding the same
   experts, their gradients divided by the whole world like the others), then the block (or
   ``blocks_per_unit`` consecutive blocks as one unit: one gather, one reduce and one set of hooks for
   all of them, which spares host time, with more parameters gathered at once); the root
   takes the embeddings, the final norm and the head (gathered from forward to backward). On GPU the
   parameters are gathered in bf16 and gradients reduced in fp32; on CPU everything stays fp32.

Sequence parallelism needs no change to the modules: the trainer installs a
:class:`~linmem.distributed.handler.SequenceParallel` for each step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..layers.moe import MoEFeedForward
from ..layers.mom import MixtureOfMemories
from .config import ParallelConfig, ParallelConfigError, ParallelMesh
from .expert import expert_parallel, stats_reduction
from .tensor import apply_tp, splits_halves_by_rows, tensor_parallel_refusal

__all__ = [
    "parallelize",
    "apply_expert_parallel",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "clip_grad_norm_",
    "check_model",
    "compile_refusal",
]


def check_model(model: nn.Module, config: ParallelConfig, *, compile_blocks: bool = False) -> None:
    """Refuse a model the layout cannot serve, before any work (named errors). ``compile_blocks`` on
    several ranks is tested for data parallelism of blocks without MoE feed-forwards only: sequence
    and tensor parallelism and the experts' statistics put collectives inside the blocks, which are refused.
    Tensor parallelism needs every layer's heads and hidden units divisible by ``tp`` and a mixer it can
    split (:func:`~linmem.distributed.tensor.tensor_parallel_refusal`)."""
    blocks = _blocks(model)
    moe = [b.mlp for b in blocks if isinstance(b.mlp, MoEFeedForward)]
    refusal = compile_refusal(model, config)
    if compile_blocks and refusal is not None:
        raise ParallelConfigError(f"{refusal}; set run.compile=false")
    if config.ep > 1 and not moe:
        raise ParallelConfigError(f"parallel.ep = {config.ep} needs MoE feed-forwards (mlp='moe'); the model has none")
    for layer in moe:
        config.validate(num_experts=layer.args.num_experts)
        if config.ep > 1 and layer.args.capacity_factor is not None:
            raise ParallelConfigError("parallel.ep > 1 is dropless: set moe.capacity_factor to None, got "
                                      f"{layer.args.capacity_factor}")
    if config.sp > 1 and any(isinstance(b.mixer, MixtureOfMemories) for b in blocks):
        raise ParallelConfigError(
            "parallel.sp > 1 cannot serve mixtures of memories (memory='mom'): their recurrences run over routed "
            "segments, not the batch's time axis; use sp = 1"
        )
    refusal = tensor_parallel_refusal(model, config.tp)
    if refusal is not None:
        raise ParallelConfigError(refusal)
    data = config.dp * config.sp
    if config.tp > 1 and data > 1 and any(not isinstance(b.mlp, MoEFeedForward) or b.mlp.shared is not None
                                          or splits_halves_by_rows(b.mixer) for b in blocks):
        width = blocks[0].mlp_norm.weight.shape[0]
        if width % data:  # FSDP shards a [gate; up] (Mamba's [x; z]), split by halves over tp, along its input width
            raise ParallelConfigError(f"parallel.tp = {config.tp} with dp * sp = {data} data ranks: the hidden size "
                                      f"{width} must be a multiple of {data}")


def compile_refusal(model: nn.Module, config: ParallelConfig) -> Optional[str]:
    """Why the blocks of ``model`` cannot be compiled on the layout ``config`` (None: they can). Compiled blocks on
    several ranks serve data parallelism of blocks without MoE feed-forwards: sequence parallelism and the
    experts' statistics put collectives inside the blocks."""
    moe = sum(isinstance(b.mlp, MoEFeedForward) for b in _blocks(model))
    if config.world_size > 1 and (config.sp > 1 or config.tp > 1 or moe):
        tp = f", parallel.tp = {config.tp}" if config.tp > 1 else ""
        return (f"compiled blocks (run.compile) on several ranks serve data parallelism of blocks without MoE "
                f"feed-forwards only; got parallel.sp = {config.sp}{tp} and {moe} MoE layers: their collectives run "
                "inside the blocks")
    return None


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig) -> nn.Module:
    """Expert parallelism, in place, on several ranks (one rank: nothing): every MoE feed-forward becomes an
    :class:`~linmem.distributed.expert.ExpertParallelMoE`, its experts split over the ``ep`` ranks when
    ``config.ep > 1`` (else each rank keeps all), its balancing statistics over the global batch; every mixture of
    memories' balancing statistics, too, are the global batch's (over the data ranks, never ``tp``). Returns the model.
    """
    if mesh.data.size() == 1 and config.tp == 1:
        return model
    stats_group = mesh.data.get_group() if mesh.data.size() > 1 else None
    for block in _blocks(model):
        if isinstance(block.mlp, MoEFeedForward):
            expert_parallel(block.mlp, mesh.ep if config.ep > 1 else None, stats_group)
        if isinstance(block.mixer, MixtureOfMemories):  # routes alike on every tp rank: the data ranks only
            block.mixer.stats_reduce = stats_reduction(stats_group)
    return model


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Activation checkpointing per block, in place: every block of ``model.layers`` recomputes its
    activations in the backward pass (parameter names do not change). Returns the model.

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> config = LinmemConfig(vocab_size=32, hidden_size=16, num_heads=2)
        >>> model = apply_activation_checkpointing(LinmemForCausalLM(config))
    """
    for block in _blocks(model):
        checkpoint(block)
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """Regional compilation, in place: ``torch.compile`` each block of ``model.layers`` on its own. Blocks of one
    kind share their compiled code (dynamo compiles a block's forward once and reuses it wherever its guards
    hold), so compile time does not grow with depth; everything between the blocks stays eager. Returns the model.

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> model = apply_compile(LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=16, num_heads=2)))
    """
    for block in _blocks(model):
        block.compile()
    return model


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig, *,
               param_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """FSDP2 (``fully_shard``), in place, on several ranks (one rank: nothing); returns the model.

    The units, innermost first: each MoE router in fp32; under expert parallelism the shared experts, and the
    experts sharded over the ranks holding the same experts, their gradients divided by the whole world like the
    others; then every ``config.blocks_per_unit`` consecutive blocks; last the root (embeddings, final norm, head),
    gathered from forward to backward. Parameters are gathered in ``param_dtype`` (default bf16 on GPU, fp32 on CPU)
    and gradients reduced in fp32; ``config.fsdp`` says whether the units reshard after their forward.
    """
    world = mesh.data.size()
    if world == 1:
        return model
    on_gpu = mesh.device_type == "cuda"
    split_halves = _shard_halves_by_input if config.tp > 1 else None
    if param_dtype is None:
        param_dtype = torch.bfloat16 if on_gpu else torch.float32
    compute = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    reshard = config.fsdp
    blocks = _blocks(model)
    for block in blocks:
        mlp = block.mlp
        if isinstance(mlp, MoEFeedForward):
            fully_shard(mlp.router, mesh=mesh.data, mp_policy=fp32, reshard_after_forward=reshard)
            if config.ep > 1:
                if mlp.shared is not None:
                    fully_shard(mlp.shared, mesh=mesh.data, mp_policy=compute, reshard_after_forward=reshard,
                                shard_placement_fn=split_halves)
                fully_shard(mlp, mesh=mesh.expert_data, mp_policy=compute, reshard_after_forward=reshard)
                mlp.set_gradient_divide_factor(float(world))
                # WORKAROUND(torch 2.13, gloo): a size-1 FSDP group divides twice under a forced sum; force it for >1
                if not on_gpu and mesh.expert_data.size() > 1:  # gloo has no pre-multiplied sum: sum, then divide
                    mlp.set_force_sum_reduction_for_comms(True)
    for start in range(0, len(blocks), config.blocks_per_unit):  # one FSDP unit: its blocks' hooks run once
        unit = blocks[start:start + config.blocks_per_unit]
        fully_shard(unit[0] if len(unit) == 1 else unit, mesh=mesh.data, mp_policy=compute,
                    reshard_after_forward=reshard, shard_placement_fn=split_halves)
    # the root (embeddings, final norm, head) stays gathered from forward to backward, which starts with it
    fully_shard(model, mesh=mesh.data, mp_policy=compute, reshard_after_forward=False)
    return model


def _shard_halves_by_input(param: nn.Parameter) -> Optional[Shard]:
    """FSDP's shard of a parameter: a SwiGLU's [gate; up] weight, split by halves along its rows over tp, along
    its input columns (FSDP's rows of a strided shard would not describe one block of the global tensor, which
    DCP and ``full_tensor`` need); the others along their rows (None: FSDP's default)."""
    if isinstance(param, DTensor) and isinstance(param.placements[-1], _StridedShard) and \
            param.placements[-1].dim == 0:
        return Shard(1)
    return None


def parallelize(model: nn.Module, mesh: ParallelMesh, config: Optional[ParallelConfig] = None, *,
                param_dtype: Optional[torch.dtype] = None, compile_blocks: bool = False) -> nn.Module:
    """Apply ``config`` to ``model`` in place (every rank, same initial weights); returns the model.

    Validates, then applies in order :func:`apply_expert_parallel`, :func:`~linmem.distributed.tensor.apply_tp`,
    :func:`apply_activation_checkpointing` (``config.activation_checkpointing``), :func:`apply_compile`
    (``compile_blocks``) and :func:`apply_fsdp`.

    Args:
        model: a :class:`~linmem.models.LinmemForCausalLM` (or anything with ``model.layers`` of
            blocks with ``mixer`` and ``mlp``) on this rank's device.
        mesh: from :func:`~linmem.distributed.config.build_mesh`.
        config: the layout (default: the one the mesh was built from); its sizes must be the mesh's.
        param_dtype: the dtype FSDP gathers parameters in for compute (gradients are reduced in fp32,
            routers stay fp32); default bf16 on GPU, fp32 on CPU.
        compile_blocks: ``torch.compile`` every block (after activation checkpointing, inside its FSDP
            unit), as torchtitan does: FSDP2's hooks stay outside the graphs, blocks of one kind share
            their compiled code, and a block's many small launches become few.

    Example (under ``torchrun --nproc-per-node 2``)::

        config = ParallelConfig(dp=2)
        model = parallelize(LinmemForCausalLM(model_config).to(device), build_mesh(config), config)
        optimizer = torch.optim.AdamW(model.parameters())   # after parallelize: DTensor parameters
    """
    config = mesh.config if config is None else config.validate()
    sizes = lambda c: (c.dp, c.sp, c.ep, c.tp)  # noqa: E731
    if sizes(config) != sizes(mesh.config):
        raise ParallelConfigError(f"parallelize: config (dp, sp, ep, tp) = {sizes(config)} differs from the mesh's "
                                  f"{sizes(mesh.config)}")
    check_model(model, config, compile_blocks=compile_blocks)
    apply_expert_parallel(model, mesh, config)
    apply_tp(model, mesh, config)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_blocks:
        apply_compile(model)
    return apply_fsdp(model, mesh, config, param_dtype=param_dtype)


def _blocks(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"parallelize: expected a LinmemForCausalLM (model.layers), got {type(model).__name__}")
    return list(layers)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of (possibly sharded) parameters to a global norm; returns the norm before clipping.

    Works on the ranks' local shards: one ``_foreach_norm`` over them, the ``norm_type``-th powers
    summed (``inf``: the maximum) over the ranks of each mesh dimension a gradient is sharded on (one
    ``all_reduce`` per process group), one ``_foreach_mul_`` to clip. The result is the norm of the
    full gradient, the same on every rank, as ``torch.nn.utils.clip_grad_norm_`` on one process;
    gradients on different meshes (the experts and the rest) may be mixed. Going through the local
    tensors spares DTensor's dispatch per op, which costs more host time than the arithmetic.
    """
    infinite = math.isinf(norm_type)
    by_groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # process groups to reduce over -> shards
    grads = []
    for p in parameters:
        if p.grad is None:
            continue
        grad = p.grad
        groups: tuple = ()
        if isinstance(grad, DTensor):
            for dim, placement in enumerate(grad.placements):
                if placement.is_partial():
                    raise ValueError(f"clip_grad_norm_: expected gradients sharded or replicated, got placements "
                                     f"{grad.placements}")
                if not placement.is_replicate():  # Shard, or _StridedShard (not is_shard() in torch 2.13)
                    groups += (grad.device_mesh.get_group(dim),)
            grad = grad.to_local()
        by_groups[groups].append(grad)
        grads.append(grad)
    if not grads:
        return torch.zeros(())
    total = None
    for groups, shards in by_groups.items():
        norms = torch.cat([torch.stack(torch._foreach_norm(same, norm_type)).float().to(shards[0].device)
                           for same in _by_device_and_dtype(shards)])
        part = norms.max() if infinite else norms.pow(norm_type).sum()
        for group in groups:
            torch.distributed.all_reduce(part, op=ReduceOp.MAX if infinite else ReduceOp.SUM, group=group)
        total = part if total is None else (torch.maximum(total, part) if infinite else total + part)
    total = total if infinite else total.pow(1.0 / norm_type)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grads_with_norm_
    for shards in _by_device_and_dtype(grads):
        torch._foreach_mul_(shards, scale.to(shards[0].device))
    return total


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return list(groups.values())
