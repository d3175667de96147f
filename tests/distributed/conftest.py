"""Fixtures of the distributed tests."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """A module's one-process references and tiny models run on one thread, as every rank of its jobs does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
