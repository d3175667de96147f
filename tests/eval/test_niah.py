"""Needle in a haystack: prompts fit their length and hold their needles where asked, RULER's
scoring, the accuracy grid against a model that reads the needles, and the files a run writes."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from linmem.eval.niah import (NIAH_TASKS, NiahError, build_prompt, depth_grid, haystack_lines, plot_niah, run_niah,
                              string_match_all)
from linmem.data.codec import byte_codec

from .conftest import NeedleOracle, tiny_byte_model

CODE = "def area(width, height):\n    return width * height\n\nclass Box:\n    size = 3\n" * 30
LINES = haystack_lines([CODE])
BYTES = byte_codec()


def _needle_lines(text: str) -> list[tuple[int, str, str]]:
    """(line index in the haystack, key, value) of every needle line of a prompt."""
    body = text.split("\n")[1:-1]
    found = [(i, re.match(r"One of the special magic \w+ for (\S+) is: (\S+)\.$", line)) for i, line in enumerate(body)]
    return [(i, m.group(1), m.group(2)) for i, m in found if m]


@pytest.mark.parametrize("task", list(NIAH_TASKS))
def test_every_task_fits_its_length_and_holds_its_answers(task):
    spec = NIAH_TASKS[task]
    prompt = build_prompt(task, 900, 40.0, BYTES.encode, max_new_tokens=50, rng=np.random.default_rng(3), lines=LINES)
    assert len(prompt.ids) + 50 <= 900 and prompt.ids == BYTES.encode(prompt.text)
    longer = build_prompt(task, 1400, 40.0, BYTES.encode, max_new_tokens=50, rng=np.random.default_rng(3), lines=LINES)
    assert len(longer.ids) > len(prompt.ids) + 300, "the haystack grows with the length"
    assert len(prompt.answers) == spec.num_values * spec.num_queries
    needles = _needle_lines(prompt.text)
    values = {v for _, _, v in needles}
    assert set(prompt.answers) <= values
    queried = {k for _, k, v in needles if v in prompt.answers}
    assert len(queried) == spec.num_queries and all(k in prompt.text.split("\n")[-1] for k in queried)
    if spec.haystack == "needles":
        assert len(needles) > 3 and sum(k in queried for _, k, _ in needles) == 1, "distractors use other keys"
    else:
        assert len(needles) == spec.num_keys * spec.num_values
    pattern = {"numbers": r"\d{7}", "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"}
    assert all(re.fullmatch(pattern[spec.value_kind], a) for a in prompt.answers)


@pytest.mark.parametrize("depth", [0.0, 50.0, 100.0])
def test_the_first_queried_needle_sits_at_the_depth(depth):
    prompt = build_prompt("niah_single_2", 1500, depth, BYTES.encode, max_new_tokens=16,
                          rng=np.random.default_rng(1), lines=LINES)
    body = prompt.text.split("\n")[1:-1]
    (index, _, value), = _needle_lines(prompt.text)
    assert value == prompt.answers[0]
    assert abs(index / (len(body) - 1) - depth / 100) <= 1 / len(body) + 1e-9


def test_prompts_are_deterministic_and_lengths_are_checked():
    a = build_prompt("niah_multiquery", 800, 30.0, BYTES.encode, max_new_tokens=20, rng=np.random.default_rng(7),
                     lines=LINES)
    b = build_prompt("niah_multiquery", 800, 30.0, BYTES.encode, max_new_tokens=20, rng=np.random.default_rng(7),
                     lines=LINES)
    assert a.text == b.text and a.answers == b.answers
    with pytest.raises(NiahError, match="fewer than"):
        build_prompt("niah_single_1", 100, 0.0, BYTES.encode, max_new_tokens=20, rng=np.random.default_rng(0))
    with pytest.raises(NiahError, match="unknown task"):
        build_prompt("niah_single_9", 500, 0.0, BYTES.encode, max_new_tokens=20, rng=np.random.default_rng(0))
    with pytest.raises(NiahError, match="lines"):
        build_prompt("niah_single_2", 500, 0.0, BYTES.encode, max_new_tokens=20, rng=np.random.default_rng(0))
    with pytest.raises(NiahError, match="depth"):
        build_prompt("niah_single_1", 500, 120.0, BYTES.encode, max_new_tokens=20, rng=np.random.default_rng(0))


def test_string_match_all_is_rulers_score():
    assert string_match_all("Numbers: 1234567, 7654321", ["1234567", "7654321"]) == 1.0
    assert string_match_all("numbers: 1234567", ["1234567", "7654321", "1111111", "2222222"]) == 0.25
    assert string_match_all("ABCDEF01-aaaa", ["abcdef01-AAAA"]) == 1.0
    assert depth_grid(3) == [0.0, 50.0, 100.0] and depth_grid([10, 90]) == [10.0, 90.0]
    with pytest.raises(NiahError):
        string_match_all("x", [])


def test_a_model_that_reads_the_needles_scores_one_and_depth_shows_in_the_grid(tmp_path):
    tasks = ["niah_single_1", "niah_multikey_2", "niah_multivalue", "niah_multiquery"]
    kwargs = dict(tasks=tasks, lengths=[700, 900], depths=[0.0, 100.0], samples=2, max_new_tokens=48,
                  haystack=[CODE], batch_size=3, progress=False)
    perfect = run_niah(NeedleOracle(), BYTES.encode, BYTES.decode, **kwargs)
    assert [c.accuracy for c in perfect.cells] == [1.0] * len(tasks) * 2 * 2
    near = run_niah(NeedleOracle(reach=0.5), BYTES.encode, BYTES.decode, **{**kwargs, "tasks": ["niah_single_1"]})
    by_depth = {c.depth: c.accuracy for c in near.cells if c.length == 900}
    assert by_depth == {0.0: 1.0, 100.0: 0.0}
    assert near.accuracy("niah_single_1") == 0.5
    path = near.write(tmp_path / "niah.json")
    saved = json.loads(path.read_text())
    assert saved["settings"]["lengths"] == [700, 900] and len(saved["cells"]) == 4
    assert saved["examples"][0]["output"].strip().isdigit()
    (png,) = plot_niah(near, tmp_path)
    assert png.name == "niah_single_1.png" and png.stat().st_size > 1000


def test_a_real_model_runs_every_haystack_kind():
    model = tiny_byte_model()
    result = run_niah(model, BYTES.encode, BYTES.decode, tasks=["niah_single_1", "niah_single_3", "niah_multikey_2"],
                      lengths=[420], depths=2, samples=1, max_new_tokens=6, haystack=[CODE], progress=False)
    assert len(result.cells) == 6 and all(0.0 <= c.accuracy <= 1.0 for c in result.cells)
    assert all(len(e["output"]) > 0 for e in result.examples)
    with pytest.raises(NiahError, match="tasks"):
        run_niah(model, BYTES.encode, BYTES.decode, tasks=["nope"], lengths=[420])
