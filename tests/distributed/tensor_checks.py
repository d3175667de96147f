"""Checks run on every rank of a tensor-parallel job: the split model trains as one process does.

The zoo is one model whose layers are every mixer kind tensor parallelism splits (with their options: short
convolutions, GQA, the "Pro" attention options, biases, low-rank gates, per-head norms and constants), so one
run covers them all: three AdamW steps with gradient clipping on the same batches, the losses and the first
step's gradients (gathered whole with :func:`~linmem.distributed.tensor.full_tensor`) against one process (rank 0
trains the reference), fp64.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from linmem.distributed import ParallelConfig, build_mesh, clip_grad_norm_, parallelize
from linmem.distributed.tensor import blocks_to_halves, full_tensor, halves_to_blocks
from linmem.layers import build_mixer, mixer_class
from linmem.models import LinmemConfig, LinmemForCausalLM
from tests.helpers import rel_err

from . import training_checks

STEPS, LR, CLIP = 3, 1e-2, 0.5
VOCAB, ROWS, T = 32, 2, 8
# fp64 models keep some steps in fp32 (norm statistics, gates): gradients agree to ~1e-6 of their size. AdamW divides
# each entry by its own size plus eps (1e-8), so an entry near eps moves by a share of the learning rate that such an
# error changes (measured: weights up to 1e-4 apart after the first step, losses of the third up to 2.5e-6): the
# first loss (the same weights) must agree to LOSS_TOL, the later ones to STEP_TOL (the training checks' curves')
LOSS_TOL, STEP_TOL, TOL = 1e-7, 1e-4, 1e-5
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_heads=4, intermediate_size=32, recurrence_backend="chunk")


def kinds(tp: int) -> list[tuple[str, dict[str, Any]]]:
    """Every mixer tensor parallelism splits, with config fields that exercise its split parameters."""
    kv = dict(num_kv_heads=2) if tp <= 2 else {}  # GQA: 2 KV heads for 4 query heads
    conv = dict(mixer=dict(use_short_conv=True))
    return [
        ("softmax", dict(mixer=dict(qk_norm=True, output_norm=True, output_gate=True, kv_shift=True, **kv))),
        ("swa", dict(mixer=dict(window=3, **kv))),
        ("fox", dict(mixer=dict(output_gate=True, qk_norm=True))),
        ("fox", dict(mixer=dict(forget_gate="fixed"))),
        ("fox", dict(mixer=dict(forget_gate="data_independent"))),
        ("llama_attention", dict(mixer=dict(**kv), llama_attention=dict(qkv_bias=True, o_bias=True))),
        ("liger", dict(mixer=dict(**kv), liger=dict(gate="projection", feature_map="learnable", window=3))),
        ("gla", conv), ("gfw", conv), ("gateloop", conv), ("deltanet", {}), ("gated_deltanet", {}),
        ("titans", dict(titans=dict(momentum=True))), ("ttt", {}), ("bayes", dict(recurrence_backend="auto")),
        ("kda", {}), ("linear_attention", conv), ("retention", conv), ("lightning", {}), ("hgrn2", conv),
        ("gsa", dict(mixer=dict(**kv), gsa=dict(num_slots=4))), ("mamba2", {}), ("rwkv6", {}), ("rwkv7", {}),
        ("mamba", {}), ("s4", dict(mixer=dict(head_dim=4))),
        # mixtures: stacked [x; z] halves and x_proj's sum (mamba), a stacked low-rank gate (gla), stacked rows
        # of a weight kept whole (mamba2); without the shared memory once
        ("mom", dict(mom=dict(memory="mamba"), mixer=dict(head_dim=4))),
        ("mom", dict(mom=dict(memory="gla", shared_memory=False), **conv)),
        ("mom", dict(mom=dict(memory="mamba2"))),
    ]


def zoo(tp: int) -> LinmemForCausalLM:
    """One fp64 model whose layer i is the i-th of :func:`kinds` (each built from its own config's fields)."""
    layers = kinds(tp)
    n = len(layers)
    torch.manual_seed(0)
    model = LinmemForCausalLM(LinmemConfig(**BASE, layer_pattern="L" * n))
    for i, (kind, fields) in enumerate(layers):
        memory = mixer_class(kind).kind == "memory"
        config = LinmemConfig(**{**BASE, **fields}, layer_pattern=("L" if memory else "N") * n,
                              **{"memory" if memory else "attention": kind})
        model.model.layers[i].mixer = build_mixer(kind, config.mixer_args(i))
    return model.double()


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The next-token loss plus the routers' (the mixtures' balancing losses)."""
    out = model(ids, use_cache=False)
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return loss if out.aux_loss is None else loss + out.aux_loss


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, T), generator=torch.Generator().manual_seed(10 + step))


def whole(grad: torch.Tensor) -> torch.Tensor:
    """A gradient gathered whole (a collective for a DTensor: every rank takes part)."""
    return full_tensor(grad) if isinstance(grad, DTensor) else grad.clone()


def _train(model: torch.nn.Module, clip) -> tuple[list[float], list[torch.Tensor]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, first = [], []
    for step in range(STEPS):
        loss = _loss(model, batch(step))
        loss.backward()
        if step == 0:
            first = [whole(p.grad) for p in model.parameters()]
        clip(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, first


def zoo_checks() -> None:
    """The zoo split over every rank (``tp`` = world): its losses and first gradients are one process's."""
    tp = dist.get_world_size()
    model = zoo(tp)
    reference = copy.deepcopy(model)
    config = ParallelConfig(tp=tp)
    losses, grads = _train(parallelize(model, build_mesh(config, "cpu"), config), clip_grad_norm_)
    if dist.get_rank() != 0:
        return
    ref_losses, ref_grads = _train(reference, torch.nn.utils.clip_grad_norm_)
    case = f"tp = {tp}"
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        tol = LOSS_TOL if step == 1 else STEP_TOL
        assert abs(a - b) <= tol * abs(b), f"{case}: step {step} loss {a:.12f}, one process {b:.12f}"
    for (name, _), grad, ref in zip(reference.named_parameters(), grads, ref_grads):
        assert grad.shape == ref.shape, f"{case}: d{name} has shape {list(grad.shape)}, one process {list(ref.shape)}"
        err = rel_err(grad, ref)
        assert err < TOL, f"{case}: d{name} differs from one process ({err:.1e})"


