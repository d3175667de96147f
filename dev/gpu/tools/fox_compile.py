"""Compile the forgetting-attention kernels for a CUDA target without a GPU (and without torch), and report what
each variant needs and what its loops of tiles do.

Per variant: registers, stack bytes (spills), shared memory beside the estimate of ``configs.shared_memory``,
programs per SM (by registers and shared memory), the wgmma shapes of the whole kernel (SS: both operands from
shared memory, RS: the left one from registers). Per loop of tiles (innermost loops in code order; the flash
kernels have two: the tiles seen whole, then the masked ones, and varlen and pruning add their short binary
searches): SASS instructions per iteration and per score element of a thread, exp2s, the loads' pipelining
(``wait``: how many groups of copies may still be in flight when an iteration starts; 0 = every iteration waits
for the loads issued at the end of the previous one), block barriers, and stores to shared memory (layout changes
inside the loop). A variant fails (exit status 1) if it does not compile, if Triton allocates more shared memory
than the estimate says, or more than one program may take.

    python dev/gpu/tools/fox_compile.py [--arch 90] [--candidates] [--head-dims 32,...,256] [--workers N]
                                        [--out results.json]

Needs only triton, of the GPU image's version (``python -m venv /tmp/t36 && /tmp/t36/bin/pip install
triton==3.6.0``): the kernel modules and ``configs.py`` import nothing else, and the candidate tiles are read from
``fox_bench.py`` as text. Pointers and the sizes T, H are compiled as the JIT specialises them at the benchmark
shapes (16-byte aligned, divisible by 16); without that no load is vectorised. ``--candidates`` adds the tiles that
``fox_bench.py --only variants`` times (per head dim, bf16, gated).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "linmem" / "ops" / "attention" / "triton"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
FLAGS = ("IS_VARLEN", "HAS_FORGET", "HAS_WINDOW", "HAS_KEY_MASK", "PRUNE")
#: the flash kernels' flag sets checked (and G, query heads per KV head): the training defaults without and with
#: GQA, each flag alone, and everything on
FLASH_VARIANTS = [dict(HAS_FORGET=True, G=1), dict(HAS_FORGET=True, G=2), dict(G=1),
                  dict(HAS_FORGET=True, HAS_WINDOW=True, G=1), dict(HAS_FORGET=True, IS_VARLEN=True, G=1),
                  dict(HAS_FORGET=True, HAS_KEY_MASK=True, G=1), dict(HAS_FORGET=True, PRUNE=True, G=1),
                  dict(zip(FLAGS, [True] * 5), G=2)]
DECODE_VARIANTS = [dict(HAS_FORGET=True, HAS_KEY_MASK=True, SPLIT=s, HAS_WINDOW=w) for s in (False, True)
                   for w in (False, True)]
#: argument names of fp32 buffers, and of sizes the JIT sees divisible by 16 at the benchmark shapes
FP32_BUFFERS = {"C", "LSE", "BOUND", "DELTA", "U", "DC", "PM", "PL", "PACC"}
SIZES_DIV16 = {"T", "Tq", "Tk", "H"}


def load_kernels():
    """The kernel modules (forward, backward, decode) and the launch configurations (configs) imported as parts of
    ``linmem`` without running its package ``__init__`` files (which import torch)."""
    for name in ("linmem", "linmem.ops", "linmem.ops.attention", "linmem.ops.attention.triton", "linmem.ops.recurrence",
                 "linmem.ops.recurrence.triton"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(ROOT.joinpath(*name.split(".")))]
            sys.modules[name] = package
    return {name: importlib.import_module(f"linmem.ops.attention.triton.{name}")
            for name in ("forward", "backward", "decode", "configs")}


def module_literal(path: Path, name: str, env: dict):
    """The value of a module-level assignment ``name = ...`` of ``path``, evaluated alone in ``env``."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and getattr(n.targets[0] if isinstance(n, ast.Assign) else n.target, "id", "") == name)
    return eval(compile(ast.Expression(node.value), str(path), "eval"), env)  # our own source: a literal


def signature(kernel, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    """Triton types of the kernel's arguments (activations in ``dtype``, fp32 buffers, uint8 key mask, int32
    sizes) and the divisibility facts of the JIT's specialisation."""
    types_ = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            types_[name] = "constexpr"
        elif name in FP32_BUFFERS:
            types_[name] = "*fp32"
        elif name == "KM":
            types_[name] = "*u8"
        elif name == "cu_seqlens":
            types_[name] = "*i32"
        elif name in ("scale", "log_tol"):
            types_[name] = "fp32"
        elif name[0].isupper() and name not in SIZES_DIV16 and name != "N":
            types_[name] = DTYPES[dtype]
        else:
            types_[name] = "i32"
    names = list(types_)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if types_[n].startswith("*") or n in SIZES_DIV16}
    return types_, attrs


def tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cubin_text(cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool("cuobjdump"), *flags, f.name], capture_output=True, text=True).stdout


