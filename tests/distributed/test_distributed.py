"""Parallel training on CPU (gloo): 2 and 4 processes started from pytest, many checks per job.

* sequence parallelism: the recurrence for every decay kind x rule (+ RWKV-6 bonus), fixed-length
  and packed rows crossing ranks, softmax / sliding-window / FoX attention, the convolution halo:
  outputs, final states and every gradient equal the one-process run (fp64, error ratio < 1e-9);
* expert parallelism: outputs, routing losses and every gradient equal the one-process MoE;
* training: FSDP2 (+ expert and sequence parallelism, activation checkpointing) has the
  one-process loss curve within 1e-4, resumes exactly from its DCP checkpoint, resumes from the
  other world size's checkpoint, and exports weights that ``from_pretrained`` loads.

The checks without processes (configuration errors, batch sharding) run here directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
from linmem.train.data import ExampleBatches

from . import expert_checks, model_checks, sequence_checks, training_checks
from .launch import run_ranks


def _four_ranks(out: str) -> None:
    sequence_checks.all_sequence_checks()
    expert_checks.all_expert_checks()
    training_checks.training_checks(ParallelConfig(dp=2, sp=2, ep=2, fsdp=False), out)


def _two_ranks(out: str, resume_from: str) -> None:
    sequence_checks.all_sequence_checks()
    sequence_checks.argument_checks()
    expert_checks.all_expert_checks()
    training_checks.training_checks(ParallelConfig(dp=2, ep=2, activation_checkpointing=True), out, resume_from)


@pytest.fixture(scope="module")
def four_rank_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("four_ranks")
    run_ranks(4, _four_ranks, str(out))
    return out / "world4"


def test_four_ranks(four_rank_checkpoint: Path) -> None:
    assert (four_rank_checkpoint / "trainer_state.json").is_file()


def test_two_ranks(four_rank_checkpoint: Path, tmp_path: Path) -> None:
    run_ranks(2, _two_ranks, str(tmp_path), str(four_rank_checkpoint))


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
    capped = LinmemForCausalLM(LinmemConfig(**tiny, mlp="moe", num_experts=4, moe_capacity_factor=1.0))
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
                                           attention="fox", kv_shift=True))
    with parallel.sequence_parallel(recorder):
        model(torch.randint(0, 32, (1, 8)), use_cache=False)
    missing = {"linear_recurrence", "attention", "halo"} - recorder.consulted
    if missing:
        pytest.skip(f"the layers do not consult linmem.ops.parallel for {sorted(missing)}, so whole models cannot "
                    "run sequence-parallel (the ops are checked by the two- and four-rank jobs)")
    run_ranks(2, model_checks.model_checks)
    run_ranks(4, model_checks.model_checks)
