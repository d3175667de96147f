"""Per-position loss against the model's own cross-entropy, the windows it reads, the extrapolation
table and plot; and the two inference helpers it and the other text suites use."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from linmem.eval.inference import greedy_generate, inference_mode, next_token_scores
from linmem.eval.position_loss import (PositionLossError, extrapolation_rows, plot_position_loss, position_loss,
                                       write_position_loss)

from .conftest import tiny_byte_model


def _documents(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen) for n in lengths]


def test_bins_average_the_models_per_token_cross_entropy():
    model = tiny_byte_model()
    docs = _documents([70, 20, 150])  # windows of 32 + 1: 2 from the first, 0 from the second, 4 from the third
    (curve,) = position_loss(model, docs, lengths=[32], bins=32, batch_size=4, progress=False)
    assert curve.windows == 6 and curve.bin_starts == list(range(32))
    windows = torch.stack([d[i:i + 33] for d in docs for i in range(0, len(d) - 32, 33)])
    with torch.no_grad():
        logits = model(windows[:, :-1], use_cache=False).logits
    expected = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(0)
    assert torch.allclose(torch.tensor(curve.loss), expected, atol=1e-5)
    (coarse,) = position_loss(model, docs, lengths=[32], bins=4, max_windows=6, progress=False)
    assert coarse.bin_ends == [8, 16, 24, 32]
    assert coarse.loss[1] == pytest.approx(float(expected[8:16].mean()), abs=1e-5)
    assert coarse.mean_loss == pytest.approx(float(expected.mean()), abs=1e-5)


def test_windows_stay_inside_documents_unless_concatenated():
    model = tiny_byte_model()
    short = _documents([30, 30, 30])
    with pytest.raises(PositionLossError, match="concat=True"):
        position_loss(model, short, lengths=[40], progress=False)
    (curve,) = position_loss(model, short, lengths=[40], concat=True, progress=False)
    assert curve.windows == 2  # 90 tokens hold two windows of 41
    with pytest.raises(PositionLossError, match="lengths"):
        position_loss(model, short, lengths=[1], progress=False)


def test_extrapolation_table_and_plot(tmp_path):
    model = tiny_byte_model()
    curves = position_loss(model, _documents([300, 300]), lengths=[64, 128], bins=8, progress=False)
    rows = extrapolation_rows(curves, train_length=64)
    assert [r["length"] for r in rows] == [64, 128]
    assert rows[1]["loss_within_train"] == pytest.approx(curves[1].loss_between(0, 64))
    assert rows[1]["loss_past_train"] == pytest.approx(sum(curves[1].loss[4:]) / 4)
    assert rows[0]["loss_past_train"] != rows[0]["loss_past_train"]  # nan: nothing lies past 64 in a window of 64
    path = write_position_loss(curves, tmp_path / "position_loss.json", train_length=64)
    saved = json.loads(path.read_text())
    assert saved["train_length"] == 64 and len(saved["curves"]) == 2
    assert (tmp_path / "position_loss_bins.md").read_text().count("\n") == 2 + 8 + 8
    png = plot_position_loss({"a": curves, "b": curves}, tmp_path / "pos.png", train_length=64)
    assert png.stat().st_size > 1000


def test_next_token_scores_and_greedy_generation_match_plain_forward_passes():
    model = tiny_byte_model()
    ids = torch.randint(0, 256, (3, 12))
    targets = torch.full_like(ids, -100)
    targets[:, 4:-1] = ids[:, 5:]
    logprob, greedy = next_token_scores(model, ids, targets)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits.log_softmax(-1)
    assert torch.allclose(logprob[:, 4:-1], full[:, 4:-1].gather(-1, ids[:, 5:, None])[..., 0], atol=1e-5)
    assert (logprob[:, :4] == 0).all() and not greedy[:, :4].any()
    assert torch.equal(greedy[:, 4:-1], full[:, 4:-1].argmax(-1) == ids[:, 5:])
    prompts = [[5, 6, 7, 8, 9], [10, 11]]

    def alone(prompt):
        seq = list(prompt)
        for _ in range(4):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        return seq[len(prompt):]

    with inference_mode(model):
        assert greedy_generate(model, prompts, 4) == [alone(p) for p in prompts]
        stopped = greedy_generate(model, prompts, 4, stop=lambda out: len(out) == 2)
    assert [len(s) for s in stopped] == [2, 2]
    with pytest.raises(ValueError, match="targets"):
        next_token_scores(model, ids, targets[:, :5])
