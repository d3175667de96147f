"""Check the chunked Bayesian filter (backends "chunk" and "chunk_triton") on a GPU and time it beside the sequential
kernels.

One run, one GPU; everything goes to ``$OUT/bayes_chunk_bench.json`` (and a summary to stdout):

1. correctness: ``chunk_filter`` (C = 64) and the chunked kernels against the token-loop reference at K = V = 64
   and 128, T = 300 (a shorter last chunk), with an initial state and the mixer's process noise ``0.5 (1 - a^2)``:
   fp32 inputs against the fp64 reference, bf16 inputs against the fp32 reference on the same rounded values;
   outputs, variance, final state and every gradient as error ratios (bounds: fp32 1e-4, bf16 5e-3);
2. timing: forward and forward+backward of "chunk_triton" at C = 16, 32 (``--fused-chunks``) beside "triton" (the
   sequential kernels), ``linear_recurrence`` with the gated delta rule and, with ``--torch-chunks``, the PyTorch
   form "chunk" (seconds a call at 1 x 16K), H = 16, K = V = 64 and 128 (``--dims``), B x T = 16K tokens
   (``--shapes``), bf16, with the peak memory of each forward+backward.

    OUT=/tmp/out python dev/gpu/tools/bayes_chunk_bench.py
    OUT=/tmp/out python dev/gpu/tools/bayes_chunk_bench.py --dims 128 --torch-chunks 128
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton.testing
from bayes_bench import check, filter_inputs, fwd_bwd, ms, peak_mib  # this folder's script: what it shares

from linmem.ops import bayes_filter, linear_recurrence
from linmem.ops.bayes.chunk import chunk_filter
from linmem.ops.bayes.chunk_fwd import ChunkLaunch
from linmem.ops.bayes.chunk_triton import chunk_triton_filter
from linmem.ops.bayes.inputs import validate

DEV = "cuda"
HEADS = 16


def chunked(chunk_size, **kwargs):
    """bayes_filter's "chunk" backend at a given chunk size."""
    inputs = validate(**kwargs)
    return chunk_filter(inputs, chunk_size)


def fused(chunk_size, **kwargs):
    """bayes_filter's "chunk_triton" backend at a given chunk size (default warps)."""
    inputs = validate(**kwargs)
    warps = ChunkLaunch.default(inputs.q.shape[-1], inputs.v.shape[-1]).num_warps
    return chunk_triton_filter(inputs, ChunkLaunch(chunk_size, warps))


def call(backend, t, state=None, chunk_size=64, **extra):
    kwargs = dict(**t, initial_state=state, prior=1.0, reset=False, scale=None, cu_seqlens=None)
    kwargs.update(dict(output_final_state=False, return_variance=False), **extra)
    if backend == "chunk":
        return chunked(chunk_size, **kwargs)
    if backend == "chunk_triton":
        return fused(chunk_size, **kwargs)
    return bayes_filter(**kwargs, backend=backend)


def timing(B, T, K, torch_chunks, fused_chunks) -> dict:
    t, _ = filter_inputs(B, T, HEADS, K, K, torch.bfloat16, mixer_noise=True)
    leaves = [t[n].requires_grad_(True) for n in ("q", "k", "v", "log_decay", "obs_noise", "process_noise")]
    beta = torch.sigmoid(torch.randn(B, T, HEADS, device=DEV)).requires_grad_(True)
    runs = {"triton": lambda: call("triton", t)[0]}
    for C in torch_chunks:
        runs[f"chunk{C}"] = lambda C=C: call("chunk", t, chunk_size=C)[0]
    for C in fused_chunks:
        runs[f"chunk_triton{C}"] = lambda C=C: call("chunk_triton", t, chunk_size=C)[0]
    runs["gated_delta"] = lambda: linear_recurrence(t["q"], t["k"], t["v"], log_decay=t["log_decay"], beta=beta)[0]
    row = dict(B=B, T=T, H=HEADS, K=K, V=K)
    for name, fn in runs.items():
        wrt = leaves[:4] + [beta] if name == "gated_delta" else leaves
        try:
            with torch.no_grad():
                row[f"{name}_fwd_ms"] = ms(fn)
            row[f"{name}_fwd_bwd_ms"] = ms(fwd_bwd(fn, wrt))
            row[f"{name}_peak_mib"] = peak_mib(fwd_bwd(fn, wrt))
        except (torch.OutOfMemoryError, triton.runtime.errors.OutOfResources) as error:  # a result, not a failure
            row[f"{name}_error"] = repr(error)[:200]
            torch.cuda.empty_cache()
    return row


def checked(backend, K, dtype) -> dict:
    """check() of a backend, or the error that stopped it (a kernel that does not compile at this size, say)."""
    try:
        return dict(check(K, dtype, backend, T=300, mixer_noise=True), backend=backend)
    except Exception as error:  # recorded and printed as the result
        return dict(backend=backend, K=K, dtype=str(dtype), ok=False, error=repr(error)[:300])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--dims", type=ints, default=[64, 128], help="K = V, comma-separated")
    parser.add_argument("--shapes", default="8x2048,1x16384", help="BxT, comma-separated")
    parser.add_argument("--fused-chunks", type=ints, default=[16, 32], help="chunk sizes of chunk_triton")
    parser.add_argument("--torch-chunks", type=ints, default=[], help="chunk sizes of the PyTorch form (slow)")
    args = parser.parse_args()
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    start = time.time()
    report["checks"] = [checked(backend, K, dtype) for backend in ("chunk", "chunk_triton") for K in args.dims
                        for dtype in (torch.float32, torch.bfloat16)]
    for c in report["checks"]:
        result = f"worst error ratio {c['worst']:.2e} {'ok' if c['ok'] else 'FAIL'}" if "worst" in c else c["error"]
        print(f"check {c['backend']} K={c['K']} {c['dtype']}: {result}")
    report["timing"] = []
    for K in args.dims:
        for B, T in shapes:
            row = timing(B, T, K, args.torch_chunks, args.fused_chunks)
            report["timing"].append(row)
            print(f"K=V={K} {B}x{T}: " + ", ".join(
                f"{n} {row[f'{n}_fwd_bwd_ms']:.2f} ms (fwd {row[f'{n}_fwd_ms']:.2f}, {row[f'{n}_peak_mib']:.0f} MiB)"
                if f"{n}_fwd_bwd_ms" in row else f"{n} failed"
                for n in ["triton", *(f"chunk{C}" for C in args.torch_chunks),
                          *(f"chunk_triton{C}" for C in args.fused_chunks),
                          "gated_delta"]))
            (out / "bayes_chunk_bench.json").write_text(json.dumps(report, indent=1))
    report["seconds"] = time.time() - start
    (out / "bayes_chunk_bench.json").write_text(json.dumps(report, indent=1))
    print("wrote", out / "bayes_chunk_bench.json")


if __name__ == "__main__":
    main()
