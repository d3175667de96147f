"""``dev/gpu/records/ablations.py``: the smoke ablation end to end (2 variants x 2 seeds, trained, evaluated,
tabulated), the table built from the runs' own metrics, and the verdict rules on the seeds' spread."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

RECORDS = Path(__file__).resolve().parents[2] / "dev" / "gpu" / "records"
REPO = RECORDS.parents[2]


@pytest.fixture(scope="module")
def ablations():
    sys.path.insert(0, str(RECORDS))
    try:
        import ablations

        yield ablations
    finally:
        sys.path.remove(str(RECORDS))


def test_smoke_ablation_tabulates_the_runs_own_metrics(tmp_path, ablations):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(RECORDS / "ablations.py"), "--smoke", "--out", str(out), "--ablations",
                           "fox-gate", "--variants", "fox,fox-fixed", "--seeds", "0,1", "--jobs", "4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = json.loads((out / "ablation_fox-gate.json").read_text())
    assert list(table["variants"]) == ["fox", "fox-fixed"] and table["seeds"] == [0, 1]
    for name, row in table["variants"].items():
        held_out, at_end = [], []
        for seed in (0, 1):
            run = out / "runs" / name / f"seed{seed}"
            metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            held_out.append([m["val_loss"] for m in metrics if "val_loss" in m][-1])
            curves = json.loads((run / "eval" / "position_loss.json").read_text())["curves"]
            at_end.append(next(c for c in curves if c["length"] == 64)["loss"][-1])
            assert row["seeds"][str(seed)]["val_loss"] == held_out[-1]
            assert row["seeds"][str(seed)]["end_loss"] == at_end[-1]
        assert held_out[0] != held_out[1], f"{name}: the seeds trained the same model"
        assert row["val_loss"]["values"] == held_out and row["end_loss"]["values"] == at_end
        assert row["val_loss"]["mean"] == pytest.approx(statistics.fmean(held_out))
        assert row["val_loss"]["std"] == pytest.approx(statistics.stdev(held_out))
        cell = f"{row['val_loss']['mean']:.4f} ± {row['val_loss']['std']:.4f}"
        assert cell in (out / "ablation_fox-gate.md").read_text()
    assert "the data-dependent gate beats the fixed one: " in table["verdicts"][1]
    assert (out / "ablation_fox-gate.png").stat().st_size > 0
    assert "## fox-gate" in (out / "ablations.md").read_text()


def _table(ablations, a: list[float], b: list[float]) -> dict:
    return {name: {"val_loss": ablations.spread(values), "seeds": {s: {"val_loss": v} for s, v in enumerate(values)}}
            for name, values in (("fox", a), ("transformer", b))}


def test_verdicts_say_the_direction_and_whether_the_seed_ranges_separate(ablations):
    strict = ablations.Expectation("fox", "transformer", "fox wins")
    level = ablations.Expectation("fox", "transformer", "fox is level", kind="level")
    neither = ablations.Expectation("fox", "transformer", "fox against the transformer", kind="none")
    apart = _table(ablations, [1.0, 1.1], [2.0, 2.1])
    assert "goes the paper's way, beyond the seed spread" in ablations.verdict(apart, strict)
    overlap = _table(ablations, [1.0, 1.3], [1.2, 1.4])
    assert "goes the paper's way, within the seed spread" in ablations.verdict(overlap, strict)
    assert "1.1500 ± 0.2121 vs 1.3000 ± 0.1414 (fox lower at 2 of 2 seeds)" in ablations.verdict(overlap, strict)
    assert "(fox lower at 1 of 2 seeds)" in ablations.verdict(_table(ablations, [1.0, 1.5], [1.2, 1.4]), strict)
    worse_within = _table(ablations, [1.2, 1.4], [1.0, 1.3])
    assert "goes the other way, within the seed spread" in ablations.verdict(worse_within, strict)
    assert "goes the paper's way, within the seed spread" in ablations.verdict(worse_within, level)
    assert "goes the other way, beyond" in ablations.verdict(_table(ablations, [2.0, 2.1], [1.0, 1.1]), level)
    assert "transformer lower, within the seed spread" in ablations.verdict(worse_within, neither)
    one_seed = _table(ablations, [1.2], [1.0])
    assert "goes the other way, one seed" in ablations.verdict(one_seed, level)
    assert ablations.verdict({"fox": apart["fox"]}, strict) == "- fox wins: not measured"


def test_throughput_rows_pivot_the_bench_lines_by_length(tmp_path, ablations):
    lines = ["some log line",
             json.dumps({"part": "mixers", "name": "gla", "B": 8, "T": 2048, "fwdbwd_ms": 10.0, "ktok_s": 1638.4,
                         "peak_GB": 3.21}),
             json.dumps({"part": "mixers", "name": "gla", "B": 4, "T": 4096, "error": "OutOfMemoryError: x"}),
             json.dumps({"part": "moe", "name": "moe grouped_mm", "tokens": 16384, "fwdbwd_ms": 1.0})]
    (tmp_path / "bench.log").write_text("\n".join(lines) + "\n")
    rows = ablations.throughput_rows(tmp_path / "bench.log")
    assert rows == [{"mixer": "gla", "T=2048 ktok/s": "1638.4", "T=2048 GB": "3.2",
                     "T=4096 ktok/s": "OutOfMemoryError: x", "T=4096 GB": ""}]
