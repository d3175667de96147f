"""Run a check function on N CPU processes (gloo), started from pytest, bounded in time.

Two limits turn a hang into a failure with a message, so no job can hang the suite:

* every collective fails on its rank after ``collective_timeout`` seconds (the process group's timeout): a rank
  waiting for a peer that died, hangs or took another path raises gloo's "Timed out" error and ends its process;
* the whole job fails after ``timeout`` seconds: the ranks still running print their Python stacks to stderr
  (``faulthandler``), are killed, and :func:`run_ranks` raises ``TimeoutError`` naming them.

A rank that raises ends its process; the others are stopped (they fail at once when their peer's connections
close), and :func:`run_ranks` raises with every rank's error, the first one first.

The ranks are forked (no second import of torch; spawned where CUDA is there, :func:`start_method`), so they run
on one thread each and compile in their own process: the parent's thread pool and inductor's compile threads do
not exist in a fork, and work queued on them waits for ever (a job of forked ranks whose parent had compiled before
hung so, in their first compile).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: seconds a whole job may take (the slowest, the two-rank job of test_distributed, takes about 100 s)
JOB_TIMEOUT = 600.0
#: seconds a rank may wait in one collective
COLLECTIVE_TIMEOUT = 300.0
#: seconds the other ranks get to end on their own after one failed, before they are terminated
GRACE = 5.0
#: the signal on which a rank prints every thread's Python stack to stderr
DUMP_STACKS = signal.SIGUSR1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, errors: str, collective_timeout: float, fn: Callable,
            args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    faulthandler.register(DUMP_STACKS, all_threads=True)
    # A forked process has none of its parent's threads: ops on the parent's thread pool, and kernels queued on
    # inductor's compile threads (started where the parent compiled, as earlier tests of a suite do), would wait
    # for ever. One thread each; inductor compiles in this process.
    torch.set_num_threads(1)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.compile_threads = 1
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout))
    try:
        fn(*args)
    except BaseException:
        report = traceback.format_exc()
        Path(errors, f"rank{rank}").write_text(f"{time.time()!r}\n{report}")
        raise RuntimeError(f"rank {rank}:\n{report}") from None
    finally:
        dist.destroy_process_group()


def _failures(errors: str, what: str, cause: BaseException) -> str:
    """Every rank's error, the first one first (a rank that was killed, e.g. for memory, wrote none)."""
    reports = []
    for path in Path(errors).glob("rank*"):
        stamp, report = path.read_text().split("\n", 1)
        reports.append((float(stamp), int(path.name[4:]), report))
    if not reports:
        return f"{what} failed: {cause}"
    reports.sort()
    return f"{what} failed; first rank {reports[0][1]}:\n" + "\n".join(
        f"-- rank {rank}{' (first)' if i == 0 else ''}:\n{report}" for i, (_, rank, report) in enumerate(reports))


def _stop_hung(context: mp.ProcessContext, what: str, timeout: float) -> str:
    """Make the ranks still running print their stacks, kill them, and say which they were."""
    hung = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
    for rank in hung:  # one after another, so that their stacks do not interleave
        os.kill(context.processes[rank].pid, DUMP_STACKS)
        time.sleep(0.5)
    for rank in hung:
        context.processes[rank].kill()
        context.processes[rank].join()
    return (f"{what}: ranks {hung} still running after {timeout:g} s (a hang; their Python stacks are on stderr "
            "above); they were killed")


def start_method() -> str:
    """"fork" (the workers inherit the imported modules: no second import of torch), except where CUDA is there:
    once a backward has run, autograd keeps a thread per CUDA device, and a forked child refuses autograd ("Unable
    to handle autograd's threading in combination with fork-based multiprocessing", every rank of a GPU machine's
    run after the first test with a backward); there the ranks are spawned. ``LINMEM_TEST_START_METHOD`` names
    one."""
    return os.environ.get("LINMEM_TEST_START_METHOD") or ("spawn" if torch.cuda.is_available() else "fork")


def run_ranks(world: int, fn: Callable, *args, timeout: float = JOB_TIMEOUT,
              collective_timeout: float = COLLECTIVE_TIMEOUT) -> None:
    """Run ``fn(*args)`` on ``world`` spawned processes of one gloo group; a failure on any rank fails the call
    (``RuntimeError`` with every rank's error), and so does a job still running after ``timeout`` seconds
    (``TimeoutError``); a collective waiting longer than ``collective_timeout`` seconds fails its rank.

    Example:
        >>> run_ranks(2, check_function, "an argument", timeout=60)  # doctest: +SKIP
    """
    what = f"{getattr(fn, '__name__', fn)} on {world} ranks"
    with tempfile.TemporaryDirectory() as errors:
        context = mp.start_processes(_worker, args=(world, _free_port(), errors, collective_timeout, fn, args),
                                     nprocs=world, join=False, start_method=start_method())
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=GRACE):
                if time.monotonic() >= deadline:
                    raise TimeoutError(_stop_hung(context, what, timeout))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as cause:
            raise RuntimeError(_failures(errors, what, cause)) from None
