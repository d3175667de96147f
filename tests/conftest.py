import os

# OpenMP threads that sleep between parallel regions instead of spinning: on a shared CPU, spinning
# threads waiting for a busy core make small matrix products tens of times slower (read by torch's
# OpenMP runtime when torch is imported, so it is set first)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
