"""Where one static-cache decoding step of a ~370M model goes, on one GPU.

For each model and context: prefill ``context`` tokens at batch 8 into a :class:`StaticLinmemCache`, then
  1. time 32 replays of the captured step (:class:`GraphDecoder`, what ``generate(cache_implementation="static")``
     runs): ms per token;
  2. profile 8 eager steps (``decode_step``, the same kernels the graph replays) with ``torch.profiler``: the
     GPU time of one step (the sum of its kernels) and the top kernels by GPU time.
When the replay's ms/token is close to the step's GPU time, the step is bound by its kernels, and the table says
which. Prints the tables; writes ``$OUT/decode_profile.json``.

    OUT=/tmp/out python dev/gpu/tools/decode_profile.py --models hybrid,transformer --contexts 2048,32768
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from linmem.bench.peers import ModelShape, build_model  # noqa: E402
from linmem.generation.step import GraphDecoder, decode_step  # noqa: E402
from linmem.models.cache import StaticLinmemCache  # noqa: E402

BATCH, REPLAYS, PROFILED = 8, 32, 8


def measure(key: str, context: int) -> dict:
    torch.manual_seed(0)
    model = build_model(key, ModelShape())[0].eval()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 32000, (BATCH, context), device="cuda")
    cache = StaticLinmemCache(layers, batch_size=BATCH, max_cache_len=context + REPLAYS + PROFILED + 8, device="cuda")
    with torch.no_grad():
        token = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        decoder = GraphDecoder(model, cache)
        for _ in range(3):  # eager warm-up, capture, first replay
            token = decoder.step(cache, token).argmax(-1)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(REPLAYS):
            token = decoder.step(cache, token).argmax(-1)
        end.record()
        end.synchronize()
        replay_ms = begin.elapsed_time(end) / REPLAYS
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED):
                token = decode_step(model, token, cache).argmax(-1)
                cache.advance_host(1)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events) / PROFILED
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    rows = [{"kernel": e.key[:90], "us_per_step": e.self_device_time_total / PROFILED,
             "calls_per_step": e.count / PROFILED} for e in top]
    del model, cache, decoder
    torch.cuda.empty_cache()
    return {"model": key, "context": context, "replay_ms_per_token": replay_ms, "gpu_ms_per_step": total_us / 1e3,
            "top": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="hybrid,transformer")
    parser.add_argument("--contexts", default="2048,32768")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results = []
    for key in args.models.split(","):
        for context in map(int, args.contexts.split(",")):
            r = measure(key, context)
            results.append(r)
            print(f"== {key} at context {context}, batch {BATCH}: replay {r['replay_ms_per_token']:.2f} ms/token, "
                  f"GPU {r['gpu_ms_per_step']:.2f} ms per step", flush=True)
            for row in r["top"]:
                print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.1f}  {row['kernel']}", flush=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
