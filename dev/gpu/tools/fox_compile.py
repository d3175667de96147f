"""Compile the forgetting-attention kernels for a CUDA target without a GPU (and without torch), and report what
each variant needs and what its loops of tiles do.

Per variant: registers, stack bytes (spills), shared memory, programs per SM (by registers and shared memory), the
wgmma shapes of the whole kernel (SS: both operands from shared memory, RS: the left one from registers). Per loop
of tiles (innermost loops in code order; the flash kernels have two: the tiles seen whole, then the masked ones, and
varlen and pruning add their short binary searches): SASS instructions per iteration and per score element of a thread, exp2s, the loads' pipelining (``wait``:
how many groups of copies may still be in flight when an iteration starts; 0 = every iteration waits for the loads
issued at the end of the previous one), block barriers, and stores to shared memory (layout changes inside the
loop).

    python dev/gpu/tools/fox_compile.py [--arch 90] [--candidates] [--out results.json]

Needs only triton, of the GPU image's version (``python -m venv /tmp/t36 && /tmp/t36/bin/pip install
triton==3.6.0``): the kernel modules import nothing else, and the tiles are read from ``launch.py`` and
``fox_bench.py`` as text. Pointers and the sizes T, H are compiled as the JIT specialises them at the benchmark
shapes (16-byte aligned, divisible by 16); without that no load is vectorised. ``--candidates`` adds the tiles that
``fox_bench.py --only variants`` times (D = 128, bf16, gated).
"""

from __future__ import annotations

import argparse
import ast
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
    """The kernel modules (forward, backward, decode) imported as parts of ``linmem`` without running its package
    ``__init__`` files (which import torch)."""
    for name in ("linmem", "linmem.ops", "linmem.ops.attention", "linmem.ops.attention.triton", "linmem.ops.recurrence",
                 "linmem.ops.recurrence.triton"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(ROOT.joinpath(*name.split(".")))]
            sys.modules[name] = package
    return {name: importlib.import_module(f"linmem.ops.attention.triton.{name}")
            for name in ("forward", "backward", "decode")}


def module_literal(path: Path, name: str, env: dict):
    """The value of a module-level assignment ``name = ...`` of ``path``, evaluated alone in ``env``."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and getattr(n.targets[0] if isinstance(n, ast.Assign) else n.target, "id", "") == name)
    return eval(compile(ast.Expression(node.value), str(path), "eval"), env)  # our own source: a literal


def launch_tiles() -> dict:
    """``launch.TILES`` and ``launch.FP32_TILES`` as (block_m, block_n, warps, stages) tuples."""
    env = {"Tiles": lambda *a: tuple(a), "dict": dict, "int": int, "str": str}
    return {"TILES": module_literal(KERNELS / "launch.py", "TILES", env),
            "FP32_TILES": module_literal(KERNELS / "launch.py", "FP32_TILES", env)}


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


def jobs(candidates: bool):
    """(label, kernel, dtype, constexprs, (block_m, block_n, warps, stages)) of every variant to compile."""
    mods = load_kernels()
    kernels = {"forward": mods["forward"].forward_kernel, "dq": mods["backward"].dq_kernel,
               "dkdv": mods["backward"].dkdv_kernel}
    tiles = launch_tiles()
    extra = {}
    if candidates:
        extra = module_literal(Path(__file__).with_name("fox_bench.py"), "TILE_CANDIDATES", {})
    for name, kernel in kernels.items():
        for D, dtype in ((128, "bf16"), (64, "bf16"), (64, "fp16"), (128, "fp32")):
            cfgs = [tiles["FP32_TILES"][name] if dtype == "fp32" else tiles["TILES"][name][D]]
            if D == 128 and dtype == "bf16":
                cfgs += [tuple(t) for t in extra.get(name, []) if tuple(t) != cfgs[0]]
            variants = FLASH_VARIANTS if (D, dtype) in ((128, "bf16"), (128, "fp32")) else FLASH_VARIANTS[:1]
            for flags, t in itertools.product(variants, cfgs):
                if t != cfgs[0] and flags != FLASH_VARIANTS[0]:
                    continue  # candidates: the gated training variant only
                const = {f: bool(flags.get(f)) for f in FLAGS}
                const.update(G=flags["G"], D=D, DV=D, BM=t[0], BN=t[1])
                if name == "dq":
                    const["QT"] = (tiles["FP32_TILES"]["dkdv"] if dtype == "fp32" else tiles["TILES"]["dkdv"][D])[0]
                yield name, kernel, dtype, const, t
    for D in (64, 128):
        t = tiles["TILES"]["decode"][D]
        for flags in DECODE_VARIANTS:
            yield "decode", mods["decode"].decode_kernel, "bf16", dict(flags, G=4, D=D, DV=D, BR=16, BN=t[1]), t
    yield "combine", mods["decode"].combine_kernel, "bf16", dict(G=4, DV=128, BR=16, BS=mods["decode"].MAX_SPLITS), \
        (0, 0, 4, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--candidates", action="store_true", help="also the candidate tiles of fox_bench")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    results, failures = [], 0
    for name, kernel, dtype, const, t in jobs(args.candidates):
        BM, BN, warps, stages = t
        rows = const.get("BR", BM)
        elements = max(rows * BN // (32 * warps), 1) if BN else 1
        row = {"kernel": name, "dtype": dtype, **const, "warps": warps, "stages": stages}
        try:
            row.update(compile_one(kernel, dtype, const, warps, stages, args.arch, elements))
        except Exception as error:  # a variant that does not compile is the finding: report it and go on
            failures += 1
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        results.append(row)
        flags = ",".join(f.replace("HAS_", "").lower() for f in FLAGS + ("SPLIT",) if const.get(f)) or "plain"
        flags += f",G={const['G']}" if const.get("G", 1) > 1 and name in ("forward", "dq", "dkdv") else ""
        dim = const.get("D", const.get("DV"))
        head = f"{name:16s} {dtype:4s} D={dim!s:<3} {BM}x{BN} w{warps} s{stages} {flags:36s}"
        if "error" in row:
            print(f"{head} {row['error']}", flush=True)
            continue
        loops = "; ".join(f"loop {i + 1}: {lp['per_element']}/elem wait {lp['wait']} bar {lp['barriers']} "
                          f"sts {lp['shared_stores']} spill-ops {lp['spill_ops']}" for i, lp in enumerate(row["loops"]))
        mma = ", ".join(f"{k} x{v}" for k, v in sorted(row["wgmma"].items()))
        print(f"{head} regs={row['registers']} stack={row['stack']} smem={row['shared'] >> 10}K "
              f"per-SM={row['programs_per_sm']} | {mma} | {loops}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(f"{len(results)} variants, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
