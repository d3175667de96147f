"""``linmem bench ops`` for the attention ops (attention, fox, swa, fox_swa): the options, the rows and their
peers on CPU with the timer replaced, and the FlexAttention and fla builders against the reference."""

import itertools
import math
import sys

import pytest
import torch

from linmem.bench import ops
from linmem.bench.ops import ATTENTION_OPS, BenchConfig, attention_inputs, flex_attention_fn
from linmem.ops.attention import cached_attention, forgetting_attention


def _ratio(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def test_cli_window_ops_and_peers():
    """The CLI's defaults are BenchConfig's; --window and the attention ops reach the config; bad names and windows
    are refused naming the field."""
    parser = ops.parser()
    default = parser.parse_args([])
    assert tuple(default.ops.split(",")) == BenchConfig().ops and default.window == BenchConfig().window == 512
    assert set(ATTENTION_OPS) <= set(BenchConfig().ops)
    args = parser.parse_args(["--ops", "fox,swa,fox_swa", "--window", "64", "--peers"])
    assert args.window == 64 and args.ops == "fox,swa,fox_swa"
    assert tuple(args.peers.split(",")) == ops.PEERS  # --peers alone: every peer
    with pytest.raises(ValueError, match=r"BenchConfig.ops: unknown \['foxx'\]"):
        BenchConfig(ops=("fox", "foxx"))
    with pytest.raises(ValueError, match="BenchConfig.peers: unknown"):
        BenchConfig(peers=("flash",))
    with pytest.raises(ValueError, match="BenchConfig.window: .* got 0"):
        BenchConfig(window=0)


def test_attention_rows_peers_ratios_and_errors_on_cpu(monkeypatch):
    """Every attention op's rows run on CPU with a counting timer (each timed closure called once): linmem and SDPA
    causal are timed, FlexAttention says it needs CUDA and fla that it is not installed instead of crashing; the
    timed rows state their ratios to SDPA, the windowed ops' rows their window, and the table line shows both."""
    monkeypatch.setitem(sys.modules, "fla", None)  # fla absent, whether or not it is installed here
    counter = itertools.count(1)

    def timer(config):
        def bench(fn, leaves=()):
            fn()
            return float(next(counter))
        return bench

    monkeypatch.setattr(ops, "_timer", timer)
    config = BenchConfig(shapes=((1, 32),), heads=2, head_dim=16, dtype="float32", ops=tuple(ATTENTION_OPS),
                         peers=("sdpa", "flex", "fla"), window=8, decode_batch=0)
    rows = ops.run_ops(config, device="cpu")
    by = {(r.op, r.impl): r for r in rows}
    expected = {(op, impl) for op in ATTENTION_OPS for impl in ("linmem", "torch.sdpa_causal", f"torch.flex_{op}")}
    assert set(by) == expected | {("fox", "fla.parallel_forgetting_attn")}
    for op, (_, windowed) in ATTENTION_OPS.items():
        ours, sdpa, flex = by[op, "linmem"], by[op, "torch.sdpa_causal"], by[op, f"torch.flex_{op}"]
        assert not ours.error and not sdpa.error, (ours.error, sdpa.error)
        assert ours.extra["fwd_vs_sdpa"] == ours.fwd_ms / sdpa.fwd_ms
        assert ours.extra["fwdbwd_vs_sdpa"] == ours.fwdbwd_ms / sdpa.fwdbwd_ms
        assert flex.error.startswith("needs CUDA") and math.isnan(flex.fwdbwd_ms) and "fwd_vs_sdpa" not in flex.extra
        assert "window" not in sdpa.extra and "fwd_vs_sdpa" not in sdpa.extra
        assert ours.extra.get("window") == (8 if windowed else None) == flex.extra.get("window")
        line = ops.format_row(ours, config, None)
        assert f"x sdpa_causal: f+b {ours.fwdbwd_ms / sdpa.fwdbwd_ms:.2f}" in line
        assert ("window 8" in line) == windowed
    assert by["fox", "fla.parallel_forgetting_attn"].error.startswith("fla not installed")
    assert "needs CUDA" in ops.format_row(by["swa", "torch.flex_swa"], config, None)


def test_pruned_rows_time_the_gated_ops_with_prune_tolerance(monkeypatch):
    """--prune-tolerance adds a linmem.pruned row to the gated ops only, calling forgetting_attention with the
    tolerance; a tolerance outside (0, 1) is refused by name."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("prune_tolerance"))
        return forgetting_attention(*args, **kwargs)

    monkeypatch.setattr(ops, "forgetting_attention", spy)
    monkeypatch.setattr(ops, "_timer", lambda config: lambda fn, leaves=(): (fn(), 1.0)[1])
    args = ops.parser().parse_args(["--prune-tolerance", "0.001"])
    assert args.prune_tolerance == 0.001
    config = BenchConfig(shapes=((1, 64),), heads=2, head_dim=16, dtype="float32", ops=tuple(ATTENTION_OPS),
                         window=8, decode_batch=0, prune_tolerance=0.001)
    rows = ops.run_ops(config, device="cpu")
    pruned = [r for r in rows if r.impl == "linmem.pruned"]
    assert sorted(r.op for r in pruned) == ["fox", "fox_swa"] and not any(r.error for r in pruned)
    assert 0.001 in seen and "prune tolerance 0.001" in ops.format_row(pruned[0], config, None)
    with pytest.raises(ValueError, match="BenchConfig.prune_tolerance: .* got 1.5"):
        BenchConfig(prune_tolerance=1.5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_builder_matches_the_reference_on_cpu():
    """FlexAttention's function (eager: forward only on CPU) is forgetting_attention's for every attention op, at
    a length past one 128-token block and a window across the block boundary."""
    B, T, H, D, W = 2, 160, 2, 16, 40
    for op, (_, windowed) in ATTENTION_OPS.items():
        torch.manual_seed(0)
        args = {n: x.detach() for n, x in attention_inputs(op, B, T, H, D, torch.float32, "cpu").items()}
        window = W if windowed else None
        with torch.no_grad():
            got = flex_attention_fn(B, T, window, device="cpu", compiled=False)(**args)
            ref = forgetting_attention(**args, window=window, backend="reference")
        assert got.shape == ref.shape and _ratio(got, ref) < 1e-5, op


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fox", "fox_swa"])
def test_flex_and_fla_peers_match_the_reference_on_cuda(op):
    """The compiled FlexAttention peer and fla's FoX kernel (when installed) compute the op's function: bf16 output
    and every gradient against the fp32 reference within 1e-2 (peers, not held to linmem's 5e-3)."""
    B, T, H, D = 2, 384, 4, 64
    window = 100 if ATTENTION_OPS[op][1] else None
    torch.manual_seed(0)
    args = attention_inputs(op, B, T, H, D, torch.bfloat16, "cuda")
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def run(fn, cast):
        leaves = {n: x.detach().to(cast if n != "log_forget" else x.dtype).requires_grad_(True)
                  for n, x in args.items()}
        out = fn(**leaves)
        grads = torch.autograd.grad(out, list(leaves.values()), do.to(out.dtype))
        return [out, *grads]

    ref = run(lambda **a: forgetting_attention(**a, window=window, backend="reference"), torch.float32)
    peers = {"flex": flex_attention_fn(B, T, window, device="cuda")}
    if window is None:
        try:
            peers["fla"] = ops.fla_forgetting_fn()
        except ImportError:
            pass
    for name, fn in peers.items():
        for got, want in zip(run(fn, torch.bfloat16), ref):
            assert _ratio(got, want) < 1e-2, name


def test_head_dims_time_the_attention_ops_and_their_decoding_at_each_dim(monkeypatch):
    """--head-dims times every attention op at each head dim (the D column), forward+backward and one decoding step
    against a cache of --decode-context keys (a window's ring for swa), while the memory ops stay at --head-dim;
    bad head dims and contexts are refused by name."""
    args = ops.parser().parse_args(["--head-dims", "32,96,256", "--decode-context", "40"])
    assert args.head_dims == "32,96,256" and args.decode_context == 40
    assert ops.parser().parse_args([]).head_dims == "" and BenchConfig().attention_dims == (128,)
    seen = []

    def spy(*a, **kw):
        seen.append(("decode", a[0].shape[-1], a[1].shape[1]))
        return cached_attention(*a, **kw)

    monkeypatch.setattr(ops, "cached_attention", spy)
    monkeypatch.setattr(ops, "_timer", lambda config: lambda fn, leaves=(): (fn(), 1.0)[1])
    monkeypatch.setattr(ops, "_back_to_back_ms", lambda fn: (fn(), 0.002)[1])
    monkeypatch.setattr(ops, "_graphed_ms", lambda bench, fn: (fn(), 0.001)[1])
    config = BenchConfig(shapes=((1, 16),), heads=2, head_dim=16, head_dims=(32, 96, 256), dtype="float32",
                         ops=("linear_attention", "fox", "swa"), backends=("chunk",), window=8, decode_batch=2,
                         decode_context=40)
    rows = ops.run_ops(config, device="cpu")
    timed = {(r.op, r.impl, r.D) for r in rows}
    assert {(op, "linmem", d) for op in ("fox", "swa") for d in (32, 96, 256)} <= timed
    assert ("linear_attention", "chunk", 16) in timed and ("linear_attention", "step", 16) in timed
    decoding = [r for r in rows if r.impl == "decode"]
    expected = sorted((op, d, 40 if op == "fox" else 8) for op in ("fox", "swa") for d in (32, 96, 256))
    assert sorted((r.op, r.D, r.extra["keys"]) for r in decoding) == expected
    assert set(seen) == {("decode", d, keys) for _, d, keys in expected}  # timed back to back and in a graph
    assert not any(r.error for r in rows), [r.error for r in rows if r.error]
    line = ops.format_row(decoding[0], config, None)
    assert " 2.0 us/step back to back, 1.0 us in a CUDA graph" in line and "cache " in line and " TB/s" in line
    assert f"{decoding[0].D:4d}" in line
    with pytest.raises(ValueError, match="BenchConfig.head_dims: .* got \\(0,\\)"):
        BenchConfig(head_dims=(0,))
    with pytest.raises(ValueError, match="BenchConfig.decode_context: .* got 0"):
        BenchConfig(decode_context=0)
