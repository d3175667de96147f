"""dev/gpu/records/bayes_distill.py at a tiny size on the CPU: one seed's pipeline trains a Gated DeltaNet on MQAR,
converts it, fine-tunes both and scores all four on the same held-out examples; the table spreads over seeds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from linmem.models import LinmemForCausalLM

SCRIPT = Path(__file__).resolve().parents[2] / "dev" / "gpu" / "records" / "bayes_distill.py"
spec = importlib.util.spec_from_file_location("bayes_distill", SCRIPT)
distill = importlib.util.module_from_spec(spec)
sys.modules["bayes_distill"] = distill  # dataclasses look their module up there
spec.loader.exec_module(distill)

TINY = distill.Preset("update-mqar-gated_deltanet", (
    "model.hidden_size=16", "data.mqar.train_examples=16", "data.mqar.eval_examples=8", "data.batch_size=4",
    "data.mqar.settings=[[16,1],[32,2]]", "data.mqar.eval_settings=[[32,2],[64,4]]"),
    source_steps=3, finetune_steps=2, finetune_lr=1e-3)


def test_one_seed_scores_the_source_the_converted_model_and_both_fine_tuned(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setitem(distill.PRESETS, ("mqar", "smoke"), TINY)
    try:
        distill.pipeline(tmp_path, "mqar", "smoke", 0, "cpu")
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "result.json").read_text())
    assert list(record["models"]) == list(distill.MODELS)
    for metrics in record["models"].values():
        assert set(metrics) == {"mqar_acc/L32_kv2", "mqar_acc/L64_kv4"}
    assert record["conversion"]["initialised"] == [f"model.layers.{i}.mixer.{leaf}" for i in (0, 1)
                                                   for leaf in ("obs_noise_raw", "process_noise_raw")]
    converted = LinmemForCausalLM.from_pretrained(tmp_path / "converted")
    tuned = LinmemForCausalLM.from_pretrained(tmp_path / "converted_ft" / "model")
    assert converted.config.memory == tuned.config.memory == "bayes"
    assert not torch.equal(converted.lm_head.weight, tuned.lm_head.weight)  # the fine-tuning trained it
    source = LinmemForCausalLM.from_pretrained(tmp_path / "source" / "model")
    assert torch.equal(source.lm_head.weight, converted.lm_head.weight)

    other = json.loads(json.dumps(record))
    other["seed"] = 1
    other["models"]["source"]["mqar_acc/L32_kv2"] += 0.5
    del other["models"]["converted+ft"]  # a seed the budget stopped before its last model
    rows = {(r["model"], r["metric"]): r for r in distill.table([record, other])}
    row = rows[("source", "mqar_acc/L32_kv2")]
    assert row["seeds"] == [0, 1] and math.isclose(row["max"] - row["min"], 0.5)
    assert rows[("converted+ft", "mqar_acc/L32_kv2")]["seeds"] == [0]
    table = distill.markdown(distill.table([record, other]))
    assert "| converted+ft | 1 |" in table and "| source | 2 |" in table
