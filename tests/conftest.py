import os

# OpenMP threads that sleep between parallel regions instead of spinning: on a shared CPU, spinning
# threads waiting for a busy core make small matrix products tens of times slower (read by torch's
# OpenMP runtime when torch is imported, so it is set first)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels' tests run through the interpreter. It must be on before triton is first
# imported (by any test: transformers, inductor, the kernels): triton.language builds its own jit helpers
# (tl.zeros, tl.sum, ...) at import, and compiled helpers refuse to run inside an interpreted kernel.
# "auto" backends never pick the interpreter, so the rest of the suite is unaffected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
