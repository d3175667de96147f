"""Run a check function on N CPU processes (gloo), started from pytest."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(*args)
    except BaseException:
        raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args) -> None:
    """Run ``fn(*args)`` on ``world`` spawned processes of one gloo group; a failure on any rank fails the call."""
    # forked workers inherit the imported modules: starting them costs no second import of torch
    mp.start_processes(_worker, args=(world, _free_port(), fn, args), nprocs=world, join=True, start_method="fork")
