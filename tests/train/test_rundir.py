"""The run directory under faults and mistakes: a changed config, a finished run, a second run,
torn metrics, damaged manifests, leftovers of killed saves, no valid checkpoint, interruption."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from linmem.cli import main
from linmem.train import CheckpointError, ConfigError, Interrupted, RunError, Trainer, load_config
from linmem.train.checkpoint import list_checkpoints, verify_checkpoint
from linmem.train.config import read_config_file
from linmem.train.rundir import RunLock


TINY = ["data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=32",
        "data.mqar.eval_examples=8", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=LN",
        "schedule.steps=4", "schedule.warmup_steps=1", "run.save_every=2", "run.log_every=1",
        "run.progress=false", "run.tensorboard=false"]


def tiny(out_dir: Path, *extra: str):
    return load_config(overrides=[*TINY, f"run.out_dir={out_dir}", *extra])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished 4-step run (checkpoints at steps 2 and 4); tests work on copies of it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    Trainer(tiny(out)).train()
    return out


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def test_a_changed_config_is_refused_before_anything_is_touched(run_copy):
    before = _snapshot(run_copy)
    with pytest.raises(RunError, match=r"model.hidden_size \(saved 16, now 32\); optim.lr \(saved 0.003, now 0.001\)"):
        Trainer(tiny(run_copy, "optim.lr=1e-3", "model.hidden_size=32"))
    assert _snapshot(run_copy) == before


def test_a_finished_run_is_left_as_it_is_and_more_steps_continue_it(run_copy, capsys):
    before = _snapshot(run_copy)
    result = Trainer(tiny(run_copy)).train()
    assert result.already_finished and result.steps == 4 and "mqar_acc/L16_kv2" in result.metrics
    assert _snapshot(run_copy) == before  # no second evaluation line, no rewritten checkpoint
    assert main(["train", *TINY, f"run.out_dir={run_copy}"]) == 0
    assert "holds a finished run (4 steps); nothing to do" in capsys.readouterr().out
    assert _snapshot(run_copy) == before
    longer = Trainer(tiny(run_copy, "schedule.steps=6", "run.log_every=2")).train()  # resumable keys
    assert sorted(longer.losses) == [5, 6] and not longer.already_finished
    assert json.loads((run_copy / "finished.json").read_text())["step"] == 6


def test_resume_false_starts_over_and_the_final_evaluation_has_its_own_bar(run_copy, capsys, monkeypatch):
    monkeypatch.setattr("linmem.train.trainer.on_terminal", lambda: True)  # as in a terminal: bars, no lines
    overrides = ("optim.lr=1e-3", "run.resume=false", "run.save_every=0", "run.progress=true")
    result = Trainer(tiny(run_copy, *overrides)).train()
    assert sorted(result.losses) == [1, 2, 3, 4]
    out = capsys.readouterr()
    bars = out.err
    assert "eval" in bars and bars.rindex("train") < bars.index("eval")  # the training bar is closed first
    assert "step 1/4: loss" not in out.out and "step 4/4: mqar_acc/L16_kv2" in out.out  # the results, printed
    assert [p.name for p in list_checkpoints(run_copy / "checkpoints")] == ["step_00000004"]
    assert sorted(_losses(run_copy)) == [1, 2, 3, 4]


def test_a_second_run_is_refused_by_pid_and_a_stale_lock_taken_over(run_copy, caplog):
    config = tiny(run_copy, "schedule.steps=6")
    with RunLock(run_copy):
        with pytest.raises(RunError, match=f"in use by another linmem run \\(PID {os.getpid()}\\)"):
            Trainer(config).train()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_copy / ".lock").write_text(f"{dead.pid}\n")
    with caplog.at_level(logging.WARNING, logger="linmem.train"):
        assert Trainer(config).train().steps == 6
    assert f"lock left by process {dead.pid}" in caplog.text
    assert (run_copy / ".lock").read_text() == ""  # released


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(run_copy, caplog):
    shutil.rmtree(run_copy / "checkpoints" / "step_00000004")
    (run_copy / "finished.json").unlink()
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # power loss in the middle of a line
    with caplog.at_level(logging.WARNING, logger="linmem.train"):
        result = Trainer(tiny(run_copy)).train()
    assert sorted(result.losses) == [3, 4] and "torn last line" in caplog.text
    assert sorted(_losses(run_copy)) == [1, 2, 3, 4]


def test_damaged_checkpoints_and_leftovers_of_killed_saves(run_copy, caplog):
    ckpts = list_checkpoints(run_copy / "checkpoints")
    (ckpts[-1] / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"lists \[\], expected \['model.safetensors'"):
        verify_checkpoint(ckpts[-1])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = (run_copy / "checkpoints" / f".step_00000006.tmp-{pid}" for pid in (dead.pid, os.getppid()))
    stale.mkdir()
    live.mkdir()
    weights = ckpts[0] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    (run_copy / "finished.json").unlink()
    with pytest.raises(CheckpointError) as error:  # every checkpoint fails: refused, nothing truncated
        Trainer(tiny(run_copy, "schedule.steps=6")).train()
    message = str(error.value)
    assert "step_00000002: model.safetensors is truncated" in message
    assert "step_00000004: manifest.json lists []" in message and "run.resume=false" in message
    assert not stale.exists() and live.exists()  # the dead process's temporary folder is gone
    assert sorted(_losses(run_copy)) == [1, 2, 3, 4]
    result = Trainer(tiny(run_copy, "run.resume=false", "run.save_every=0")).train()
    assert sorted(result.losses) == [1, 2, 3, 4]


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path, monkeypatch, capsys):
    """The first signal ends the current step, saves, and the command exits 128 + signal with one line."""
    original = Trainer._optimizer_step

    def signalled(self, batches):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 3
        return original(self, batches)

    monkeypatch.setattr(Trainer, "_optimizer_step", signalled)
    assert main(["train", *TINY, "schedule.steps=8", "run.save_every=0", f"run.out_dir={tmp_path / 'run'}"]) == 143
    err = capsys.readouterr().err
    assert "interrupted at step 3, checkpoint saved; run the same command to resume" in err
    assert "Traceback" not in err
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000003"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    with pytest.raises(Interrupted):
        Trainer(tiny(tmp_path / "again", "schedule.steps=8", "run.save_every=0")).train()


def test_config_mistakes_are_named(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"model.options.mixer.windw' \(did you mean 'window'\?\); valid: .*window"):
        tiny(tmp_path, "model.options.mixer.windw=16")
    with pytest.raises(ConfigError, match=r"model.options.mixr' \(did you mean 'mixer'\?\); valid: .*mixer"):
        tiny(tmp_path, "model.options.mixr.window=16")
    with pytest.raises(ConfigError, match=r"model.options.window' \(a mixer option: set model.options.mixer.window\)"):
        tiny(tmp_path, "model.options.window=16")
    with pytest.raises(ConfigError, match="model.mom_top_k' \\(a mixer option: set model.options.mom.top_k\\)"):
        tiny(tmp_path, "model.mom_top_k=1")
    with pytest.raises(ConfigError, match="set it as model.options.mlp"):
        tiny(tmp_path, "model.mlp=moe")
    with pytest.raises(ConfigError, match=r"warmup_steps \(9\) must be <= schedule.steps \(4\)"):
        tiny(tmp_path, "schedule.warmup_steps=9")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's 2 processes, a parallel section of 1
    with pytest.raises(ValueError, match=r"parallel.dp \* parallel.sp = 1 \* 1 = 1 must equal the number of processes"):
        Trainer(tiny(tmp_path))
    monkeypatch.delenv("WORLD_SIZE")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            Trainer(tiny(tmp_path, "run.device=cuda"))


def test_a_run_saved_with_flat_mixer_options_loads_them_into_their_sections(tmp_path):
    """config.yaml of a run made before the config's sections holds the mixer options flat in model.options."""
    path = tmp_path / "config.yaml"
    path.write_text("model:\n  memory: mom\n  options:\n    mom_top_k: 1\n    window: 8\n    mlp: swiglu\n")
    config = load_config(str(path))
    assert config.model.options == {"mlp": "swiglu", "mom": {"top_k": 1}, "mixer": {"window": 8}}
    assert read_config_file(path)["model"]["options"] == config.model.options
