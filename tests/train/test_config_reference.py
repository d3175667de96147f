"""The config reference (docs/config.md) is generated from the config dataclasses and kept current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from linmem.cli import main
from linmem.settings import meaning
from linmem.train.config import TrainConfig, load_config
from linmem.train.config_reference import config_reference, config_rows

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_the_generated_reference():
    assert (ROOT / "docs" / "config.md").read_text() == config_reference(), (
        "docs/config.md is out of date: python -m linmem.train.config_reference docs/config.md")


def test_every_key_and_section_has_a_meaning_and_its_default():
    rows = {row.key: row for row in config_rows()}
    assert all(row.meaning for row in rows.values()), [key for key, row in rows.items() if not row.meaning]
    assert (rows["data.text.paths"].type, rows["data.text.paths"].default) == ("list[str]", "[]")
    assert (rows["schedule.warmup_steps"].type, rows["parallel.dp"].default) == ("int or null", "1")
    assert all(meaning(f) for f in dataclasses.fields(TrainConfig))
    defaults = load_config()  # the reference's defaults are the ones a config starts from
    assert rows["run.out_dir"].default == defaults.run.out_dir and rows["optim.lr"].default == str(defaults.optim.lr)


def test_train_help_lists_the_sections_and_points_at_the_reference(capsys):
    try:
        main(["train", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "docs/config.md" in out
    for field in dataclasses.fields(TrainConfig):
        assert f"  {field.name} " in out, field.name
