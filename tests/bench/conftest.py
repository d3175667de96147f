import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: one intra-op thread, so that a busy machine's thread barriers do not
    dominate every op (they made a 64-wide linear take 20 ms instead of 20 us on 2 shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
