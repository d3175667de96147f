"""The jobs of tests/distributed end, whatever their ranks do: a job past its deadline is killed with its ranks'
stacks, and forked ranks compile although their parent started inductor's compile threads (which a fork does not
have: a kernel queued on them waited for ever, and both ranks of a job hung)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from .launch import run_ranks


def _sleeps_past_the_deadline() -> None:
    time.sleep(120)


def test_a_job_past_its_deadline_is_killed_with_its_stacks(capfd) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 3 s") as failure:
        run_ranks(2, _sleeps_past_the_deadline, timeout=3)
    assert time.monotonic() - start < 30, failure.value
    assert "_sleeps_past_the_deadline" in capfd.readouterr().err  # the Python stacks of the killed ranks


def _compiles_one_kernel(constant: float) -> None:
    """One kernel that no cache holds, compiled in this rank."""
    affine = torch.compile(lambda x: x * constant + 1.0)
    assert torch.allclose(affine(torch.ones(3)), torch.full((3,), constant + 1.0))  # (a fused multiply-add rounds once)


def test_ranks_compile_where_their_parent_started_inductor_threads(tmp_path, monkeypatch) -> None:
    """As in a full run, where earlier tests compiled in the pytest process: its compile threads, idle, exist in the
    parent only; a rank's kernel queued on them would be waited for until the job's deadline."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold: the rank compiles its kernel
    # inductor's own patch, not monkeypatch: a monkeypatched config entry can be left deleted (hidden) by the undo,
    # which failed every later compile of the process
    with config.patch(compile_threads=2):
        AsyncCompile.pool().submit(int).result()  # the parent's compile threads have run and wait, idle
        run_ranks(2, _compiles_one_kernel, 1.0 + os.getpid() % 1000 / 1000, timeout=120)
