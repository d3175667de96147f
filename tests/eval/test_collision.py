"""The collision and crowding studies: the filters against their closed forms, the paper's numbers, the files."""

import math

import pytest

from linmem.eval.collision import (BOOST_ASYMPTOTE, MEMORIES, CollisionSetting, closed_form_readout,
                                   collision_study, measured_gains, measured_readout, recall_probability,
                                   riccati_gain)
from linmem.eval.crowding import crowding_study


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("boosts", [1, 8])
def test_filters_equal_their_closed_forms(rho, boosts):
    setting = CollisionSetting(rho=rho, boosts=boosts, floods=24, prior=0.8, obs_noise=0.6)
    for memory in MEMORIES:
        measured, closed = measured_readout(setting, memory), closed_form_readout(setting, memory)
        assert measured == pytest.approx(closed, abs=1e-9), memory


def test_boost_asymptote():
    """The Bayesian memory's recall of B tends to (1 + e^-1)^-1 = 0.731 however long A is flooded."""
    assert BOOST_ASYMPTOTE == pytest.approx(0.7311, abs=1e-4)
    measured = recall_probability(*measured_readout(CollisionSetting(boosts=1024, floods=64), "bayes"))
    assert abs(measured - BOOST_ASYMPTOTE) < 1e-3
    closed = recall_probability(*closed_form_readout(CollisionSetting(boosts=10**6, floods=10**6), "bayes"))
    assert abs(closed - BOOST_ASYMPTOTE) < 1e-5


def test_steady_state_riccati_gain():
    """Q = r, no decay: the flooded key's gain settles at (sqrt(5) - 1) / 2 = 0.618."""
    gains = measured_gains(CollisionSetting(floods=32, process_noise=1.0))
    assert riccati_gain(1.0, 1.0) == pytest.approx((math.sqrt(5) - 1) / 2, abs=1e-12)
    assert gains[0] == pytest.approx(2 / 3) and gains[-1] == pytest.approx(0.6180339887, abs=1e-9)
    r, Q, a = 0.5, 0.2, 0.9  # the closed form is a fixed point of the recursion for any setting
    gain = riccati_gain(r, Q, a)
    x = gain * r / (1 - gain)
    assert a * a * x * r / (x + r) + Q == pytest.approx(x, rel=1e-12)


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.9])
def test_covariance_keeps_the_boosted_memory(rho):
    setting = CollisionSetting(rho=rho, boosts=16, floods=256)
    p = {m: recall_probability(*measured_readout(setting, m)) for m in MEMORIES}
    assert p["bayes"] > p["delta"] > p["linear"]
    assert p["bayes"] > 0.6


def test_collision_study_writes_its_tables_and_plot(tmp_path):
    summary = collision_study(tmp_path, setting=CollisionSetting(floods=32), boosts=(1, 512), rhos=(0.0, 0.9),
                              gain_steps=24)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"collision.png", "collision_boosts.csv", "collision_overlap.md", "collision_gain.csv"} <= names
    assert abs(summary["bayes_recall_at_most_boosts"] - BOOST_ASYMPTOTE) < 2e-3
    assert summary["riccati_gain_measured"] == pytest.approx(summary["riccati_gain_closed_form"], abs=1e-9)


def test_bad_collision_setting():
    with pytest.raises(ValueError, match="rho"):
        CollisionSetting(rho=1.0)
    with pytest.raises(ValueError, match="process_noise = 0"):
        closed_form_readout(CollisionSetting(process_noise=0.1), "bayes")


def test_crowding(tmp_path):
    rows = crowding_study(tmp_path, key_dims=(8,), ratios=(0.5, 2.0), trials=6, obs_noise=0.01)
    loss = {(r["n"], r["memory"]): r["loss"] for r in rows}
    assert loss[(16, "bayes")] < loss[(16, "delta")] < loss[(16, "linear")]
    assert loss[(4, "bayes")] < 0.01  # fewer pairs than dimensions: (nearly) exact recall
    assert loss[(16, "bayes")] == pytest.approx(0.5, abs=0.1)  # least squares: 1 - d / n
    assert loss[(16, "linear")] == pytest.approx(15 / 8, rel=0.3)  # cross-talk (n - 1) / d
    assert (tmp_path / "crowding.png").exists() and (tmp_path / "crowding.md").exists()
