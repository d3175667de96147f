"""The Bayesian memory layer on a GPU: its checks, then its cost in a ~370M model beside Gated DeltaNet.

One run, one GPU; everything goes to ``$OUT/bayes_models.json`` (and a table to stdout):

1. checks at a small shape (bf16 weights and activations as in training):
   * the layer with the fused kernels (``backend="triton"``) against the token loop (``"reference"``) on the
     same weights, packed sequences (``cu_seqlens``): outputs and the gradients of the input, of every
     projection and of the noise parameters, as error ratios rms(x - ref) / rms(ref);
   * a two-layer model decoding token by token (the kernel's in-place step on the cached mean and covariance)
     against its full forward;
   * ``torch.compile(fullgraph=True)`` of that model (inductor): loss and gradients against eager;
2. forward+backward time and peak memory of whole ~370M models (``linmem.bench.peers.ModelShape``: 24 layers,
   width 1024, vocabulary 32000, bf16 weights, no autocast), 16K tokens a step at T = 2K, 4K, 8K:
   Gated DeltaNet as in ``linmem bench models`` (4 heads, K = V = 256), Gated DeltaNet and the Bayesian layer at
   8 heads of K = V = 128 (the Bayesian layer holds P [K, K] on chip: K <= 128), all with short convolutions
   and output gates. A step is ``model(input_ids=x, labels=x).loss.backward()`` with the gradients dropped after
   it; 2 warm-up steps, the median of 3 timed ones (``linmem.bench.models.time_steps``).

    OUT=/tmp/out python dev/gpu/tools/bayes_models.py            # checks and timings
    OUT=/tmp/out python dev/gpu/tools/bayes_models.py --checks   # the checks only (records/bayes_mqar.sh runs these)
    OUT=/tmp/out python dev/gpu/tools/bayes_models.py --timings --seq-lens 2048   # one column of timings only

Exits with status 1 when a check fails (an error ratio above 2e-2 in bf16, 1e-3 for decoding and compile in fp32,
an asymmetric or indefinite P, or an exception).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from linmem.bench.models import error_text, free_memory, is_out_of_memory, time_steps
from linmem.bench.peers import ModelShape, linmem_config_kwargs
from linmem.layers import LayerState, MixerArgs, build_mixer
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.models.config import merge_fields
from linmem.models.outputs import output_cache

DEV = "cuda"
SEQ_LENS = (2048, 4096, 8192)
TOKENS_PER_STEP = 16384


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def layer_check() -> dict:
    """The layer on the kernels against the layer on the token loop, same weights, packed sequences."""
    x = torch.randn(1, 300, 256, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 101, 300], device=DEV, dtype=torch.int32)
    results = {}
    for backend in ("triton", "reference"):
        torch.manual_seed(0)
        layer = build_mixer("bayes", MixerArgs(hidden_size=256, num_heads=4, backend=backend)).to(DEV, torch.bfloat16)
        leaf = x.clone().requires_grad_(True)
        y = layer(leaf, cu_seqlens=cu)
        y.float().square().sum().backward()
        results[backend] = {"output": y.detach(), "d input": leaf.grad,
                            **{f"d {n}": p.grad for n, p in layer.named_parameters()}}
    return {name: rel_err(results["triton"][name], ref) for name, ref in results["reference"].items()}


def tiny_model() -> LinmemForCausalLM:
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=512, hidden_size=256, num_heads=2, layer_pattern="LL", memory="bayes",
                          intermediate_size=512)
    return LinmemForCausalLM(config).to(DEV)


def decode_check() -> dict:
    """Prefill 40 tokens, decode 24 one by one (the kernel's step in place on the cache), against the forward."""
    model = tiny_model().eval()
    ids = torch.randint(0, 512, (3, 64), device=DEV)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :40])
        cache, logits = output_cache(out), [out.logits]
        for t in range(40, 64):
            out = model(ids[:, t:t + 1], cache=cache)
            logits.append(out.logits)
    state: LayerState = cache[0]
    P = state.get("covariance")
    return {"decode vs forward": rel_err(torch.cat(logits, 1), full),
            "P symmetric (max |P - P^T|)": float((P - P.transpose(-1, -2)).abs().max()),
            "P min eigenvalue": float(torch.linalg.eigvalsh(P.double()).min())}


