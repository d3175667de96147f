"""Every Triton launch of linmem takes the fast path of :mod:`linmem.ops.triton_launch`.

The fast path launches a compiled kernel only when the call lists the kernel's parameters its way: the runtime
arguments positionally in the kernel's order, then every constexpr by name (else ``run_kernel`` keeps using
Triton's dispatcher, and a constexpr passed positionally would be keyed as an integer). These tests record each
launch of every launcher at tiny shapes (through the interpreter on CPU) and check that split against the
kernel's signature, and that no module launches a kernel past ``run_kernel``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import triton_kernels_device

DEVICE = triton_kernels_device()

from linmem.ops.attention.triton import launch as attention_launch  # noqa: E402
from linmem.ops.bayes import chunk_bwd, chunk_fwd  # noqa: E402
from linmem.ops.bayes import launch as bayes_launch  # noqa: E402
from linmem.ops.fused.triton import conv, cross_entropy, norm, rotary, swiglu  # noqa: E402
from linmem.ops.recurrence.triton import launch as recurrence_launch  # noqa: E402

#: the modules that launch kernels, each through its own name ``run_kernel``
LAUNCHERS = (norm, swiglu, conv, rotary, cross_entropy, attention_launch, bayes_launch, chunk_fwd, chunk_bwd,
             recurrence_launch)
#: the modules whose kernels must each be launched by :func:`test_every_launch_lists_the_kernels_parameters`
KERNEL_MODULES = ("linmem.ops.fused.triton.norm", "linmem.ops.fused.triton.swiglu", "linmem.ops.fused.triton.conv",
                  "linmem.ops.fused.triton.rotary", "linmem.ops.fused.triton.cross_entropy",
                  "linmem.ops.attention.triton.forward", "linmem.ops.attention.triton.backward",
                  "linmem.ops.attention.triton.decode", "linmem.ops.bayes.kernels", "linmem.ops.bayes.chunk_fwd",
                  "linmem.ops.bayes.chunk_bwd")
ROOT = Path(__file__).resolve().parents[2] / "linmem"


def call_layout_error(kernel, args: tuple, constexprs: dict) -> str:
    """Why this call would not take the fast path ("" when it would)."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    const = ["constexpr" in str(p.annotation) for p in params]
    names = [p.name for p in params]
    if len(args) > len(names) or any(const[:len(args)]):
        runtime = [n for n, c in zip(names, const) if not c]
        return f"{len(args)} positional arguments for the runtime parameters {runtime}"
    if set(constexprs) != set(names[len(args):]) or not all(const[len(args):]):
        return f"constexprs {list(constexprs)} for the remaining parameters {names[len(args):]}"
    return ""


def tiny_calls(gen: torch.Generator) -> None:
    """Every fused, attention and Bayesian launcher once per launch variant, at tiny shapes on ``DEVICE``."""
    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    x, w = rnd(6, 2, 8), rnd(8)
    y, _ = norm.rms_norm_forward(x, w, rnd(6, 2, 8), rnd(6, 2, 8), 1e-6, 1, torch.float32)
    norm.rms_norm_backward(x, rnd(6, 2, 8), w, y, rnd(6, 2, 8), 1e-6, 1)
    y, rinv = norm.l2_norm_forward(x, 1e-6)
    norm.l2_norm_backward(y, rinv, rnd(6, 2, 8))
    g, u = rnd(6, 8), rnd(6, 8)
    swiglu.swiglu_backward(g, u, swiglu.swiglu_forward(g, u))
    x, weight, bias, h0 = rnd(2, 5, 8), rnd(8, 4), rnd(8), rnd(2, 3, 8)
    y, final = conv.conv_forward(x, weight, bias, h0, None, 1, True)
    conv.conv_backward(x, weight, bias, h0, None, y, final, 1)
    conv.conv_step(rnd(2, 8), rnd(2, 3, 8), weight, bias, 1)
    rotary.rotary_launch(rnd(1, 3, 2, 8), rnd(1, 3, 1, 8), torch.arange(3, device=DEVICE)[None], 10000.0)
    labels = torch.tensor([1, 2, -100], device=DEVICE)
    cross_entropy.softmax_grad_(rnd(3, 7), labels, torch.ones(1, device=DEVICE), -100, True)
    q, k, v = rnd(1, 20, 2, 32), rnd(1, 20, 1, 32), rnd(1, 20, 1, 32)  # 20 keys: two decoding splits
    c = -torch.rand(1, 2, 20, generator=gen).cumsum(-1).to(DEVICE)
    o, lse = attention_launch.attention_forward(q, k, v, c, None, None, None, 0.25, None, None)
    attention_launch.attention_backward(q, k, v, c, None, None, None, o, lse, rnd(1, 20, 2, 32), 0.25, None, None)
    for splits in (1, 2):
        attention_launch.attention_decode(q[:, -1:], k, v, c.transpose(1, 2).contiguous(), None, 0.25, None, splits)
    q, k, v = rnd(1, 4, 1, 16), rnd(1, 4, 1, 16), rnd(1, 4, 1, 16)
    g, r, wt = -torch.rand(1, 4, 1, generator=gen).to(DEVICE), rnd(1, 4, 1).abs() + 0.5, rnd(1, 4, 1).abs()
    run = bayes_launch.Launch(16, 4)
    o, var, MT, PT, saved = bayes_launch.filter_forward(q, k, v, g, r, wt, None, None, None, 0.25, 1.0, True, True,
                                                        run)
    bayes_launch.filter_backward(q, k, v, g, r, wt, None, None, None, 0.25, 1.0, saved, PT, o, var, MT, PT, run)
    gates, chunked = torch.stack([g, r, wt], -1), chunk_fwd.ChunkLaunch(16, 4)
    o, var, MT, PT, states, factors = chunk_fwd.chunk_forward(q, k, v, gates, None, None, None, 0.25, 1.0, True, True,
                                                              chunked)
    chunk_bwd.chunk_backward(q, k, v, gates, states, factors, None, 0.25, o, var, MT, PT, chunked)


