"""The benchmark's per-kernel breakdown, on CPU (there it lists aten ops; on CUDA, kernels)."""

import torch

from linmem.bench.ops import BenchConfig, breakdown_rows, kernel_breakdown
from linmem.ops import linear_recurrence


def test_kernel_breakdown_sums_its_parts_largest_first():
    q = torch.randn(2, 64, 2, 16, requires_grad=True)
    total, parts = kernel_breakdown(lambda: linear_recurrence(q, q, q, beta=torch.rand(2, 64, 2),
                                                              backend="chunk")[0], "cpu", iters=1)
    times = [ms for _, ms in parts]
    assert total > 0 and abs(total - sum(times)) < 1e-9 and times == sorted(times, reverse=True)
    assert "aten::bmm" in dict(parts)  # the chunk products and the delta rule's WY inverse are batched matmuls


def test_kernel_breakdown_resets_the_leaves_gradients():
    """Each profiled call starts from no gradient, as after a training step's zero_grad: q.grad is one
    call's gradient, not the sum of the warm-up and profiled calls'."""
    q = torch.randn(1, 64, 2, 16, requires_grad=True)
    fn = lambda: linear_recurrence(q, q, q, backend="chunk")[0]  # noqa: E731
    torch.manual_seed(0)
    kernel_breakdown(fn, "cpu", iters=2, leaves=[q])
    torch.manual_seed(0)
    once = torch.autograd.grad(fn(), q, torch.randn_like(fn()))[0]
    torch.testing.assert_close(q.grad, once)


def test_breakdown_rows_name_each_op_and_backend():
    config = BenchConfig(shapes=((1, 64),), heads=2, head_dim=16, dtype="float32", ops=("gla", "deltanet", "attention"),
                         backends=("chunk", "reference"))
    lines = breakdown_rows(config, device="cpu", top=3, iters=1)
    assert "B x T = 1 x 64" in lines[0]
    for op in ("gla", "deltanet"):
        for backend in ("chunk", "reference"):
            assert any(line.startswith(f"{op} {backend}: ") and line.endswith(" ms") for line in lines)
    assert not any(line.startswith("attention") for line in lines)  # only memory ops are broken down


def test_accuracy_rows_measure_each_backend_against_float64():
    from linmem.bench.ops import accuracy_rows

    fp32 = BenchConfig(shapes=((1, 80),), heads=2, head_dim=16, dtype="float32", ops=("gla", "deltanet", "attention"),
                       backends=("chunk", "reference"))
    lines = accuracy_rows(fp32, device="cpu")
    assert len(lines) == 5 and not any(line.startswith("attention") for line in lines)
    for line in lines[1:]:
        worst = float(line.split("worst ")[1].split()[0])
        assert worst < 1e-5, line  # float32 against float64
    assert "dlog_decay" in lines[1] and "dbeta" in lines[3]
    bf16 = BenchConfig(shapes=((1, 80),), heads=2, head_dim=16, dtype="bfloat16", ops=("deltanet",),
                       backends=("chunk",))
    worst = float(accuracy_rows(bf16, device="cpu")[1].split("worst ")[1].split()[0])
    assert 1e-4 < worst < 2e-2  # bf16 rounding is seen, and nothing worse


def test_gates_scale_the_log_decays_and_reach_every_row(monkeypatch):
    """``--gates X`` multiplies the default log decays by X (same seed, same draws), and the config carries it to
    the inputs of the timed rows and the accuracy rows."""
    from linmem.bench import ops

    torch.manual_seed(0)
    mild = ops.memory_inputs("kda", 1, 64, 2, 16, torch.float32, "cpu")
    torch.manual_seed(0)
    strong = ops.memory_inputs("kda", 1, 64, 2, 16, torch.float32, "cpu", gates=10)
    torch.testing.assert_close(strong["log_decay"], 10 * mild["log_decay"])
    torch.testing.assert_close(strong["beta"], mild["beta"])
    assert ops.parser().parse_args(["--gates", "10"]).gates == 10
    seen = []
    real = ops.memory_inputs
    def recording(*a, **kw):  # the gates each call asks for, positional or keyword (1.0 when left out)
        seen.append(kw.get("gates", a[7] if len(a) > 7 else 1.0))
        return real(*a, **kw)

    monkeypatch.setattr(ops, "memory_inputs", recording)
    config = BenchConfig(shapes=((1, 64),), heads=2, head_dim=16, dtype="float32", ops=("kda",),
                         backends=("reference",), gates=100, decode_batch=0, warmup_ms=1, rep_ms=1)
    lines = ops.accuracy_rows(config, device="cpu")
    assert float(lines[1].split("worst ")[1].split()[0]) < 1e-5, lines[1]
    monkeypatch.setattr(ops, "_timer", lambda config: lambda fn, leaves=(): 0.0)  # no timing on CPU
    ops.run_ops(config, device="cpu")
    assert seen == [100, 100]
