"""Tensor parallelism on CPU (gloo): 2 and 4 processes started from pytest, several checks per job.

* every mixer kind it splits, in one model (the zoo): three training steps on tp = 2 and tp = 4 have the
  one-process losses (1e-7) and first gradients (1e-5, gathered whole), fp64;
* a hybrid MoE model (Gated DeltaNet + softmax attention, shared expert): tp = 2 alone (with activation
  checkpointing: the blocks recompute, collectives included, in the backward pass), dp = 2 x tp = 2 (FSDP2
  over the data ranks, 2-D with the TP DTensors), sp = 2 x tp = 2 (the attention gathers the keys and values
  of its heads over the sequence ranks) and dp = ep = 2 x tp = 2 (experts split by expert and by hidden unit, 2-D
  DTensors on the (ep, tp) mesh; blocks kept gathered) have the one-process gradients, gradient norm and loss
  curve, and resume exactly from their DCP checkpoints;
* an MoE layer with a capacity factor (tokens dropped alike on every rank) against one process;
* ``linmem train ... parallel.tp=2`` on 2 ranks has the loss curve of one process, and its checkpoint loads on
  one process with the weights it exported to ``model/``;
* the weights split by halves turn into plain blocks and back by hand as torch's ``redistribute`` does, bit for bit
  (dp = 2 x tp = 2 and dp = ep = 2 x tp = 2: [gate; up], Mamba's [x; z], the experts');
* the mesh (tp innermost; the tensor-parallel ranks of one data rank take its batch) and the named errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linmem.distributed import ParallelConfig, ParallelConfigError, check_model
from linmem.distributed.tensor import PLANS
from linmem.layers import mixer_names
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.train import Trainer, load_config
from linmem.train.checkpoint import load_checkpoint
from linmem.train.metrics import read_metrics

from . import tensor_checks, training_checks
from .launch import run_ranks
from .trainer_checks import DENSE_RUN

pytestmark = pytest.mark.usefixtures("one_thread")


def _two_ranks(out: str) -> None:
    tensor_checks.zoo_checks()
    tensor_checks.capacity_checks()
    training_checks.training_checks(ParallelConfig(tp=2, activation_checkpointing=True), str(Path(out) / "tp"))
    training_checks.training_checks(ParallelConfig(dp=2), str(Path(out) / "mom_dp"), tensor_checks.mom_hybrid())
    tensor_checks.trainer_run(str(Path(out) / "trainer"))


def _four_ranks(out: str) -> None:
    tensor_checks.mesh_checks()
    tensor_checks.zoo_checks()
    training_checks.training_checks(ParallelConfig(dp=2, tp=2), str(Path(out) / "dp_tp"))
    training_checks.training_checks(ParallelConfig(dp=2, tp=2), str(Path(out) / "mom"), tensor_checks.mom_hybrid())
    training_checks.training_checks(ParallelConfig(sp=2, tp=2), str(Path(out) / "sp_tp"))
    training_checks.training_checks(ParallelConfig(dp=2, ep=2, tp=2, fsdp=False), str(Path(out) / "ep_tp"))


def _losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]


def test_two_ranks(tmp_path: Path) -> None:
    reference = Trainer(load_config(overrides=[*DENSE_RUN, *tensor_checks.TRAINER_STEPS, "run.save_every=0",
                                               f"run.out_dir={tmp_path / 'one'}"])).train()
    run_ranks(2, _two_ranks, str(tmp_path))
    run = tmp_path / "trainer"
    losses, ref = _losses(run), [reference.losses[step] for step in sorted(reference.losses)]
    assert len(losses) == 2 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, ref)), \
        f"tp = 2: losses {losses}, one process {ref}"
    exported = LinmemForCausalLM.from_pretrained(run / "model")  # rank 0 gathered the split weights
    final = LinmemForCausalLM(exported.config)
    load_checkpoint(run / "checkpoints" / f"step_{2:08d}", model=final)  # the shards on one process
    for name, value in final.state_dict().items():
        assert torch.equal(value, exported.state_dict()[name]), f"model/ {name} differs from the last checkpoint"


def test_four_ranks(tmp_path: Path) -> None:
    run_ranks(4, _four_ranks, str(tmp_path))


def test_halves_to_blocks() -> None:
    run_ranks(4, tensor_checks.halves_checks)


def test_config_errors() -> None:
    with pytest.raises(ParallelConfigError, match=r"parallel.dp \* parallel.sp \* parallel.tp = 2 \* 1 \* 2 = 4 must"):
        ParallelConfig(dp=2, tp=2).validate(world_size=2)
    with pytest.raises(ParallelConfigError, match="parallel.tp must be an int >= 1, got 0"):
        ParallelConfig(tp=0).validate()


def test_every_mixer_is_planned() -> None:
    assert set(PLANS) == set(mixer_names())


def test_model_errors() -> None:
    tiny = dict(vocab_size=32, hidden_size=24, num_heads=6, layer_pattern="LN", intermediate_size=32)
    with pytest.raises(ParallelConfigError, match=r"must divide the heads of every layer: layer 0 \(gated_deltanet\) "
                                                  "has 6"):
        check_model(LinmemForCausalLM(LinmemConfig(**tiny)), ParallelConfig(tp=4))
    gqa = LinmemForCausalLM(LinmemConfig(**tiny, mixer=dict(num_kv_heads=3)))
    with pytest.raises(ParallelConfigError, match=r"KV heads of every layer: layer 1 \(softmax\) has 3"):
        check_model(gqa, ParallelConfig(tp=2))
    with pytest.raises(ParallelConfigError, match="hidden units: layer 0's intermediate_size is 32"):
        check_model(LinmemForCausalLM(LinmemConfig(**tiny)), ParallelConfig(tp=3))
    s4 = LinmemForCausalLM(LinmemConfig(**{**tiny, "num_heads": 3, "layer_pattern": "L"}, memory="s4"))  # 24 channels
    check_model(s4, ParallelConfig(tp=2))
    with pytest.raises(ParallelConfigError, match=r"must divide the channels of every layer: layer 0 \(s4\) has 24"):
        check_model(s4, ParallelConfig(tp=16))
    mamba = LinmemForCausalLM(LinmemConfig(**tiny, memory="mamba", mlp="moe", moe=dict(intermediate_size=16)))
    with pytest.raises(ParallelConfigError, match="hidden size 24 must be a multiple of 16"):  # [x; z] by halves
        check_model(mamba, ParallelConfig(dp=16, tp=2))
    moe = LinmemForCausalLM(LinmemConfig(**{**tiny, "num_heads": 4}, mlp="moe", moe=dict(intermediate_size=18)))
    with pytest.raises(ParallelConfigError, match="hidden units: layer 0's moe.intermediate_size is 18"):
        check_model(moe, ParallelConfig(tp=4))
    dense = LinmemForCausalLM(LinmemConfig(**{**tiny, "num_heads": 2}))
    with pytest.raises(ParallelConfigError, match=r"compiled blocks .* parallel.tp = 2"):
        check_model(dense, ParallelConfig(tp=2), compile_blocks=True)
    with pytest.raises(ParallelConfigError, match="hidden size 24 must be a multiple of 16"):
        check_model(dense, ParallelConfig(dp=16, tp=2))
