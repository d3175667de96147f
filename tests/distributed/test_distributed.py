"""Parallel training on CPU (gloo): 2 and 4 processes started from pytest, many checks per job.

* sequence parallelism: the recurrence for every decay kind x rule (+ RWKV-6 bonus), fixed-length
  and packed rows crossing ranks, softmax / sliding-window / FoX attention, the convolution halo:
  outputs, final states and every gradient equal the one-process run (fp64, error ratio < 1e-9);
* expert parallelism: outputs, routing losses and every gradient equal the one-process MoE;
* training: FSDP2 (+ expert and sequence parallelism, activation checkpointing) has the
  one-process first gradients and loss curve within 1e-4 and resumes exactly from its DCP checkpoint;
* the trainer (``linmem train`` on every rank, as torchrun starts it): dp = 2 on 2 ranks and
  dp = 2 x sp = 2 with ep = 2 on 4 have the loss curve of one process on the same global batch,
  a run stopped by Ctrl-C on one rank resumes exactly, the 4-rank checkpoint continues on 2 ranks,
  a one-process checkpoint continues on 2 ranks and theirs on one process again, and ``model/``
  loads with ``from_pretrained``.

The checks without processes (configuration errors, batch sharding) run here directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from linmem import cli
from linmem.distributed import (
    DataParallelBatches,
    ParallelConfig,
    ParallelConfigError,
    PieceLayout,
    SequenceParallel,
    build_mesh,
    check_model,
    next_token_targets,
    shard_sequence,
    split_packing,
)
from linmem.distributed.attention import causal_attention_lower_right
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.ops import linear_recurrence, parallel
from linmem.ops.attention import cached_attention, forgetting_attention
from linmem.train import ConfigError, Trainer, load_config
from linmem.train.checkpoint import load_checkpoint
from linmem.data.batches import ExampleBatches
from linmem.train.metrics import read_metrics
from linmem.train.rundir import RunLock
from linmem.train.trainer import check_launch

from . import expert_checks, model_checks, sequence_checks, trainer_checks, training_checks
from .launch import run_ranks
from .trainer_checks import BATCH, DENSE_RUN, DP, MOE, MOE_RUN, SAVE_EVERY, STEPS, text_run


def _four_ranks(out: str, corpus: str) -> None:
    sequence_checks.all_sequence_checks()
    expert_checks.all_expert_checks()
    training_checks.training_checks(ParallelConfig(dp=2, sp=2, ep=2, fsdp=False), out)
    trainer_checks.four_ranks(Path(out), Path(corpus))


def _two_ranks(out: str, from_four: str, dense_cut: str, busy: str) -> None:
    sequence_checks.all_sequence_checks()
    sequence_checks.argument_checks()
    expert_checks.all_expert_checks()
    training_checks.training_checks(ParallelConfig(dp=2, ep=2, activation_checkpointing=True, blocks_per_unit=2), out)
    training_checks.compile_check()
    trainer_checks.two_ranks(Path(out), Path(from_four), Path(dense_cut), Path(busy))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models train on one thread, as every rank of the jobs does (several threads on a busy machine wait
    on each other far longer than they compute)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _one_process(out_dir: Path, *overrides: str, stop_at=None) -> list[float]:
    result = Trainer(load_config(overrides=[*overrides, f"run.out_dir={out_dir}"])).train(stop_at=stop_at)
    return [result.losses[step] for step in sorted(result.losses)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    """The one-process runs the parallel ones are compared with (trained before the jobs start, whose
    processes then inherit the modules these runs imported): their loss curves and the text corpus."""
    out = tmp_path_factory.mktemp("one_process")
    (out / "corpus").mkdir()
    for i in range(6):  # documents of 40 to 90 bytes
        (out / "corpus" / f"{i}.txt").write_text(" ".join(f"w{i}{j}" for j in range(10 + 4 * i)))
    return {
        "corpus": out / "corpus",
        "moe": _one_process(out / "moe", *MOE_RUN, f"data.batch_size={DP * BATCH}", "run.save_every=0"),
        "text": _one_process(out / "text", *text_run(out / "corpus"), f"schedule.grad_accum={DP}", "run.save_every=0"),
        "dense": _one_process(out / "dense", *DENSE_RUN, f"schedule.grad_accum={DP}", "run.save_every=0"),
    }


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, one_process: dict[str, Any]) -> Path:
    out = tmp_path_factory.mktemp("four_ranks")
    run_ranks(4, _four_ranks, str(out), str(one_process["corpus"]))
    return out


def _losses(run_dir: Path) -> list[float]:
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), f"{run_dir}: logged steps"
    return [row["loss"] for row in rows]


def _assert_curve(got: list[float], ref: list[float], what: str) -> None:
    for step, (a, b) in enumerate(zip(got, ref), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"{what}: step {step} loss {a:.8f}, one process {b:.8f}"


def test_four_ranks(four_ranks: Path, one_process: dict[str, Any]) -> None:
    assert (four_ranks / "world4" / "trainer_state.json").is_file()
    # the trainer on dp 2 x sp 2 has the curve of one process on the same global batch
    run = four_ranks / "four"
    _assert_curve(_losses(run), one_process["moe"], "MoE on 4 ranks (dp 2, sp 2, ep 2)")
    _assert_curve(_losses(four_ranks / "text"), one_process["text"], "packed rows on 4 ranks (dp 2, sp 2)")
    assert json.loads((run / "finished.json").read_text())["step"] == STEPS
    exported = LinmemForCausalLM.from_pretrained(run / "model")  # rank 0 wrote the last weights
    final = LinmemForCausalLM(exported.config)
    load_checkpoint(run / "checkpoints" / f"step_{STEPS:08d}", model=final)  # its shards on one process
    for name, value in final.state_dict().items():
        assert torch.equal(value, exported.state_dict()[name]), f"model/ {name} differs from the last checkpoint"


def test_two_ranks(four_ranks: Path, one_process: dict[str, Any], tmp_path: Path) -> None:
    from_four = tmp_path / "from_four"  # the 4-rank run as if it had stopped after its first checkpoint
    shutil.copytree(four_ranks / "four", from_four)
    shutil.rmtree(from_four / "checkpoints" / f"step_{STEPS:08d}")
    (from_four / "finished.json").unlink()
    dense = [*DENSE_RUN, f"schedule.grad_accum={DP}", f"run.out_dir={tmp_path / 'dense'}"]
    Trainer(load_config(overrides=dense)).train(stop_at=SAVE_EVERY)  # one process, stopped after step 2
    with RunLock(tmp_path / "busy"):  # as if another run trained there
        run_ranks(2, _two_ranks, str(tmp_path), str(from_four), str(tmp_path / "dense"), str(tmp_path / "busy"))

    whole = _losses(tmp_path / "whole")
    _assert_curve(whole, one_process["moe"], "MoE on 2 ranks (dp 2)")
    assert _losses(tmp_path / "cut") == whole, "the run stopped by Ctrl-C did not resume exactly"
    _assert_curve(_losses(from_four), one_process["moe"], "4 ranks, then 2 from the 4-rank checkpoint")
    # the dense run: steps 1-2 on one process, 3 on two ranks (stopped by Ctrl-C), 4 on one process again
    assert list(Trainer(load_config(overrides=dense)).train().losses) == [STEPS]
    _assert_curve(_losses(tmp_path / "dense"), one_process["dense"], "1 process, then 2 ranks, then 1 process")


def test_trainer_refuses_layouts_before_any_work(tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "never"

    def launch(world: int, *overrides: str, env: bool = True) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if env:
                monkeypatch.setenv(name, "0")
            else:
                monkeypatch.delenv(name, raising=False)
        Trainer(load_config(overrides=[*DENSE_RUN, f"run.out_dir={out}", *overrides]))

    with pytest.raises(ParallelConfigError, match=r"parallel.dp \* parallel.sp = 2 \* 1 = 2 must equal .* 4"):
        launch(4, "parallel.dp=2")
    with pytest.raises(ParallelConfigError, match="parallel.sp = 3 must divide the sequence length 16"):
        launch(3, "parallel.sp=3")
    with pytest.raises(ParallelConfigError, match="parallel.ep = 2 needs MoE feed-forwards"):
        launch(2, "parallel.dp=2", "parallel.ep=2")
    with pytest.raises(ParallelConfigError, match="parallel.ep = 4 must divide the number of experts 6"):
        launch(4, "parallel.dp=4", "parallel.ep=4", *MOE, "model.options.moe.num_experts=6")
    with pytest.raises(ConfigError, match="every rank takes its own device"):
        launch(2, "parallel.dp=2", "run.device=cuda:1")
    with pytest.raises(ParallelConfigError, match=r"compiled blocks .* got parallel.sp = 2 and 0 MoE layers"):
        launch(2, "parallel.sp=2", "run.compile=true")
    with pytest.raises(ParallelConfigError, match=r"compiled blocks .* got parallel.sp = 1 and 2 MoE layers"):
        launch(2, "parallel.dp=2", "run.compile=true", *MOE)
    with pytest.raises(ParallelConfigError, match="no process group to join"):
        launch(2, "parallel.dp=2", env=False)
    with pytest.raises(ParallelConfigError, match="parallel.dp must be an int >= 1, got 0"):
        launch(1, "parallel.dp=0")
    with pytest.raises(ParallelConfigError, match="parallel.timeout_minutes must be a number > 0"):
        launch(1, "parallel.timeout_minutes=0")
    with pytest.raises(ParallelConfigError, match="parallel.blocks_per_unit must be an int >= 1, got 0"):
        launch(1, "parallel.blocks_per_unit=0")
    assert not out.exists()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.main(["train", *DENSE_RUN, "parallel.dp=3", f"run.out_dir={out}"]) == 2
    assert "linmem: error: parallel.dp * parallel.sp = 3 * 1 = 3 must equal" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: a parallel section is refused, with the launch to use
    with pytest.raises(ParallelConfigError, match="launch with torchrun --nproc-per-node 2 -m linmem.cli train"):
        check_launch(load_config(overrides=["parallel.dp=2"]))
    assert cli.main(["train", *DENSE_RUN, "parallel.sp=2", f"run.out_dir={out}"]) == 2
    assert "processes launched, 1: launch with torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert not out.exists()


def test_the_package_loads_its_names_on_first_use() -> None:
    """``import linmem.distributed.config`` (the config section) needs no torch, and ``parallelize`` is the
    function however its names are first asked for, though its module has the same name."""
    code = ("import sys\nimport linmem.distributed.config\nprint('torch' in sys.modules)\n"
            "from linmem.distributed import check_model, parallelize\nprint(callable(parallelize), "
            "type(parallelize).__name__)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split() == ["False", "True", "function"], done.stdout + done.stderr


def test_config_errors() -> None:
    with pytest.raises(ParallelConfigError, match="must equal the number of processes"):
        ParallelConfig(dp=2, sp=2).validate(world_size=2)
    with pytest.raises(ParallelConfigError, match="must divide parallel.dp"):
        ParallelConfig(dp=2, ep=4).validate()
    with pytest.raises(ParallelConfigError, match="divide the sequence length"):
        ParallelConfig(dp=1, sp=4).validate(seq_len=30)
    with pytest.raises(ParallelConfigError, match="divide the number of experts"):
        ParallelConfig(dp=4, ep=4).validate(num_experts=6)
    with pytest.raises(ParallelConfigError, match="int >= 1"):
        ParallelConfig(sp=0).validate()
    with pytest.raises(ParallelConfigError, match="no process group"):
        build_mesh(ParallelConfig())


def test_model_errors() -> None:
    tiny = dict(vocab_size=32, hidden_size=16, num_heads=2, layer_pattern="L")
    dense = LinmemForCausalLM(LinmemConfig(**tiny))
    with pytest.raises(ParallelConfigError, match="needs MoE feed-forwards"):
        check_model(dense, ParallelConfig(dp=2, ep=2))
    mom = LinmemForCausalLM(LinmemConfig(**tiny, memory="mom"))
    with pytest.raises(ParallelConfigError, match="mixtures of memories"):
        check_model(mom, ParallelConfig(sp=2))
    capped = LinmemForCausalLM(LinmemConfig(**tiny, mlp="moe", moe=dict(num_experts=4, capacity_factor=1.0)))
    with pytest.raises(ParallelConfigError, match="dropless"):
        check_model(capped, ParallelConfig(dp=2, ep=2))
    with pytest.raises(ParallelConfigError, match="divide the number of experts"):
        check_model(capped, ParallelConfig(dp=8, ep=8))


def test_batch_sharding() -> None:
    assert next_token_targets(torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.tensor([0, 4, 6])).tolist() == \
        [[2, 3, 4, -100, 6, -100]]
    pieces = [split_packing(torch.tensor([0, 2, 9, 12]), 12, r, 3) for r in range(3)]
    assert [(cu.tolist(), prefix) for cu, prefix in pieces] == [([0, 2, 4], 0), ([0, 4], 2), ([0, 1, 4], 6)]
    ids = torch.arange(12)[None]
    piece, layout = shard_sequence({"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, 2, 9, 12])}, 2, 3)
    assert piece["position_ids"].tolist() == [[6, 0, 1, 2]] and piece["targets"].tolist() == [[-100, 10, 11, -100]]
    assert layout == PieceLayout(prefix_length=6, num_segments=2, first_length=1, last_start=1, varlen=True)
    with pytest.raises(ValueError, match="multiple of the 5"):
        shard_sequence({"input_ids": ids, "labels": ids}, 0, 5)
    x = torch.arange(24).view(12, 2)
    source = ExampleBatches(x, x, 3, seed=0)
    expected = [next(source)["input_ids"] for _ in range(4)]
    ranks = [DataParallelBatches(ExampleBatches(x, x, 3, seed=0), rank=r, size=2) for r in range(2)]
    got = [next(ranks[r])["input_ids"] for _ in range(2) for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, [expected[0], expected[1], expected[2], expected[3]]))


def test_lower_right_causal_attention() -> None:
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 5)
    ref = cached_attention(q, k, v)
    assert torch.allclose(causal_attention_lower_right(q, k, v), ref, atol=1e-5)


def test_handler_hook() -> None:
    assert parallel.sequence_handler() is None
    layout = PieceLayout(prefix_length=4, num_segments=1, first_length=4, last_start=0, varlen=False)
    handler = SequenceParallel(object(), layout, None)
    with parallel.sequence_parallel(handler):
        assert parallel.sequence_handler() is handler
        with parallel.local_ops():
            assert parallel.sequence_handler() is None
        with pytest.raises(RuntimeError, match="do not nest"):
            with parallel.sequence_parallel(handler):
                pass
        with pytest.raises(ValueError, match="not this batch piece"):  # e.g. a mixture of memories' segments
            handler.linear_recurrence(torch.randn(1, 6, 1, 2), torch.randn(1, 6, 1, 2), torch.randn(1, 6, 1, 2),
                                      cu_seqlens=torch.tensor([0, 6]))
    assert parallel.sequence_handler() is None


class _Recorder:
    """A sequence handler for one process that runs the ops locally and records which the layers consulted."""

    def __init__(self) -> None:
        self.consulted: set[str] = set()

    def linear_recurrence(self, q, k, v, **kwargs):
        self.consulted.add("linear_recurrence")
        with parallel.local_ops():
            return linear_recurrence(q, k, v, **kwargs)

    def attention(self, q, k, v, **kwargs):
        self.consulted.add("attention")
        with parallel.local_ops():
            return forgetting_attention(q, k, v, **kwargs)

    def halo(self, x, size, cu_seqlens):
        self.consulted.add("halo")
        return x.new_zeros(x.shape[0], size, *x.shape[2:])


def test_model_sequence_parallel() -> None:
    recorder = _Recorder()
    model = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=16, num_heads=2, layer_pattern="LN",
                                           attention="fox", mixer=dict(kv_shift=True)))
    with parallel.sequence_parallel(recorder):
        model(torch.randint(0, 32, (1, 8)), use_cache=False)
    missing = {"linear_recurrence", "attention", "halo"} - recorder.consulted
    assert not missing, f"the layers do not consult linmem.ops.parallel for {sorted(missing)}"
    run_ranks(2, model_checks.model_checks)
    run_ranks(4, model_checks.model_checks)


def test_one_process_activation_checkpointing(tmp_path: Path) -> None:
    """On one process ``parallel.activation_checkpointing`` recomputes every block in the backward pass
    (its mixer runs twice in a step) and trains exactly as without."""
    steps = {}
    for checkpointed in (False, True):
        trainer = Trainer(load_config(overrides=[*DENSE_RUN, f"parallel.activation_checkpointing={checkpointed}",
                                                 f"run.out_dir={tmp_path}"]))
        calls = []
        trainer.model.model.layers[0].mixer.register_forward_hook(lambda *args: calls.append(1))
        loss, grad_norm, _ = trainer._optimizer_step(iter(trainer.batches))
        steps[checkpointed] = loss, grad_norm, len(calls), [p.detach().clone() for p in trainer.model.parameters()]
    (loss, grad_norm, calls, weights), (loss_ac, grad_norm_ac, calls_ac, weights_ac) = steps[False], steps[True]
    assert (loss_ac, grad_norm_ac) == (loss, grad_norm) and all(map(torch.equal, weights_ac, weights))
    assert (calls, calls_ac) == (1, 2)
