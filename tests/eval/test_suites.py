"""Suites on run directories written by the trainer: the files they leave in <run>/eval, the
summary, the command line, and the refusals."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil

import pytest

from linmem.eval.command import SUITE_NAMES, add_eval_arguments, run_eval_command
from linmem.eval.runs import open_run
from linmem.eval.suites import SUITES, EvalError, EvalOptions, evaluate_run, format_summary, niah_grid

from .conftest import write_corpus, write_local_tasks


def test_text_suites_write_their_files_and_one_summary(text_run):
    options = EvalOptions(lengths=[300, 360], depths=2, samples=1, niah_tasks=["niah_single_1", "niah_multikey_2"],
                          max_new_tokens=6, bins=4, max_windows=4, concat=True, progress=False)
    out = evaluate_run(text_run, ["perplexity", "niah", "position-loss"], options)
    eval_dir = text_run / "eval"
    for name in ("perplexity.json", "niah.json", "niah_single_1.png", "niah_multikey_2.png",
                 "position_loss.json", "position_loss_bins.csv", "position_loss.png", "summary.md", "summary.json"):
        assert (eval_dir / name).exists(), name
    metrics = {(r["suite"], r["metric"]): r["value"] for r in out["summary"]}
    assert metrics[("perplexity", "val_ppl")] > 1
    assert 0 <= metrics[("niah", "niah_multikey_2/L360")] <= 1
    assert metrics[("position-loss", "loss_past_train/L360")] > 0  # trained on 64-token pieces
    niah = json.loads((eval_dir / "niah.json").read_text())
    assert len(niah["cells"]) == 2 * 2 * 2
    assert "niah_single_1/mean" in format_summary(out["summary"])


def test_default_suite_harness_and_command_line(text_run, capsys):
    out = evaluate_run(text_run, options=EvalOptions(progress=False))
    assert [r["metric"] for r in out["summary"]] == ["val_loss", "val_ppl"]
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    args = parser.parse_args([str(text_run), "--suite", "position-loss", "--lengths", "64,128", "--bins", "4",
                              "--concat", "--no-progress"])
    assert run_eval_command(args) == 0
    printed = capsys.readouterr().out
    assert "loss_past_train/L128" in printed and "eval/" in printed
    assert set(SUITE_NAMES) == set(SUITES)
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed: the harness suite is not run")
    folder = write_local_tasks(text_run.parent / "tasks")
    args = parser.parse_args([str(text_run), "--harness", "toy_choice", "--include-path", str(folder),
                              "--local-tasks-only", "--limit", "4", "--no-progress"])
    assert run_eval_command(args) == 0
    harness = json.loads((text_run / "eval" / "harness.json").read_text())
    assert harness["n-samples"]["toy_choice"]["effective"] == 4
    assert 0 <= harness["results"]["toy_choice"]["acc,none"] <= 1


def test_suites_refuse_what_they_cannot_measure(text_run, tmp_path):
    with pytest.raises(EvalError, match="unknown suite"):
        evaluate_run(text_run, ["bleu"])
    with pytest.raises(EvalError, match="trained on MQAR"):
        evaluate_run(text_run, ["mqar"], EvalOptions(progress=False))
    with pytest.raises(FileNotFoundError):
        evaluate_run(write_corpus(tmp_path / "not_a_run", documents=1), ["perplexity"])


def test_mqar_runs_get_their_recall_suite(tmp_path):
    from linmem.train import Trainer, load_config

    config = load_config(overrides=[
        "data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=16",
        "data.mqar.eval_examples=8", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=L",
        "schedule.steps=1", "schedule.warmup_steps=0", "run.progress=false", "run.tensorboard=false",
        "run.device=cpu", f"run.out_dir={tmp_path / 'mqar'}",
    ])
    Trainer(config).train()
    out = evaluate_run(tmp_path / "mqar")
    assert [r["metric"] for r in out["summary"]] == ["mqar_acc/L16_kv2"]
    with pytest.raises(EvalError, match="trained on text"):
        evaluate_run(tmp_path / "mqar", ["niah"])


def test_lm_eval_builds_the_model_from_a_run_directory(text_run):
    pytest.importorskip("lm_eval", reason="the lm-eval bridge needs the optional package lm-eval")
    from linmem.eval.harness import HarnessError, LinmemLM

    lm = LinmemLM.create_from_arg_string(f"run_dir={text_run},batch_size=2", {"batch_size": None, "device": "cpu",
                                                                               "max_batch_size": 64})
    assert (lm.batch_size, lm.max_length, lm.max_gen_toks, lm.tokenizer_name) == (2, 64, 32, "bytes")
    with pytest.raises(HarnessError, match="unknown model_args"):
        LinmemLM.create_from_arg_string(f"run_dir={text_run},batchsize=2")


def test_the_command_line_parts_import_without_torch():
    import os
    import subprocess
    import sys
    from pathlib import Path

    import linmem

    code = ("import sys, linmem.eval, linmem.eval.command, linmem.tokenizer; "
            "print(sorted(m for m in ('torch', 'numpy', 'lm_eval') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(Path(linmem.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "[]"


def test_a_run_without_validation_data_is_named_by_every_suite_that_needs_it(text_run, tmp_path, capsys):
    from linmem.cli import main

    run = tmp_path / "no-validation"
    shutil.copytree(text_run, run, ignore=shutil.ignore_patterns("eval"))
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("val_fraction: 0.25", "val_fraction: 0.0"))
    for suite in ([], ["--suite", "perplexity"], ["--suite", "niah,position-loss", "--concat"]):
        assert main(["eval", str(run), *suite]) == 2
        err = capsys.readouterr().err
        assert f"linmem: error: {run} has no validation data (validation: none (val_fraction 0))" in err, err
        assert "no rows" not in err and "concat=True" not in err
    assert not (run / "eval" / "niah.json").exists()  # refused before any suite ran
    out = evaluate_run(run, ["niah"], EvalOptions(lengths=[300], depths=1, samples=1, niah_tasks=["niah_single_1"],
                                                  max_new_tokens=4, progress=False))
    assert [r["metric"] for r in out["summary"]] == ["niah_single_1/L300", "niah_single_1/mean"]


def test_position_loss_names_the_flags_when_windows_do_not_fit(text_run):
    with pytest.raises(EvalError, match=r"needs 4097 tokens, there are [\d,]+ in the longest validation document "
                                        r"\([\d,]+ in all: --concat cuts windows across documents\); give shorter "
                                        "--lengths"):
        evaluate_run(text_run, ["position-loss"], EvalOptions(lengths=[4096], progress=False))
    with pytest.raises(EvalError, match=r"there are [\d,]+ in the validation documents together; give shorter"):
        evaluate_run(text_run, ["position-loss"], EvalOptions(lengths=[40960], concat=True, progress=False))


def test_niah_size_follows_the_device_and_limit(text_run):
    run = open_run(text_run)  # on the CPU: 3 depths x 2 prompts per (task, length, depth)
    assert niah_grid(run, EvalOptions()) == (3, 2)
    assert niah_grid(run, EvalOptions(depths=4, samples=10, lengths=[64, 128], limit=24)) == (4, 3)
    assert niah_grid(run, EvalOptions(samples=10, limit=0.5)) == (3, 5)
    with pytest.raises(EvalError, match=r"--limit 5 is fewer prompts than the 9 \(length, depth\) cells"):
        niah_grid(run, EvalOptions(limit=5))
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    assert parser.parse_args(["r", "--depths", "0,50,100"]).depths == [0.0, 50.0, 100.0]
    for bad in ("150", "0", "0,150", "-5.0", "nan,1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["r", "--depths", bad])
