"""``dev/kernels/python_overhead.py``: an op's forward and backward timed through its Triton launchers with every
launch a no-op, and the launchers restored after."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import triton_kernels_device

if triton_kernels_device() != "cpu":
    pytest.skip("the proxy runs the launchers on CPU tensors through the interpreter", allow_module_level=True)

TOOLS = Path(__file__).resolve().parents[2] / "dev" / "kernels"


def test_ops_take_their_launchers_and_launch_nothing(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import python_overhead

    from linmem.ops import checks, triton_launch
    from linmem.ops.fused import backend
    from linmem.ops.recurrence import inputs
    from linmem.ops.recurrence.triton import launch

    real = triton_launch.run_kernel, backend.use_triton, checks.values_checkable
    rows = {r["op"]: r for r in python_overhead.main(["--ops", "swiglu_down,recurrence_gdn", "--calls", "3",
                                                      "--warmup", "1", "--cprofile", "5"])}
    assert rows["swiglu_down"]["forward_launches"] == 1 and rows["swiglu_down"]["backward_launches"] == 2
    assert rows["recurrence_gdn"]["forward_launches"] >= 3 and rows["recurrence_gdn"]["backward_launches"] >= 3
    assert all(r[f"{mode}_us"] > 0 for r in rows.values() for mode in ("forward", "backward"))
    assert all(len(r["profiles"]) == 2 and "tottime" in r["profiles"][0] for r in rows.values())
    assert (triton_launch.run_kernel, backend.use_triton, checks.values_checkable) == real
    assert launch.run_kernel is real[0] and inputs.values_checkable is real[2]
    with pytest.raises(SystemExit):
        python_overhead.main(["--ops", "softmax"])
