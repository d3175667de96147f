"""Sequence parallelism of the Bayesian memory on CPU (gloo), 2 and 4 processes started from pytest.

The filter and whole hybrid models equal one process (``bayes_checks``); and a job whose ranks fail, disagree or
never arrive ends with a failure that says so, within seconds, instead of hanging.
"""

from __future__ import annotations

import time
from typing import Callable

import pytest

from linmem.distributed import ParallelConfig, check_model
from linmem.models import LinmemConfig, LinmemForCausalLM

from . import bayes_checks
from .launch import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("world", [2, 4])
def test_equals_one_process(world: int) -> None:
    run_ranks(world, bayes_checks.all_bayes_checks, timeout=240)


def test_check_model_takes_the_bayesian_memory() -> None:
    model = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=16, num_heads=2, layer_pattern="L",
                                           memory="bayes"))
    check_model(model, ParallelConfig(sp=2))  # no refusal: the relay serves it


def _fails(world: int, fn: Callable, *, within: float, **limits) -> str:
    """Run ``fn`` on ``world`` ranks, which must fail within ``within`` seconds; the failure's message."""
    start = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError)) as failure:
        run_ranks(world, fn, **limits)
    elapsed = time.monotonic() - start
    assert elapsed < within, f"{fn.__name__}: the failure took {elapsed:.1f} s"
    return str(failure.value)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_raises_fails_the_job(world: int) -> None:
    """A rank refusing its inputs, or failing in its turn of the relay, ends every rank at once (its peers'
    collectives fail as its connections close), and the first error is that rank's."""
    message = _fails(world, bayes_checks.raise_before_relay, within=30, timeout=60, collective_timeout=60)
    assert "first rank 1" in message and "`obs_noise` must be > 0" in message, message
    message = _fails(world, bayes_checks.raise_inside_relay, within=30, timeout=60, collective_timeout=60)
    assert "first rank 1" in message and "rank 1 fails inside the relay" in message, message


def test_ranks_that_disagree_are_refused_on_every_rank() -> None:
    message = _fails(2, bayes_checks.disagree_on_shapes, within=30, timeout=60, collective_timeout=60)
    for rank in (0, 1):  # each rank raised the same error, before any broadcast of mismatched sizes
        assert f"-- rank {rank}" in message, message
    assert "disagree on value dim (rank 0: value dim 3; rank 1: value dim 5)" in message, message
    message = _fails(2, bayes_checks.disagree_on_autograd, within=30, timeout=60, collective_timeout=60)
    assert "disagree on autograd recording (rank 0: autograd recording 1; rank 1: autograd recording 0)" in message


def test_a_rank_that_never_arrives_times_out() -> None:
    """Rank 0 waits in the relay for a rank that sleeps: the collective's timeout fails it."""
    message = _fails(2, bayes_checks.never_arrives, within=40, timeout=60, collective_timeout=3)
    assert "first rank 0" in message and "Timed out" in message, message
