"""The main job's wiring, in its quick form: every run trains, the table and plots are written,
the text model is evaluated and sampled (the full job is the README's first command)."""

from linmem.demo import EVAL_SETTINGS, MQAR_MODELS, run_demo
from linmem.train.metrics import read_metrics


def test_quick_demo_writes_table_plots_and_sample(tmp_path, capsys):
    run_demo(tmp_path, quick=True)
    out = capsys.readouterr().out
    assert "MQAR recall accuracy" in out and "sample:" in out and "perplexity" in out
    for model in MQAR_MODELS:
        assert model.name in out
    assert (tmp_path / "mqar_accuracy.png").stat().st_size > 0
    assert (tmp_path / "mqar_loss.png").stat().st_size > 0
    runs = sum(len(m.widths) for m in MQAR_MODELS)
    assert len(list((tmp_path / "mqar").iterdir())) == runs
    assert len(EVAL_SETTINGS) == 3
    for metrics in [*(tmp_path / "mqar").glob("*/metrics.jsonl"), tmp_path / "text-hybrid" / "metrics.jsonl"]:
        assert len([row for row in read_metrics(metrics) if "loss" in row]) == 10  # a point per step of the curves
