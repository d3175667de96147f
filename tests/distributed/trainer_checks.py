"""``linmem.cli train`` on every rank of a launched job, as under torchrun: the runs the tests compare.

A tiny MQAR task and a tiny hybrid MoE model (Gated DeltaNet + softmax attention, 4 experts top-2, a
shared expert); every data-parallel rank trains on BATCH examples per step, so the one-process
reference trains on DP * BATCH. A tiny dense model on packed rows of a small text corpus, whose
one-process reference accumulates DP rows per step. Interruptions are a SIGINT sent to one rank
during a given step.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from linmem import cli
from linmem.train.trainer import Trainer

STEPS, SAVE_EVERY, BATCH, DP = 4, 2, 4, 2
TASK = [
    "data.mqar.vocab_size=64", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=64",
    "data.mqar.eval_examples=8", "model.hidden_size=16", "model.num_heads=2", "model.layer_pattern=LN",
    "model.options.recurrence_backend=chunk", "model.options.intermediate_size=32",
    f"schedule.steps={STEPS}", "schedule.warmup_steps=1", "optim.lr=0.01", f"run.save_every={SAVE_EVERY}",
    "run.log_every=1", "run.progress=false", "run.tensorboard=false", "run.device=cpu",
]
MOE = ["model.options.mlp=moe", "model.options.moe.num_experts=4", "model.options.moe.num_experts_per_tok=2",
       "model.options.moe.intermediate_size=16", "model.options.moe.num_shared_experts=1"]
MOE_RUN = [*TASK, *MOE, f"data.batch_size={BATCH}"]  # what every data-parallel rank of an MoE run trains on
DENSE_RUN = [*TASK, f"data.batch_size={BATCH}"]


def text_run(corpus: Path) -> list[str]:
    """The dense model on packed rows of 32 bytes of the files in ``corpus`` (documents cut at 24)."""
    return [*TASK, "data.task=text", f"data.text.paths=[{str(corpus)!r}]", "data.tokens_per_batch=32",
            "data.max_document_tokens=24", "data.text.val_fraction=0.2"]


def train(out_dir: Path, *overrides: str) -> int:
    """``linmem train`` with the run's overrides: its exit status."""
    return cli.main(["train", *overrides, f"run.out_dir={out_dir}"])


@contextmanager
def interrupt_after(step: int, rank: int) -> Iterator[None]:
    """SIGINT reaches rank ``rank`` (of the launched job) during step ``step``."""
    original = Trainer._optimizer_step

    def step_then_signal(self: Trainer, batches):
        result = original(self, batches)
        if dist.get_rank() == rank and self.step + 1 == step:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    Trainer._optimizer_step = step_then_signal
    try:
        yield
    finally:
        Trainer._optimizer_step = original


def four_ranks(out: Path, corpus: Path) -> None:
    """dp = 2 x sp = 2: the MoE model with its experts over ep = 2, and the dense model on packed rows whose
    documents cross the ranks' pieces; a checkpoint every SAVE_EVERY steps."""
    assert train(out / "four", *MOE_RUN, "parallel.dp=2", "parallel.sp=2", "parallel.ep=2",
                 "parallel.fsdp=false") == 0
    assert train(out / "text", *text_run(corpus), "parallel.dp=2", "parallel.sp=2", "run.save_every=0") == 0


def two_ranks(out: Path, from_four: Path, dense_cut: Path, busy: Path) -> None:
    """dp = 2 with activation checkpointing: a whole run; the same run stopped by Ctrl-C on rank 1 after step
    SAVE_EVERY, then run again; the four-rank run continued from its step-SAVE_EVERY checkpoint; and a
    one-process dense run (``grad_accum = 2``) continued on 2 ranks (``grad_accum = 1``), stopped after step 3.
    A run directory that another process holds stops both ranks with the error rank 0 found."""
    layout = ["parallel.dp=2", "parallel.activation_checkpointing=true"]
    assert train(busy, *MOE_RUN, *layout) == 2
    assert train(out / "whole", *MOE_RUN, *layout, "run.save_every=0") == 0  # a resumable key: the same run
    with interrupt_after(SAVE_EVERY, rank=1):
        assert train(out / "cut", *MOE_RUN, *layout) == 128 + signal.SIGINT
    assert train(out / "cut", *MOE_RUN, *layout) == 0
    assert train(from_four, *MOE_RUN, *layout, "parallel.fsdp=false") == 0
    with interrupt_after(3, rank=0):
        assert train(dense_cut, *DENSE_RUN, "parallel.dp=2", "schedule.grad_accum=1") == 128 + signal.SIGINT
