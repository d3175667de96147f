"""The kernel-development tools of ``dev/kernels``, on the Triton interpreter at small shapes (on CUDA without it)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from tests.helpers import triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops import available_backends  # noqa: E402

if "triton" not in available_backends():
    pytest.skip("the triton backend is not registered", allow_module_level=True)

from linmem.ops.recurrence.triton import configs, launch, pipeline  # noqa: E402
from linmem.ops.recurrence.triton.switches import Decay  # noqa: E402

TOOLS = Path(__file__).resolve().parents[2] / "dev" / "kernels"


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def test_rerun_check_names_the_launch_that_moved(monkeypatch):
    """``dev/kernels/kernel_reruns.py``: every launch of a forward+backward rerun on its own inputs; a deterministic
    call reports nothing, a launch whose output moves between runs is named with that argument."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import kernel_reruns
    from kernel_ab import call

    from linmem.bench.ops import memory_inputs

    t = memory_inputs("mamba2", 1, 64, 1, 16, torch.float32, DEVICE)
    do = torch.randn(t["v"].shape, generator=seeded("reruns")).to(DEVICE)
    real, found = launch.run_kernel, {}
    monkeypatch.setattr(launch, "run_kernel", kernel_reruns.checking(real, 1, found))
    call(pipeline, t, Decay.of("scalar"), do)
    assert found == {}
    runs = []

    def flaky(kernel, grid, args, constexprs, warps, stages, maxnreg=None, compiled=None):  # o moves every other run
        launched = real(kernel, grid, args, constexprs, warps, stages, maxnreg, compiled)
        if kernel.__name__ == "output_kernel":
            runs.append(1)
            args[8].add_(len(runs) % 2 * 1e-3)
        return launched

    monkeypatch.setattr(launch, "run_kernel", kernel_reruns.checking(flaky, 1, found))
    call(pipeline, t, Decay.of("scalar"), do)
    assert list(found) == [("output_kernel", *configs.LAUNCH["output"], 8)]
    assert found[list(found)[0]][0] == 1 and found[list(found)[0]][1] == pytest.approx(1e-3, rel=1e-2)


def test_host_time_splits_a_call_into_nested_parts(monkeypatch):
    """``dev/kernels/host_time.py``: each part lies inside the one it belongs to, every kernel launch is counted, and
    the timers come off afterwards."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import host_time

    from linmem.bench.ops import memory_inputs

    t = memory_inputs("mamba2", 1, 64, 1, 16, torch.float32, DEVICE)
    real = launch.run_kernel
    parts, launches = host_time.host_parts(t, None, torch.randn_like(t["v"]), DEVICE, 1)
    assert launch.run_kernel is real
    # forward: cumsum, state_fwd, output; backward: state_bwd, dv, score_grads, the two sides of grads (fp32)
    assert launches == 8
    assert 0 < parts["chunk_forward"] <= parts["triton_recurrence"] <= parts["forward"]
    assert 0 < parts["chunk_backward"] <= parts["_gradients"] <= parts["backward"]
    assert 0 < parts["launches"] <= parts["chunk_forward"] + parts["chunk_backward"]


def test_host_ab_times_each_variant_through_its_own_launchers(monkeypatch):
    """``dev/kernels/host_time.py --base``: each variant's launcher module runs both timed paths (the launchers alone,
    and ``linear_recurrence`` with the backend's ``pipeline`` swapped for it), and the backend's own is back after."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import host_time
    from kernel_ab import load_base

    from linmem.bench.ops import memory_inputs
    from linmem.ops.recurrence.triton import ops

    base = load_base(str(Path(launch.__file__).parent), 0)
    forwards = []
    real_forward = base.chunk_forward
    monkeypatch.setattr(base, "chunk_forward", lambda *a: forwards.append(1) or real_forward(*a))
    t = memory_inputs("mamba2", 1, 64, 1, 16, torch.float32, DEVICE)
    times = host_time.host_ab([("base", base), ("new", pipeline)], t, Decay.of("scalar"), None,
                              torch.randn_like(t["v"]), DEVICE, 1, 1)
    assert ops.pipeline is pipeline and set(times) == {"base", "new"}
    assert all(alone > 0 and through > 0 for alone, through in times.values())
    assert len(forwards) == 4  # a warm-up round and a timed one, each through both paths


def test_bench_configs_refuses_unknown_names_and_malformed_pairs(monkeypatch):
    """``dev/kernels/bench_configs.py --launch``: NAME=WARPSxSTAGES pairs of the launch table, anything else refused
    with the names it takes."""
    monkeypatch.syspath_prepend(str(TOOLS))
    from bench_configs import parse_launch

    assert parse_launch("grads_key=8x2,output=4X3", configs.LAUNCH) == {"grads_key": (8, 2), "output": (4, 3)}
    for bad in ("grad=8x1", "grads_key=8", "grads_key"):
        with pytest.raises(SystemExit, match="wy_grads"):
            parse_launch(bad, configs.LAUNCH)
