"""Regional compilation: blocks of one kind share their compiled code, the compiled step computes what the eager one
does, and the run says which mode ran and how long it compiled."""

from __future__ import annotations

import json

import torch
from torch._dynamo.utils import counters

from linmem.train import Trainer, load_config


def tiny_attention_run(out_dir, *extra: str):
    """Attention blocks only: the cheapest blocks to compile on a CPU."""
    return load_config(overrides=[
        "data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=32",
        "data.mqar.eval_examples=8", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=NNNN",
        "schedule.steps=2", "schedule.warmup_steps=1", "run.log_every=1", "run.progress=false",
        "run.tensorboard=false", f"run.out_dir={out_dir}", *extra,
    ])


def test_compiled_blocks_train_as_eager_ones_with_one_graph_per_block_kind(tmp_path, monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # run.compile_cache sets them: restored after
        monkeypatch.delenv(name, raising=False)
    eager = Trainer(tiny_attention_run(tmp_path / "eager")).train()
    torch._dynamo.reset()
    counters.clear()
    compiled_trainer = Trainer(tiny_attention_run(tmp_path / "compiled", "run.compile=true",
                                                  f"run.compile_cache={tmp_path / 'cache'}"))
    compiled = compiled_trainer.train()
    # four blocks, two forward graphs: the first block (no residual stream yet) and the three after it
    assert counters["stats"]["unique_graphs"] <= 2
    for step in (1, 2):
        assert abs(compiled.losses[step] - eager.losses[step]) < 1e-4 * abs(eager.losses[step]), step
    rows = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "mode": "compiled"}
    assert rows[1]["compile_s"] > 0 and rows[1]["compiled_graphs"] >= 2
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").iterdir())
    eager_rows = [json.loads(line) for line in (tmp_path / "eager" / "metrics.jsonl").read_text().splitlines()]
    assert eager_rows[0] == {"step": 0, "mode": "eager"} and "compile_s" not in eager_rows[1]  # null: eager on CPU
    torch._dynamo.reset()
