"""The trainer: exact resume, refusal of corrupt checkpoints, skipped non-finite steps,
configs from YAML / recipes / overrides, recipes shipped inside the package."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from linmem.train import CheckpointError, ConfigError, Trainer, load_config
from linmem.train.checkpoint import latest_valid_checkpoint, list_checkpoints, load_checkpoint
from linmem.train.config import recipe_names


def tiny_mqar(out_dir: Path, *extra: str):
    return load_config(overrides=[
        "data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=64",
        "data.mqar.eval_examples=16", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=LN",
        "schedule.steps=12", "schedule.warmup_steps=2", "run.save_every=4", "run.log_every=1",
        "run.progress=false", "run.tensorboard=false", f"run.out_dir={out_dir}", *extra,
    ])


def test_resume_after_interruption_reproduces_the_losses(tmp_path):
    whole = Trainer(tiny_mqar(tmp_path / "whole")).train()
    assert sorted(whole.losses) == list(range(1, 13))
    first = Trainer(tiny_mqar(tmp_path / "cut")).train(stop_at=10)  # "crash" after step 10, last checkpoint at 8
    assert first.steps == 10
    resumed = Trainer(tiny_mqar(tmp_path / "cut")).train()
    assert sorted(resumed.losses) == list(range(9, 13))
    for step in range(9, 13):
        assert resumed.losses[step] == whole.losses[step], f"step {step}"
    metric_steps = [line for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(metric_steps) == 12  # the lines of the crashed steps 9-10 were replaced, not duplicated


def test_off_a_terminal_each_log_step_prints_a_line_and_tok_s_is_the_last_window(tmp_path, capsys, monkeypatch):
    step = Trainer._optimizer_step

    def slow_first_step(self, batches):
        if self.step == 0:
            time.sleep(1.0)  # a slow start (compilation, warm-up) that the cumulative rate keeps
        return step(self, batches)

    monkeypatch.setattr(Trainer, "_optimizer_step", slow_first_step)
    Trainer(tiny_mqar(tmp_path, "schedule.steps=4", "run.log_every=2", "run.eval_every=2")).train()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "\r" not in out
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 2/4", "step 4/4", "step 4/4"]
    assert lines[0].startswith("step 2/4: loss") and "tok_s" in lines[0]
    assert lines[1].startswith("step 2/4: mqar_acc/L16_kv2") and lines[3].startswith("step 4/4: mqar_acc/L16_kv2")
    rows = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "tok_s" in row]
    assert rows[1]["tok_s"] > 2 * rows[1]["tok_s_cumulative"]  # steps 3-4 alone, against steps 1-4


def test_truncated_or_corrupted_checkpoint_is_refused_and_the_previous_survives(tmp_path, caplog):
    Trainer(tiny_mqar(tmp_path / "run", "schedule.steps=8")).train()
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000004", "step_00000008"]
    weights = ckpts[-1] / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    trainer = Trainer(tiny_mqar(tmp_path / "run", "schedule.steps=8"))
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(ckpts[-1], model=trainer.model)
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(ckpts[-1], model=trainer.model)
    with caplog.at_level(logging.WARNING, logger="linmem.train"):
        assert latest_valid_checkpoint(tmp_path / "run" / "checkpoints") == ckpts[0]
    assert "corrupted" in caplog.text and ckpts[0].exists()
    (tmp_path / "run" / "finished.json").unlink()  # as if the process died in its final evaluation
    result = Trainer(tiny_mqar(tmp_path / "run", "schedule.steps=8")).train()
    assert sorted(result.losses) == [5, 6, 7, 8]  # resumed from the surviving step-4 checkpoint


def test_half_written_checkpoint_is_ignored(tmp_path):
    Trainer(tiny_mqar(tmp_path / "run", "schedule.steps=4")).train()
    partial = tmp_path / "run" / "checkpoints" / "step_00000099"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert latest_valid_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000004"


def test_non_finite_steps_are_skipped_and_counted(tmp_path, monkeypatch):
    trainer = Trainer(tiny_mqar(tmp_path / "nan", "schedule.steps=3", "run.save_every=0"))
    original = trainer._micro_step
    calls = {"n": 0}

    def poisoned(*args):
        calls["n"] += 1
        loss = original(*args)
        if calls["n"] == 2:
            for p in trainer.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return loss

    monkeypatch.setattr(trainer, "_micro_step", poisoned)
    trainer.train()
    assert trainer.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_config_sources_and_errors(tmp_path):
    for recipe in recipe_names():
        load_config(recipe=recipe)  # every shipped recipe validates
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  memory: gla\nschedule:\n  steps: 7\n")
    cfg = load_config(str(path), overrides=["schedule.steps=9", "schedule.warmup_steps=2"])
    assert cfg.model.memory == "gla" and cfg.schedule.steps == 9
    path.write_text("model:\n  memroy: gla\n")
    with pytest.raises(ConfigError, match="memroy.*did you mean 'memory'.*valid: recipe, hidden_size"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="valid: .*mqar-attention"):
        load_config(recipe="nope")
    with pytest.raises(ConfigError, match="schedule.steps"):
        load_config(overrides=["schedule.steps=0"])


def test_recipes_ship_inside_the_package():
    import linmem

    folder = Path(linmem.__file__).parent / "recipes"
    assert sorted(p.stem for p in folder.glob("*.yaml")) == recipe_names() and len(recipe_names()) >= 4
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'linmem = ["recipes/*.yaml"]' in pyproject  # package data: installed wheels carry them