def mom_hybrid() -> LinmemConfig:
    """The training checks' hybrid with a mixture of memories (Gated DeltaNet memories, the shared one, short
    convolutions) in place of its memory layer, and a dense feed-forward; a balancing loss large enough that one
    taken over each data rank's tokens instead of the global batch's would fail the gradient checks."""
    return LinmemConfig(vocab_size=training_checks.VOCAB, hidden_size=16, num_heads=2, layer_pattern="LN",
                        memory="mom", attention="softmax", intermediate_size=32, recurrence_backend="chunk",
                        mom=dict(num_memories=3, top_k=2, aux_loss_coef=0.1))


def mesh_checks() -> None:
    """dp = 2 x tp = 2 on 4 ranks: a tensor-parallel group is two neighbouring ranks, the data ranks the others."""
    mesh = build_mesh(ParallelConfig(dp=2, tp=2), "cpu")
    rank = dist.get_rank()
    assert (mesh.tp.size(), mesh.data.size(), mesh.dp.size()) == (2, 2, 2)
    assert sorted(dist.get_process_group_ranks(mesh.tp.get_group())) == [rank - rank % 2, rank - rank % 2 + 1]
    assert sorted(dist.get_process_group_ranks(mesh.data.get_group())) == [rank % 2, rank % 2 + 2]
    assert mesh.dp.get_local_rank() == rank // 2, "the tensor-parallel ranks of a data rank take its batch"


def trainer_run(out: str) -> None:
    """``linmem train ... parallel.tp=2`` on every rank (2 steps, a checkpoint after each)."""
    from .trainer_checks import DENSE_RUN, train

    assert train(Path(out), *DENSE_RUN, *TRAINER_STEPS, "parallel.tp=2") == 0


#: the trainer test's run: 2 steps, a checkpoint (and model/) after each
TRAINER_STEPS = ("schedule.steps=2", "run.save_every=1")


def capacity_checks() -> None:
    """A MoE model whose experts drop tokens past their capacity, split over every rank: the one-process loss and
    gradients (the cap drops the same assignments on every rank)."""
    tp = dist.get_world_size()
    torch.manual_seed(0)
    model = LinmemForCausalLM(LinmemConfig(**BASE, layer_pattern="L", mlp="moe", moe=dict(
        num_experts=4, num_experts_per_tok=2, intermediate_size=16, capacity_factor=0.5))).double()
    reference = copy.deepcopy(model)
    config = ParallelConfig(tp=tp)
    model = parallelize(model, build_mesh(config, "cpu"), config)
    ids = batch(0)
    loss = _loss(model, ids)
    loss.backward()
    ref = _loss(reference, ids)
    ref.backward()
    assert abs(float(loss) - float(ref)) <= LOSS_TOL * abs(float(ref)), f"capacity, tp = {tp}: loss differs"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        err = rel_err(whole(p.grad), q.grad)
        assert err < TOL, f"capacity, tp = {tp}: d{name} differs from one process ({err:.1e})"