def test_every_launch_lists_the_kernels_parameters(monkeypatch):
    """Each launch of each launcher (fused ops, attention, the Bayesian filter, and a forward+backward of the
    recurrence) passes the kernel's runtime parameters positionally and its constexprs by name; every kernel of
    the fused, attention and Bayesian modules is launched."""
    from linmem.bench.ops import memory_inputs
    from linmem.ops import linear_recurrence

    seen: dict[str, str] = {}
    for module in LAUNCHERS:
        real = module.run_kernel

        def record(kernel, grid, args, constexprs, warps, stages, maxnreg=None, compiled=None, _real=real):
            assert len(grid) <= 3 and isinstance(warps, int) and isinstance(stages, int)
            seen.setdefault(kernel.__name__, call_layout_error(kernel, args, constexprs))
            return _real(kernel, grid, args, constexprs, warps, stages, maxnreg, compiled)

        monkeypatch.setattr(module, "run_kernel", record)
    tiny_calls(torch.Generator().manual_seed(0))
    for op in ("gated_deltanet", "gla"):
        t = memory_inputs(op, 1, 20, 1, 16, torch.float32, DEVICE)
        leaves = [x.requires_grad_() for x in t.values() if isinstance(x, torch.Tensor) and x.is_floating_point()]
        o, _ = linear_recurrence(**t, backend="triton")
        o.sum().backward()
        assert all(x.grad is not None for x in leaves)
    assert {name: why for name, why in seen.items() if why} == {}
    kernels = {name for module in KERNEL_MODULES for name, fn in vars(importlib.import_module(module)).items()
               if name.endswith("_kernel") and hasattr(fn, "arg_names")}
    assert kernels - set(seen) == set()
    assert any(name not in kernels for name in seen)  # the recurrence's launches were recorded too


def test_layout_check_names_a_misplaced_argument():
    """The check above can fail: a constexpr passed positionally, or one missing, is named."""
    kernel = swiglu.swiglu_fwd_kernel
    t = torch.empty(1)
    assert call_layout_error(kernel, (t, t, t, 1, 1, 1, 1), {"BM": 1, "BD": 1}) == ""
    assert "positional" in call_layout_error(kernel, (t, t, t, 1, 1, 1, 1, 1), {"BD": 1})
    assert "constexprs" in call_layout_error(kernel, (t, t, t, 1, 1, 1, 1), {"BD": 1})
    assert "constexprs" in call_layout_error(kernel, (t, t, t, 1, 1, 1), {"BM": 1, "BD": 1})


def test_no_module_launches_past_run_kernel():
    """No ``kernel[grid](...)`` anywhere in linmem: every launch goes through ``run_kernel`` (one switch,
    ``LINMEM_TRITON_FAST_LAUNCH``, and the fast path for all)."""
    direct = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name.endswith("_kernel") or name == "kernel":
                    direct.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert len(direct) == 1 and direct[0].startswith("linmem/ops/triton_launch.py:"), direct  # its dispatcher call


@pytest.mark.parametrize("switch, expected", [("1", True), ("0", False)])
def test_one_switch_turns_the_fast_path_off(switch, expected):
    """``LINMEM_TRITON_FAST_LAUNCH`` is read once, by the one module every launch goes through."""
    script = "from linmem.ops import triton_launch; print(triton_launch.FAST_LAUNCH)"
    env = {**os.environ, "LINMEM_TRITON_FAST_LAUNCH": switch}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(expected)
