"""Checks run on every rank: a short parallel training run of a tiny hybrid MoE model has the first
gradients (every parameter, gathered whole) and the loss curve of one process on the same global
batches, and resumes exactly from a DCP checkpoint (the trainer's checks resume on other numbers of
ranks and export ``model/``). The gradients matter: AdamW hides a wrongly scaled gradient from the
loss curve.

The one-process reference (rank 0 computes it) trains on the whole global batch with the mean
next-token loss over all its targets plus the routers' losses, AdamW, and gradient clipping.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from linmem.distributed import (
    ParallelConfig,
    SequenceParallel,
    build_mesh,
    clip_grad_norm_,
    global_lm_loss,
    load_distributed,
    next_token_targets,
    parallelize,
    save_distributed,
    sequence_parallel,
    shard_sequence,
)
from linmem.distributed.tensor import full_tensor
from linmem.models import LinmemConfig, LinmemForCausalLM

STEPS, SAVE_AT = 4, 2
LR, CLIP = 1e-2, 0.5
ROWS, T, VOCAB = 4, 16, 64  # the global batch: ROWS sequences of T tokens


def model_config() -> LinmemConfig:
    return LinmemConfig(
        vocab_size=VOCAB, hidden_size=16, num_heads=2, layer_pattern="LN", memory="gated_deltanet",
        attention="softmax", mlp="moe", intermediate_size=32, recurrence_backend="chunk",
        moe=dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16, num_shared_experts=1),
    )


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, T), generator=torch.Generator().manual_seed(100 + step))


def fresh_model(config: Optional[LinmemConfig] = None) -> LinmemForCausalLM:
    """The model of ``config`` (default :func:`model_config`), the same initial weights on every rank."""
    torch.manual_seed(0)
    return LinmemForCausalLM(config or model_config())


def _with_aux(loss: torch.Tensor, out) -> torch.Tensor:
    """The next-token loss plus the routers' losses (a model without routers has none)."""
    return loss if out.aux_loss is None else loss + out.aux_loss


def reference_run(model_config: Optional[LinmemConfig] = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch per step: the losses and the first step's gradients."""
    model = fresh_model(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first_grads = [], {}
    for step in range(STEPS):
        ids = global_batch(step)
        out = model(ids, use_cache=False)
        loss = _with_aux(global_lm_loss(out.logits, next_token_targets(ids), None), out)
        loss.backward()
        if step == 0:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, first_grads


class ParallelRun:
    """A parallelised copy of the model, its optimizer, and one training step on this rank's share."""

    def __init__(self, config: ParallelConfig, model_config: Optional[LinmemConfig] = None) -> None:
        self.config = config
        self.mesh = build_mesh(config, "cpu")
        self.model = parallelize(fresh_model(model_config), self.mesh, config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.group = self.mesh.data.get_group()

    def step(self, step: int, reference_grads: Optional[dict[str, torch.Tensor]] = None) -> float:
        """One optimiser step; with ``reference_grads`` (rank 0) the gradients must be those first."""
        c = self.config
        rows = ROWS // c.dp
        dp_rank, sp_rank = self.mesh.dp.get_local_rank(), self.mesh.sp.get_local_rank()
        ids = global_batch(step)[dp_rank * rows:(dp_rank + 1) * rows]
        piece, layout = shard_sequence({"input_ids": ids, "labels": ids}, sp_rank, c.sp)
        # as the trainer: the handler only under sequence parallelism (a mixture of memories refuses it)
        handler = sequence_parallel(SequenceParallel(self.mesh.sp.get_group(), layout, None)) if c.sp > 1 \
            else nullcontext()
        with handler:  # forward and backward: checkpointed blocks recompute in backward
            out = self.model(piece["input_ids"], position_ids=piece["position_ids"], use_cache=False)
            loss = _with_aux(global_lm_loss(out.logits, piece["targets"], self.group), out)
            loss.backward()
        if step == 0:
            self.check_gradients(reference_grads)
        norm = clip_grad_norm_(self.model.parameters(), CLIP)
        if step == 0 and reference_grads is not None:  # the global norm, and a clip that does scale
            ref = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference_grads.values()]))
            assert ref > CLIP and abs(float(norm) - float(ref)) <= 1e-5 * float(ref), \
                f"{self.config}: gradient norm {float(norm):.8f}, one process {float(ref):.8f}"
        self.optimizer.step()
        self.optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=self.group)
        return float(mean) / dist.get_world_size(self.group)


    def check_gradients(self, reference: Optional[dict[str, torch.Tensor]]) -> None:
        """Every parameter's gradient, gathered whole, against the one-process gradient (rank 0 compares)."""
        for name, p in self.model.named_parameters():
            # a collective for a DTensor: every rank takes part (under tensor parallelism alone the replicated ones
            # are plain)
            grad = full_tensor(p.grad)
            if reference is not None:
                err = float((grad - reference[name]).norm() / reference[name].norm().clamp_min(1e-30))
                assert err < 1e-5, f"{self.config}: gradient of {name} differs from one process ({err:.1e})"