def compile_check() -> dict:
    """torch.compile(fullgraph=True) (inductor) of a two-layer model: loss and gradients against eager."""
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 128), device=DEV)
    results = []
    for fn in (torch.compile(model, fullgraph=True), model):
        model.zero_grad()
        loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    return {"loss": rel_err(results[0][0], results[1][0]),
            "worst gradient": max(rel_err(a, b) for a, b in zip(results[0][1:], results[1][1:]))}


MODELS = {
    "gated_deltanet 4 x 256": {},
    "gated_deltanet 8 x 128": dict(num_heads=8, mixer=dict(head_dim=128)),
    "bayes 8 x 128": dict(memory="bayes", num_heads=8, mixer=dict(head_dim=128)),
}


def timing(name: str, T: int, shape: ModelShape) -> dict:
    B = max(1, TOKENS_PER_STEP // T)
    cell = {"model": name, "T": T, "B": B}
    free_memory(DEV)
    try:
        torch.manual_seed(0)
        config = LinmemConfig(**merge_fields(linmem_config_kwargs("gated_deltanet", shape), MODELS[name]))
        model = LinmemForCausalLM(config).to(DEV, torch.bfloat16).train()
        cell["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        ids = torch.randint(0, shape.vocab_size, (B, T), device=DEV)

        def step() -> None:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)

        warm, steps_ms, peak = time_steps(step, 2, 3, DEV)
        cell.update(ms=statistics.median(steps_ms), steps_ms=steps_ms, peak_GB=peak, first_step_s=warm[0])
        cell["ktok_s"] = B * T / cell["ms"]
    except Exception as error:  # noqa: BLE001  a cell reports its failure and the table goes on
        cell["error"] = "out of memory" if is_out_of_memory(error) else error_text(error)
    return cell


#: the largest error ratio each check accepts (bf16 layer vs fp32-accumulated token loop; fp32 elsewhere)
LIMITS = {"layer: triton vs reference (bf16)": 2e-2, "decoding": 1e-3, "compile": 1e-3}


def failures(name: str, result: dict) -> list[str]:
    """The entries of a check's result that fail it."""
    if "error" in result:
        return [f"{name}: {result['error']}"]
    bad = []
    for key, value in result.items():
        if key == "P min eigenvalue":
            ok = value > 0
        elif key.startswith("P symmetric"):
            ok = value == 0
        else:
            ok = value <= LIMITS[name]
        if not ok:
            bad.append(f"{name}: {key} = {value:.3g}")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checks", action="store_true", help="run the checks only, not the timings")
    parser.add_argument("--timings", action="store_true", help="run the timings only, not the checks")
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)), help="comma list of T to time")
    args = parser.parse_args()
    if args.checks and args.timings:
        parser.error("--checks and --timings exclude each other (neither: both)")
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    path = out / "bayes_models.json"
    failed = []
    checks = (("layer: triton vs reference (bf16)", layer_check), ("decoding", decode_check),
              ("compile", compile_check))
    for name, check in checks if not args.timings else ():
        start = time.perf_counter()
        try:
            report[name] = check()
        except Exception as error:  # noqa: BLE001  report and go on to the timings
            report[name] = {"error": error_text(error)}
        print(f"{name} ({time.perf_counter() - start:.0f} s): {json.dumps(report[name])}", flush=True)
        failed += failures(name, report[name])
        report["failed checks"] = failed
        path.write_text(json.dumps(report, indent=1))
    if not args.timings:
        print("checks: " + ("all passed" if not failed else "FAILED: " + "; ".join(failed)), flush=True)
    if args.checks:
        raise SystemExit(1 if failed else 0)
    shape = ModelShape()
    report["timing"] = []
    print(f"\nforward+backward of ~370M models, {TOKENS_PER_STEP} tokens a step, bf16")
    print(f"{'model':<26}" + "".join(f"{f'T = {T}':>22}" for T in seq_lens))
    for name in MODELS:
        cells = [timing(name, T, shape) for T in seq_lens]
        report["timing"] += cells
        path.write_text(json.dumps(report, indent=1))
        text = [c.get("error", f"{c['ms']:.0f} ms ({c['peak_GB']:.1f} GB)")[:20] for c in cells]
        print(f"{name:<26}" + "".join(f"{t:>22}" for t in text), flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