def sass_loops(sass: str) -> list[list[str]]:
    """The instructions of each innermost loop (a backward branch and the code it jumps back over, holding no other
    loop), in code order."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = []
    for addr, ins in lines:
        target = re.search(r"\bBRA\b[^;]*?(0x[0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < addr:
            spans.append((int(target.group(1), 16), addr))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [[ins for addr, ins in lines if lo <= addr <= hi] for lo, hi in sorted(inner)]


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def loop_stats(body: list[str], elements: int) -> dict:
    ops = [opcode(i) for i in body]
    waits = sorted({int(w, 16) for w in re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", "\n".join(body))})
    return {"instructions": len(body), "per_element": round(len(body) / elements, 1),
            "exp2": ops.count("MUFU.EX2"), "wait": waits, "barriers": sum(o.startswith("BAR.SYNC") for o in ops),
            "shared_stores": sum(o.split(".")[0] in ("STS", "STSM") for o in ops),
            "spill_ops": sum(o.split(".")[0] in ("STL", "LDL") for o in ops)}


def compile_one(kernel, dtype: str, constexprs: dict, warps: int, stages: int, arch: int, elements: int) -> dict:
    types_, attrs = signature(kernel, dtype, constexprs)
    src = ASTSource(fn=kernel, signature=types_, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps,
                                                                                     num_stages=stages))
    found = re.search(r"REG:(\d+) STACK:(\d+)", cubin_text(compiled.asm["cubin"], "--dump-resource-usage"))
    regs, stack = map(int, found.groups())
    shared = compiled.metadata.shared
    per_sm = min(65536 // (max(regs, 8) * 32 * warps), (228 << 10) // max(shared + 1024, 1))
    sass = cubin_text(compiled.asm["cubin"], "-sass")
    mma = {}
    for shape, left in re.findall(r"HGMMA\.(\d+x\d+x\d+)\.F32\.\w+ R\d+, (gdesc|R)", sass):
        key = f"{shape} {'SS' if left == 'gdesc' else 'RS'}"
        mma[key] = mma.get(key, 0) + 1
    loops = [loop_stats(body, elements) for body in sass_loops(sass)]
    return {"registers": regs, "stack": stack, "shared": shared, "programs_per_sm": per_sm, "wgmma": mma,
            "loops": loops}


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def jobs(candidates: bool, head_dims: list[int], all_variants: set[int]):
    """(label, (kernel module, kernel name), dtype, constexprs, Tiles, decoding rows) of every variant to compile:
    each kernel at each head dim of ``configs.TILES`` in bf16 (every flag set at ``all_variants``, the gated training
    variant elsewhere; a split dkdv as its two launches), fp16 at 64, fp32 at 128 with ``FP32_TILES``; decoding at 16
    and at the most rows (``cached_attention``'s ``DECODE_ROWS``), and the combine kernel."""
    mods = load_kernels()
    cfg = mods["configs"]
    most_rows = _pow2(module_literal(ROOT / "linmem" / "ops" / "attention" / "__init__.py", "DECODE_ROWS", {}))
    kernels = {"forward": ("forward", "forward_kernel"), "dq": ("backward", "dq_kernel"),
               "dkdv": ("backward", "dkdv_kernel")}
    extra = {}
    if candidates:
        extra = module_literal(Path(__file__).with_name("fox_bench.py"), "TILE_CANDIDATES", {})
    cases = [(D, "bf16") for D in head_dims] + [(64, "fp16"), (128, "fp32")]
    for name, kernel in kernels.items():
        for D, dtype in cases:
            if D not in head_dims:
                continue
            default = cfg.FP32_TILES[name] if dtype == "fp32" else cfg.TILES[name][D]
            tiles = [default]
            if dtype == "bf16":
                tiles += [cfg.Tiles(*t) for t in extra.get(D, {}).get(name, []) if cfg.Tiles(*t) != default]
            variants = FLASH_VARIANTS if D in all_variants and dtype != "fp16" else FLASH_VARIANTS[:1]
            for flags, t in itertools.product(variants, tiles):
                if t != default and flags != FLASH_VARIANTS[0]:
                    continue  # candidates: the gated training variant only
                const = {f: bool(flags.get(f)) for f in FLAGS}
                const.update(G=flags["G"], D=D, DV=D, BD=_pow2(D), BDV=_pow2(D), BM=t.block_m, BN=t.block_n)
                if name == "dq":
                    const["QT"] = (cfg.FP32_TILES["dkdv"] if dtype == "fp32" else cfg.TILES["dkdv"][D]).block_m
                if name != "dkdv":
                    yield name, kernel, dtype, const, t, 16
                    continue
                parts = [(True, False), (False, True)] if t.split else [(True, True)]
                for dk, dv in parts:
                    label = name if not t.split else f"dkdv/{'dk' if dk else 'dv'}"
                    yield label, kernel, dtype, dict(const, WITH_DK=dk, WITH_DV=dv), t, 16
    for D in head_dims:
        for rows, flags in itertools.product((16, most_rows), DECODE_VARIANTS):
            if rows != 16 and flags != DECODE_VARIANTS[-1]:
                continue  # the most rows: the largest variant only
            t = (cfg.TILES["decode"] if rows <= 16 else cfg.DECODE_MANY_ROWS_TILES)[D]  # as the launcher takes them
            const = dict(flags, G=4, D=D, DV=D, BD=_pow2(D), BDV=_pow2(D), BR=rows, BN=t.block_n)
            yield "decode", ("decode", "decode_kernel"), "bf16", const, t, rows
    if 128 in head_dims:
        t = cfg.FP32_TILES["decode"]
        const = dict(DECODE_VARIANTS[-1], G=4, D=128, DV=128, BD=128, BDV=128, BR=most_rows, BN=t.block_n)
        yield "decode", ("decode", "decode_kernel"), "fp32", const, t, most_rows
    combine = dict(G=4, DV=max(head_dims), BDV=_pow2(max(head_dims)), BR=16, BS=mods["decode"].MAX_SPLITS)
    yield "combine", ("decode", "combine_kernel"), "bf16", combine, cfg.Tiles(0, 0, 4, 1), 1


def _compile(job, arch: int) -> dict:
    """Compile one job (in a worker process) -> its row: the launch, the resources and Triton's allocation beside the
    estimate of ``configs.shared_memory``."""
    name, (module, fn), dtype, const, t, rows = job
    mods = load_kernels()
    cfg, kernel = mods["configs"], getattr(mods[module], fn)
    t = cfg.Tiles(*t)
    score_rows = rows if name == "decode" else t.block_m
    elements = max(score_rows * t.block_n // (32 * t.warps), 1) if t.block_n else 1
    row = {"kernel": name, "dtype": dtype, **const, "warps": t.warps, "stages": t.stages}
    try:
        row.update(compile_one(kernel, dtype, const, t.warps, t.stages, arch, elements))
    except Exception as error:  # a variant that does not compile is the finding: report it and go on
        row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        return row
    if name != "combine":
        row["estimate"] = cfg.shared_memory(name.split("/")[0], t, const["D"], const["DV"], 4 if dtype == "fp32" else 2,
                                            rows)
        if row["estimate"] < row["shared"]:
            row["error"] = f"configs.shared_memory estimates {row['estimate']} bytes, Triton allocates {row['shared']}"
    if row["shared"] > cfg.SHARED_MEMORY:
        row["error"] = f"{row['shared']} bytes of shared memory, more than the {cfg.SHARED_MEMORY} of a program"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--candidates", action="store_true",
                        help="also the candidate tiles of fox_bench (TILE_CANDIDATES, per head dim)")
    parser.add_argument("--head-dims", default="32,64,96,128,192,256", help="the head dims to compile (D = Dv)")
    parser.add_argument("--all-variants", default="96,128,192,256",
                        help="head dims compiled with every flag set (the others: the gated training variant)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="compilations in parallel")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    head_dims = [int(d) for d in args.head_dims.split(",")]
    all_variants = {int(d) for d in args.all_variants.split(",") if d}
    todo = [(*job[:4], dataclasses.astuple(job[4]), job[5]) for job in jobs(args.candidates, head_dims, all_variants)]
    results, failures = [], 0
    with ProcessPoolExecutor(max(args.workers, 1)) as pool:
        for job, row in zip(todo, pool.map(_compile, todo, itertools.repeat(args.arch))):
            name, _, dtype, const, t, rows = job
            t = load_kernels()["configs"].Tiles(*t)
            results.append(row)
            failures += "error" in row
            flags = ",".join(f.replace("HAS_", "").lower() for f in FLAGS + ("SPLIT",) if const.get(f)) or "plain"
            flags += f",G={const['G']}" if const.get("G", 1) > 1 and name.startswith(("forward", "dq", "dkdv")) else ""
            flags += f",rows={rows}" if name == "decode" else ""
            dim = const.get("D", const.get("DV"))
            head = f"{name:10s} {dtype:4s} D={dim!s:<3} {t.block_m}x{t.block_n} w{t.warps} s{t.stages} {flags:36s}"
            if "registers" not in row:
                print(f"{head} {row['error']}", flush=True)
                continue
            loops = "; ".join(f"loop {i + 1}: {lp['per_element']}/elem wait {lp['wait']} bar {lp['barriers']} "
                              f"sts {lp['shared_stores']} spill-ops {lp['spill_ops']}"
                              for i, lp in enumerate(row["loops"]))
            mma = ", ".join(f"{k} x{v}" for k, v in sorted(row["wgmma"].items()))
            estimate = f" (estimate {row['estimate'] / 1024:.1f}K)" if "estimate" in row else ""
            error = f" | {row['error']}" if "error" in row else ""
            print(f"{head} regs={row['registers']} stack={row['stack']} smem={row['shared'] / 1024:.1f}K{estimate} "
                  f"per-SM={row['programs_per_sm']} | {mma} | {loops}{error}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(f"{len(results)} variants, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
