"""``linmem bench report``: BENCHMARKS.md is what benchmarks/ renders, and --check says when it is not (CPU)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from linmem.bench.reference import render, render_result
from linmem.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_md_is_in_sync_with_the_result_files(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["bench", "report", "--check"]) == 0


def test_check_fails_on_a_changed_number_and_writing_repairs_it(tmp_path, capsys) -> None:
    folder = tmp_path / "benchmarks"
    shutil.copytree(ROOT / "benchmarks", folder)
    page = tmp_path / "BENCHMARKS.md"
    page.write_text((ROOT / "BENCHMARKS.md").read_text())
    args = ["bench", "report", "--benchmarks", str(folder), "--out", str(page)]
    path = folder / "results" / "step-modes.json"
    result = json.loads(path.read_text())
    result["tables"][0]["rows"][0][1] = "1.0"
    path.write_text(json.dumps(result))
    assert main([*args, "--check"]) == 1
    assert "run `linmem bench report`" in capsys.readouterr().err
    assert main(args) == 0 and main([*args, "--check"]) == 0


def test_every_result_names_its_gpu_date_and_command() -> None:
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        result = json.loads(path.read_text())
        assert result["env"]["device"] and re.match(r"\d{4}-\d\d-\d\d", result["env"]["date"]), path.name
        assert result["command"], path.name
    text = render(ROOT / "benchmarks")
    used = set(re.findall(r"^\{\{result ([\w.-]+)\}\}$", (ROOT / "benchmarks" / "template.md").read_text(), re.M))
    assert used == {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert not re.search(r"^\{\{(result|include) ", text, re.M)


def test_a_bad_result_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(ValueError, match="'x'.*'command'"):
        render_result({"env": {"device": "cpu"}}, "x")
    with pytest.raises(ValueError, match="table 0, row 0 has 1 cells"):
        render_result({"env": {}, "command": "c", "tables": [{"header": ["a", "b"], "rows": [["1"]]}]}, "x")
    (tmp_path / "template.md").write_text("{{result missing}}\n")
    with pytest.raises(FileNotFoundError, match="missing"):
        render(tmp_path)


def test_a_file_the_models_bench_writes_is_a_result(tmp_path) -> None:
    from linmem.bench import models

    argv = ["--device", "cpu", "--dtype", "float32", "--hidden-size", "64", "--layers", "2", "--vocab-size", "128",
            "--warmup", "1", "--steps", "1", "--models", "gla", "--seq-lens", "16", "--tokens", "16",
            "--out", str(tmp_path)]
    assert models.main(argv) == 0
    result = json.loads((tmp_path / "models.json").read_text())
    assert result["command"] == "linmem bench models " + " ".join(argv) and result["cells"]
    text = render_result(result, "models")
    assert text.startswith("*cpu · 20") and "| linmem gla |" in text and "`linmem bench models --device cpu" in text
