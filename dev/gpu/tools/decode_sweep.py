"""How fast the attention decode kernel reads its cache: GB/s of one static-cache step per launch config.

One decoding step of one attention layer (``Tq`` = 1 new token, batch ``--batch``, ``--heads`` query heads over
``--kv-heads`` KV heads of ``--head-dim``, bf16) against a cache of ``Tk`` keys, softmax and forgetting attention
(``c`` read too). For each context the kernel is timed at the default launch (``decode_splits`` and
``configs.TILES["decode"]``) and at every (splits, keys per tile, warps, stages) of the sweep; bandwidth = the bytes
the step must read (k, v, and c for FoX) over its time (kernel and combine, CUDA events over ``--reps`` launches).
The reference is a device-to-device copy of the same bytes (``torch.Tensor.copy_``), timed in the same run.

    OUT=/tmp/out python dev/gpu/tools/decode_sweep.py --contexts 2048,8192,32768,131072
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from linmem.ops.attention.triton import configs, launch  # noqa: E402


def timed(fn, reps: int) -> float:
    """ms per call: the median of 5 rounds of ``reps`` back-to-back calls."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        rounds.append(begin.elapsed_time(end) / reps)
    return sorted(rounds)[2]


def sweep(B: int, H: int, Hkv: int, D: int, Tk: int, forget: bool, reps: int, full: bool) -> dict:
    torch.manual_seed(0)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Tk, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    c = torch.randn(B, Tk, H, device="cuda").cumsum(1) * -0.01 if forget else None
    nbytes = 2 * k.numel() * k.element_size() + (c.numel() * 4 if forget else 0)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src), reps)
    scale = D ** -0.5
    base = configs.TILES["decode"][D]
    default_ms = timed(lambda: launch.attention_decode(q, k, v, c, None, scale, None), reps)
    default_splits = launch.decode_splits(q, Tk, base.block_n)
    rows = []
    splits_grid = [1, 2, 4, 8, 16, 32, 64]
    tiles_grid = ([configs.Tiles(16, bn, w, st) for bn, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3))]
                  if full else [base])
    try:
        for t in tiles_grid:
            configs.TILES["decode"][D] = t
            for s in splits_grid:
                try:
                    ms = timed(lambda: launch.attention_decode(q, k, v, c, None, scale, None, splits=s), reps)
                except Exception as error:  # a config that does not fit the device (shared memory, registers)
                    print(f"  skip BN={t.block_n} warps={t.warps} stages={t.stages} splits={s}: "
                          f"{type(error).__name__}", flush=True)
                    continue
                rows.append({"block_n": t.block_n, "warps": t.warps, "stages": t.stages, "splits": s, "ms": ms,
                             "GBps": nbytes / ms / 1e6})
    finally:
        configs.TILES["decode"][D] = base
    best = min(rows, key=lambda r: r["ms"])
    return {"B": B, "H": H, "Hkv": Hkv, "D": D, "Tk": Tk, "forget": forget, "MB": nbytes / 1e6,
            "copy_GBps": 2 * nbytes / copy_ms / 1e6, "default_ms": default_ms, "default_splits": default_splits,
            "default_GBps": nbytes / default_ms / 1e6, "best": best, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,8192,32768,131072")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tiles", action="store_true", help="sweep keys per tile, warps and stages too")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    results = []
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| D | Tk | FoX | MB read | copy GB/s (r+w) | default splits | default GB/s | best (BN, warps, stages, "
          "splits) | best GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for D in map(int, args.head_dims.split(",")):
        for Tk in map(int, args.contexts.split(",")):
            for forget in (False, True):
                r = sweep(args.batch, args.heads, args.kv_heads, D, Tk, forget, args.reps, args.tiles)
                b = r["best"]
                print(f"| {D} | {Tk} | {forget} | {r['MB']:.0f} | {r['copy_GBps']:.0f} | {r['default_splits']} | "
                      f"{r['default_GBps']:.0f} ({r['default_ms']*1e3:.0f} µs) | ({b['block_n']}, {b['warps']}, "
                      f"{b['stages']}, {b['splits']}) | {b['GBps']:.0f} ({b['ms']*1e3:.0f} µs) |", flush=True)
                results.append(r)
    Path(args.out, "decode_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