def _reference(model_config: Optional[LinmemConfig]) -> tuple[list[float], Optional[dict[str, torch.Tensor]]]:
    """Rank 0 trains the reference; every rank receives its losses, rank 0 keeps the first gradients."""
    losses, grads = reference_run(model_config) if dist.get_rank() == 0 else ([0.0] * STEPS, None)
    values = torch.tensor(losses, dtype=torch.float64)
    dist.broadcast(values, 0)
    return values.tolist(), grads


def _assert_curve(got: list[float], ref: list[float], what: str, tol: float = 1e-4) -> None:
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= tol * abs(b), f"{what}: step {i + 1} loss {a:.8f}, one process {b:.8f}"


def training_checks(config: ParallelConfig, out_dir: str, model_config: Optional[LinmemConfig] = None) -> None:
    """Train STEPS steps (checkpoint after SAVE_AT) and resume from that checkpoint: the curve must be the
    one-process curve, the resumed losses the same losses. ``out_dir`` gets a checkpoint named by the world size;
    ``model_config`` is the model's (default :func:`model_config`)."""
    out = Path(out_dir)
    ref, ref_grads = _reference(model_config)
    run = ParallelRun(config, model_config)
    losses = []
    for step in range(STEPS):
        losses.append(run.step(step, ref_grads))
        if step + 1 == SAVE_AT:
            save_distributed(out / f"world{dist.get_world_size()}", run.model, run.optimizer, {"step": SAVE_AT})
    _assert_curve(losses, ref, f"{config}")

    again = ParallelRun(config, model_config)
    start = load_distributed(out / f"world{dist.get_world_size()}", again.model, again.optimizer)["step"]
    resumed = [again.step(step) for step in range(start, STEPS)]
    assert resumed == losses[start:], f"{config}: resumed losses {resumed} differ from {losses[start:]}"


def compile_check() -> None:
    """``compile_blocks`` under data parallelism (a dense model, dp = world): two steps' losses and the first
    step's gradients, gathered whole, equal the eager parallel run's (fp32; inductor reorders sums)."""
    world = dist.get_world_size()
    config = ParallelConfig(dp=world, blocks_per_unit=1)  # each compiled block its own FSDP unit
    dense = LinmemConfig(vocab_size=VOCAB, hidden_size=16, num_heads=2, layer_pattern="LN", memory="gated_deltanet",
                         attention="softmax", intermediate_size=32, recurrence_backend="chunk")
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = parallelize(LinmemForCausalLM(dense), build_mesh(config, "cpu"), config, compile_blocks=compiled)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, grads = [], []
        for step in range(2):
            rows = ROWS // world
            ids = global_batch(step)[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]
            loss = global_lm_loss(model(ids, use_cache=False).logits, next_token_targets(ids), dist.group.WORLD)
            loss.backward()
            if step == 0:
                grads = [full_tensor(p.grad) for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        runs.append((losses, grads))
    (eager, eager_grads), (compiled, compiled_grads) = runs
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(compiled, eager)), f"compiled {compiled}, eager {eager}"
    for got, ref in zip(compiled_grads, eager_grads):
        assert float((got - ref).norm() / ref.norm().clamp_min(1e-30)) < 1e-4