def halves_checks() -> None:
    """dp = 2 x tp = 2, and dp = ep = 2 x tp = 2, on 4 ranks: the weights split by halves over tp (a SwiGLU's
    [gate; up], Mamba's [x; z], the experts' [E, 2F, D]), sharded by FSDP2 too, turn into plain blocks and back by
    hand as torch's ``redistribute`` does, bit for bit, and gather whole as its ``full_tensor`` and the one-process
    weights; layouts the conversion does not describe are refused by name."""
    mamba = LinmemConfig(vocab_size=VOCAB, hidden_size=16, num_heads=2, layer_pattern="L", memory="mamba",
                         intermediate_size=32, recurrence_backend="chunk")
    moe = LinmemConfig(vocab_size=VOCAB, hidden_size=16, num_heads=2, layer_pattern="L", mlp="moe",
                       moe=dict(num_experts=4, intermediate_size=16), recurrence_backend="chunk")
    cases = [(ParallelConfig(dp=2, tp=2), mamba, ("mlp.gate_up.weight", "mixer.in_proj.weight")),
             (ParallelConfig(dp=2, ep=2, tp=2, fsdp=False), moe, ("mlp.gate_up",))]
    for config, model_config, names in cases:
        torch.manual_seed(0)
        one = LinmemForCausalLM(model_config)
        model = parallelize(copy.deepcopy(one), build_mesh(config, "cpu"), config)
        for name in names:
            weight = model.model.layers[0].get_parameter(name)
            tp = weight.device_mesh.mesh_dim_names.index("tp")
            assert isinstance(weight.placements[tp], _StridedShard) and len(weight.placements) >= 2, \
                f"{config}: {name} has placements {weight.placements}"
            blocks = halves_to_blocks(weight)
            dim = weight.placements[tp].dim
            assert blocks.placements[tp] == Shard(dim) and blocks.placements[:tp] == weight.placements[:tp]
            torch_blocks = weight.redistribute(placements=blocks.placements)
            halves = blocks_to_halves(torch_blocks, weight.placements)
            torch_halves = torch_blocks.redistribute(placements=weight.placements)
            for got, ref, what in ((blocks, torch_blocks, "to blocks"), (halves, torch_halves, "to halves"),
                                   (halves, weight, "there and back")):
                assert got.placements == ref.placements and got.shape == ref.shape and got.stride() == ref.stride()
                assert torch.equal(got.to_local(), ref.to_local()), f"{config}: {name} {what} differs from torch's"
            whole = full_tensor(weight)
            assert torch.equal(whole, weight.full_tensor()), f"{config}: {name} gathered differs from torch's"
            assert torch.equal(whole, one.model.layers[0].get_parameter(name)), f"{config}: {name} differs"
        if config.ep == 1:  # the (data, tp) mesh: a mesh built for them would only add process groups to the job
            _refusals(weight.device_mesh)


def _refusals(mesh: DeviceMesh) -> None:
    """Layouts the hand conversion does not describe, on a 2-D (data, tp) mesh, refused by name."""
    same_dim = DTensor.from_local(torch.zeros(2, 3), mesh, (Shard(0), _StridedShard(0, split_factor=2)),
                                  run_check=False, shape=(8, 3), stride=(3, 1))
    _raises(lambda: halves_to_blocks(same_dim), "shard tensor dimension 0, which tp splits by halves, on mesh "
                                                "dimension 0 too; FSDP must shard another dimension")
    odd = DTensor.from_local(torch.zeros(3, 3), mesh, (Shard(1), _StridedShard(0, split_factor=2)), run_check=False,
                             shape=(6, 6), stride=(6, 1))
    _raises(lambda: halves_to_blocks(odd), "dimension 0 of shape (6, 6) must split into 2 halves of 2 blocks")
    _raises(lambda: blocks_to_halves(odd, odd.placements), "blocks_to_halves: placements must split by halves")


def _raises(call: Callable[[], Any], message: str) -> None:
    try:
        call()
    except ValueError as error:
        assert message in str(error), f"expected {message!r}, got {error}"
    else:
        raise AssertionError(f"expected ValueError: {message}")
