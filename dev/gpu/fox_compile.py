"""Compile every forgetting-attention kernel variant for a CUDA target without a GPU, and report its registers,
stack (spills) and shared memory.

Ahead-of-time compilation (``triton.compile`` with a ``GPUTarget``) runs the whole pipeline down to the cubin,
so a variant that does not compile for Hopper fails here, on any machine with Triton installed. The register
and stack figures come from ``cuobjdump -res-usage`` on the cubin (the tiles of ``launch.TILES``, and with
``--sweep`` the candidates of ``fox_bench.TILE_CANDIDATES``).

    python dev/gpu/fox_compile.py [--arch 90] [--sweep] [--out results.json]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from linmem.ops.attention.triton import backward, decode, forward, launch  # noqa: E402

DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
FLAGS = ("IS_VARLEN", "HAS_FORGET", "HAS_WINDOW", "HAS_KEY_MASK", "PRUNE")
#: the flash kernels' flag sets checked: each flag alone, the training defaults, and everything on
FLASH_VARIANTS = [dict(HAS_FORGET=True), dict(), dict(HAS_FORGET=True, HAS_WINDOW=True),
                  dict(HAS_FORGET=True, IS_VARLEN=True), dict(HAS_FORGET=True, HAS_KEY_MASK=True),
                  dict(HAS_FORGET=True, PRUNE=True), dict(zip(FLAGS, [True] * 5))]
DECODE_VARIANTS = [dict(HAS_FORGET=True, HAS_KEY_MASK=True, SPLIT=s, HAS_WINDOW=w) for s in (False, True)
                   for w in (False, True)]


def signature(kernel, dtype: str, constexprs: dict) -> dict:
    """Triton types of the kernel's arguments: activations in ``dtype``, fp32 buffers, uint8 key mask, ints."""
    fp32 = {"C", "LSE", "BOUND", "DELTA", "DC", "PM", "PL", "PACC"}
    floats = {"scale", "log_tol"}
    types = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in fp32:
            types[name] = "*fp32"
        elif name == "KM":
            types[name] = "*u8"
        elif name == "cu_seqlens":
            types[name] = "*i32"
        elif name in floats:
            types[name] = "fp32"
        elif name[0].isupper() and name not in ("N", "T", "Tq", "Tk", "H"):
            types[name] = DTYPES[dtype]
        else:
            types[name] = "i32"
    return types


def resources(cubin: bytes) -> dict:
    """Registers, stack bytes (spills) and static shared memory of a cubin (``cuobjdump -res-usage``)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", text)
    return {"registers": int(found.group(1)), "stack": int(found.group(2))} if found else {"raw": text}


def compile_one(kernel, dtype: str, constexprs: dict, warps: int, stages: int, arch: int) -> dict:
    names = list(inspect.signature(kernel.fn).parameters)
    src = ASTSource(fn=kernel, signature=signature(kernel, dtype, constexprs),
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps,
                                                                                     num_stages=stages))
    return {**resources(compiled.asm["cubin"]), "shared": compiled.metadata.shared}


def jobs(sweep: bool):
    """(name, kernel, dtype, constexprs, tiles) of every variant to compile."""
    kernels = {"forward": forward.forward_kernel, "dq": backward.dq_kernel, "dkdv": backward.dkdv_kernel}
    candidates = {}
    if sweep:
        sys.path.insert(0, str(Path(__file__).parent))
        from fox_bench import TILE_CANDIDATES

        candidates = TILE_CANDIDATES
    for name, kernel in kernels.items():
        for D, dtype in ((128, "bf16"), (64, "bf16"), (64, "fp16"), (64, "fp32")):
            tiles = [launch.TILES[name][D]]
            if sweep and D == 128 and dtype == "bf16":
                tiles += [launch.Tiles(*t) for t in candidates.get(name, [])]
            variants = FLASH_VARIANTS if (D, dtype) in ((128, "bf16"), (64, "fp32")) else FLASH_VARIANTS[:1]
            for flags, t in itertools.product(variants, tiles):
                const = {f: bool(flags.get(f)) for f in FLAGS}
                const.update(G=2, D=D, DV=D, BM=t.block_m, BN=t.block_n)
                yield name, kernel, dtype, const, t
    for D in (64, 128):
        t = launch.TILES["decode"][D]
        for flags in DECODE_VARIANTS:
            const = dict(flags, G=4, D=D, DV=D, BR=16, BN=t.block_n)
            yield "decode", decode.decode_kernel, "bf16", const, t
    yield "combine", decode.combine_kernel, "bf16", dict(G=4, DV=128, BR=16, BS=decode.MAX_SPLITS), launch.Tiles(
        0, 0, 4, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--sweep", action="store_true", help="also the candidate tiles of fox_bench")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    results, failures = [], 0
    for name, kernel, dtype, const, t in jobs(args.sweep):
        row = {"kernel": name, "dtype": dtype, **{k: v for k, v in const.items()}, "warps": t.warps,
               "stages": t.stages}
        try:
            row.update(compile_one(kernel, dtype, const, t.warps, t.stages, args.arch))
        except Exception as error:  # a variant that does not compile is the finding: report it and go on
            failures += 1
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        results.append(row)
        flags = ",".join(f for f in FLAGS + ("SPLIT",) if const.get(f)) or "-"
        print(f"{name:8s} {dtype:5s} D={const.get('D', const.get('DV'))!s:<4} BM={const.get('BM', const.get('BR'))} "
              f"BN={const.get('BN', '-')} w={t.warps} s={t.stages} {flags:45s} "
              + (row.get("error") or f"regs={row.get('registers')} stack={row.get('stack')} smem={row.get('shared')}"),
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(f"{len(results)} variants, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
