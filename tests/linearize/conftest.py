import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny models run on one intra-op thread: on a shared CPU, two threads waiting on each other make
    these tests many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
