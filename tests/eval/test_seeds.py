"""Recipes over seeds (``linmem.eval.seeds``): a recipe at two seeds trains as two parallel processes on the CPU, and
the table holds the spread of what their metrics.jsonl files say; the deadline stops running processes and skips the
rest; the common step is the last evaluation every run reached; each process sees its share of GPUs and threads."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from linmem.eval.seeds import (RunEvals, Spread, common_step, main, process_env, run_processes, seed_table,
                               train_seeds, write_report)
from linmem.train.config import ConfigError

TINY = ["model.hidden_size=16", "data.mqar.train_examples=16", "data.mqar.eval_examples=8", "data.batch_size=4",
        "data.mqar.settings=[[16,1],[32,2]]", "data.mqar.eval_settings=[[32,2],[64,4]]", "schedule.steps=4",
        "schedule.warmup_steps=1", "run.eval_every=2", "run.save_every=0", "run.log_every=1", "run.device=cpu"]
RECIPES = ["update-mqar-gated_deltanet"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_recipe_at_two_seeds_gives_the_spread_of_its_metrics(tmp_path, capsys):
    assert main(["--recipes", ",".join(RECIPES), "--seeds", "0,1", "--out", str(tmp_path), "--jobs", "2", *TINY]) == 0
    report = json.loads((tmp_path / "seeds.json").read_text())
    assert [(r["recipe"], r["seed"], r["status"], r["steps"]) for r in report["runs"]] == \
        [(recipe, seed, "ok", 4) for recipe in RECIPES for seed in (0, 1)]
    rows = {(row["recipe"], row["metric"]): row for row in report["table"]}
    assert sorted(rows) == sorted((r, f"mqar_acc/L{L}_kv{kv}") for r in RECIPES for L, kv in ((32, 2), (64, 4)))
    for recipe in RECIPES:
        runs = [metrics(tmp_path / "runs" / f"{recipe}-s{seed}") for seed in (0, 1)]
        first_loss = [next(row["loss"] for row in rows_ if "loss" in row) for rows_ in runs]
        assert first_loss[0] != first_loss[1]  # run.seed reached the model's initialisation
        for metric in ("mqar_acc/L32_kv2", "mqar_acc/L64_kv4"):
            evals = [[row[metric] for row in rows_ if metric in row] for rows_ in runs]
            assert all(len(e) == 2 for e in evals)  # at steps 2 and 4
            final, best = [e[-1] for e in evals], [max(e) for e in evals]
            row = rows[(recipe, metric)]
            assert row["seeds"] == [0, 1] and row["common_step"] == 4
            assert math.isclose(row["final"]["mean"], sum(final) / 2) and row["final"]["min"] == min(final)
            assert math.isclose(row["final"]["std"], abs(final[0] - final[1]) / math.sqrt(2))
            assert math.isclose(row["best"]["mean"], sum(best) / 2) and row["at_common_step"] == row["final"]
    table = (tmp_path / "seeds.md").read_text()
    assert table.count("| update-mqar-") == 2 and "sample standard deviation" in table
    assert (tmp_path / "seeds.png").stat().st_size > 0 and "written:" in capsys.readouterr().out


def test_the_deadline_stops_running_processes_and_skips_the_rest(tmp_path):
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    done = run_processes({"a": sleep, "b": sleep}, jobs=1, budget_s=1.5, logs=tmp_path)
    assert done["a"].status == "stopped" and done["a"].seconds < 30 and done["b"].status == "skipped"
    done = run_processes({"ok": [sys.executable, "-c", "pass"], "bad": [sys.executable, "-c", "raise SystemExit(3)"]},
                         jobs=2, budget_s=60, logs=tmp_path)
    assert (done["ok"].status, done["bad"].status, done["bad"].returncode) == ("ok", "failed", 3)
    assert (tmp_path / "bad.log").read_text().startswith(sys.executable)


def test_the_common_step_is_the_last_evaluation_every_run_reached(tmp_path):
    runs = [RunEvals("a", 0, "ok", 30, {10: {"val_loss": 3.0}, 20: {"val_loss": 2.0}, 30: {"val_loss": 2.5}}),
            RunEvals("a", 1, "stopped", 25, {10: {"val_loss": 3.2}, 20: {"val_loss": 2.2}}),
            RunEvals("b", 0, "failed", 5, {}), RunEvals("b", 1, "skipped", 0, {})]
    assert common_step(runs) == 20
    (row,) = seed_table(runs)
    assert row["recipe"] == "a" and row["steps"] == [30, 25] and row["common_step"] == 20
    assert (row["final"]["mean"], row["best"]["min"], row["best"]["max"]) == (2.35, 2.0, 2.2)  # loss: lowest is best
    assert row["at_common_step"] == vars(Spread.of([2.0, 2.2]))
    paths = write_report(runs, tmp_path)
    assert "at step 20" in paths["md"].read_text()
    statuses = [r["status"] for r in json.loads(paths["json"].read_text())["runs"]]
    assert statuses == ["ok", "stopped", "failed", "skipped"]


def test_each_process_sees_its_share_of_gpus_and_threads():
    assert [process_env(i, 2, 4, base={})["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0", "1", "0", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in process_env(3, 1, 4, base={})
    assert process_env(0, 1, 4, base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


def test_an_unknown_recipe_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="unknown recipe 'update-mqar-nope'"):
        train_seeds(["update-mqar-nope"], [0], tmp_path)
    assert not (tmp_path / "runs").exists()
