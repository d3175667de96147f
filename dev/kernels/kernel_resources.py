"""Compile every Triton kernel variant of the recurrence for sm_90 (Hopper) without a GPU, and print what each
needs: shared memory, registers per thread, the local-memory stack (register spills), vectorised loads and a
hash of its PTX.

The variants are the launches themselves: the launchers run on ``meta`` tensors (shapes and dtypes, no data)
with ``launch.run_kernel`` replaced by a recorder, for every decay kind, rule and bonus, so each recorded launch
carries the kernel, the dtypes of its tensors, its integers, its constexprs and its (warps, stages, register
cap) exactly as the product picks them (``configs.py``). Run it under the Triton of the GPU image, with torch
from the system::

    python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python dev/kernels/kernel_resources.py                  # bf16, K = V = 128, every kernel
    /tmp/t36/bin/python dev/kernels/kernel_resources.py --only state_bwd_kernel,grads_kernel --K 256 --dtype fp32

A stack above 0 bytes is a spill. "vector loads" counts the global loads of the PTX that move more than one
element per instruction: a kernel whose addresses lose their alignment or contiguity facts falls back to 2-byte
loads (an opaque offset added to an arange does that). Tensors are compiled 16-byte aligned and integers
divisible by 16 with that hint, as the JIT launch specialises them at the benchmark shapes (8 x 2048, H = 16;
varlen: 8 packed sequences of 2048; K = 64 takes H = 32 so the grid stays wider than the SMs). "ptx" hashes
the generated code without its debug information (line directives, the labels of inlined functions' scopes) and
with the kernel's name replaced: a refactor that leaves every hash unchanged compiles to the code that was
verified on the GPU. Compare the output before and after, for each dtype, with --varlen and at --K 64. "body"
hashes the PTX without its parameter list (:func:`body`): where only it agrees, the kernels differ in parameters
they never read.

The kernel package is loaded from its folder as a package of its own (it imports nothing outside the folder
but torch and triton); ``--package DIR`` compiles another copy of it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PACKAGE = Path(__file__).resolve().parents[2] / "linmem" / "ops" / "recurrence" / "triton"
#: (module, function) of the forward, backward and decoding launchers in the package
ENTRY = {"forward": ("pipeline", "chunk_forward"), "backward": ("pipeline", "chunk_backward"),
         "step": ("recurrent", "recurrent_step"), "run": ("launch", "run_kernel")}
#: (decay code, delta rule, bonus) of the chunk kernels' cases; the decoding kernel also takes a constant decay (3)
CASES = [(2, 1, 0), (2, 0, 0), (2, 0, 1), (1, 1, 0), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 0, 0), (0, 0, 1)]
STEP_CASES = [(decay, delta, bonus) for decay in (0, 1, 2, 3) for delta, bonus in ((0, 0), (0, 1), (1, 0))]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32"}


def load_package(folder: Path, name: str = "kernels_under_test"):
    """The kernel package in ``folder``, imported as the package ``name`` without running its ``__init__``."""
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    return package


def entry(package, what: str):
    module, function = ENTRY[what]
    return getattr(importlib.import_module(f"{package.__name__}.{module}"), function)


def case_tag(decay: int, delta: int, bonus: int) -> str:
    return f"d{decay}{'delta' if delta else 'add'}{'B' if bonus else ''}"


def gate_argument(backward, g) -> tuple:
    """``(g,)`` for a revision whose ``chunk_backward`` takes the log decay g (before it read only the saved
    cumulative gates G), else ``()``."""
    return (g,) if "g" in inspect.signature(backward).parameters else ()


def record_launches(package, dtype: torch.dtype, K: int, varlen: bool) -> list[tuple]:
    """Every launch of a forward+backward of each case of ``CASES``, and of a decoding call of each of
    ``STEP_CASES``, run on meta tensors: ``(case, kernel, args, constexprs, warps, stages, maxnreg)``."""
    launch_module = importlib.import_module(f"{package.__name__}.{ENTRY['run'][0]}")
    forward, backward, step = entry(package, "forward"), entry(package, "backward"), entry(package, "step")
    seen: list[tuple] = []
    tag = ""

    def recorder(kernel, grid, args, constexprs, warps, stages, maxnreg=None, compiled=None):
        seen.append((tag, kernel, tuple(args), dict(constexprs), warps, stages, maxnreg))
        return None

    setattr(launch_module, ENTRY["run"][1], recorder)
    meta = torch.device("meta")
    H = 16 if K > 64 else 32
    B, T = (1, 8 * 2048) if varlen else (8, 2048)
    N = 8
    cu = torch.empty(N + 1, dtype=torch.int32, device=meta) if varlen else None
    for decay, delta, bonus in CASES:
        tag = case_tag(decay, delta, bonus)
        q, k = (torch.empty(B, T, H, K, dtype=dtype, device=meta) for _ in range(2))
        v = torch.empty(B, T, H, K, dtype=dtype, device=meta)
        g = None if decay == 0 else torch.empty(B, T, H, *((K,) if decay == 2 else ()), device=meta)
        beta = torch.empty(B, T, H, dtype=dtype, device=meta) if delta else None
        u = torch.empty(H, K, dtype=dtype, device=meta) if bonus else None
        h0 = torch.empty(N, H, K, K, device=meta)
        o, hN, saved = forward(q, k, v, g, beta, u, h0, cu, K ** -0.5, decay, True)
        backward(q, k, v, *gate_argument(backward, g), beta, u, h0, cu, saved, torch.empty_like(o),
                 torch.empty_like(hN), K ** -0.5, decay)
    for decay, delta, bonus in STEP_CASES:
        tag = "step-" + case_tag(decay, delta, bonus)
        q, k, v = (torch.empty(N, 16, H, K, dtype=dtype, device=meta) for _ in range(3))
        g = {0: None, 1: torch.empty(N, 16, H, device=meta), 2: torch.empty(N, 16, H, K, device=meta),
             3: torch.empty(H, device=meta)}[decay]
        beta = torch.empty(N, 16, H, dtype=dtype, device=meta) if delta else None
        u = torch.empty(H, K, dtype=dtype, device=meta) if bonus else None
        step(q, k, v, g, beta, u, torch.empty(N, H, K, K, device=meta), K ** -0.5, decay)
    return seen


def compile_launch(kernel, args: tuple, constexprs: dict, warps: int, stages: int, maxnreg: Optional[int]):
    """The launch compiled for sm_90 as the JIT would specialise it (see the module docstring)."""
    names = kernel.arg_names
    signature, consts, attrs = {}, dict(constexprs), {}
    for i, (name, a) in enumerate(zip(names, args)):
        if a is None:
            signature[name], consts[name] = "constexpr", None
        elif isinstance(a, torch.Tensor):
            signature[name] = POINTER[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in names[len(args):]:
        signature[name] = "constexpr"
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg})


def _specialization(a) -> object:
    """What :func:`compile_launch` compiles one argument as."""
    if isinstance(a, torch.Tensor):
        return POINTER[a.dtype]
    if a is None or isinstance(a, float):
        return a
    return "i32", a % 16 == 0


def usage(compiled) -> tuple[int, int, int]:
    """(shared memory bytes, registers per thread, stack bytes per thread) of a compiled kernel, by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        text = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", text).groups())
    return compiled.metadata.shared, regs, stack


def resources(kernel, compiled) -> tuple[int, int, int, int, int, str, str]:
    """(shared memory bytes, registers per thread, stack bytes per thread, vectorised and all global load
    instructions of the PTX, a hash of the PTX without its debug information and its kernel's name, a hash of
    its :func:`body`)."""
    shared, regs, stack = usage(compiled)
    ptx = compiled.asm["ptx"].split(".section")[0]  # the debug sections hold source paths and lines
    code = "\n".join(line for line in ptx.splitlines()  # $L__tmp labels mark inlined functions' debug scopes
                     if not line.strip().startswith((".loc", ".file", "//", "$L__tmp")))
    code = code.replace(kernel.__name__, "KERNEL")
    loads = re.findall(r"\bld\.global\.(v\d)?", ptx)
    return (shared, regs, stack, sum(1 for width in loads if width), len(loads),
            hashlib.sha1(code.encode()).hexdigest()[:10], hashlib.sha1(body(code).encode()).hexdigest()[:10])


def body(code: str) -> str:
    """The PTX without its parameter list, each parameter named by the order of its first use: two kernels whose
    bodies agree here differ only in parameters they never read (as when an absent tensor is passed as None
    rather than as a stand-in pointer)."""
    code = "\n".join(line for line in code.splitlines() if not line.strip().startswith(".param"))
    names: dict = {}
    return re.sub(r"KERNEL_param_\d+", lambda m: names.setdefault(m.group(0), f"P{len(names)}"), code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="kernel names, comma-separated (e.g. state_bwd_kernel,grads_kernel)")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--K", type=int, default=128, help="head dim K (= V)")
    parser.add_argument("--varlen", action="store_true", help="packed sequences (cu_seqlens)")
    parser.add_argument("--package", type=Path, default=PACKAGE, help="the kernel package's folder")
    args = parser.parse_args()
    package = load_package(args.package)
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, K = V = {args.K}{', varlen' if args.varlen else ''}")
    launches = record_launches(package, DTYPES[args.dtype], args.K, args.varlen)
    done: dict = {}
    occurrences: Counter = Counter()
    for tag, kernel, largs, constexprs, warps, stages, maxnreg in launches:
        name = kernel.__name__
        occurrences[(tag, name)] += 1
        label = name if occurrences[(tag, name)] == 1 else f"{name}#{occurrences[(tag, name)]}"
        if args.only and name not in args.only.split(","):
            continue
        key = (name, tuple(_specialization(a) for a in largs), tuple(constexprs.items()), warps, stages, maxnreg)
        try:
            if key not in done:
                done[key] = resources(kernel, compile_launch(kernel, largs, constexprs, warps, stages, maxnreg))
            smem, regs, stack, vec, loads, code, code_body = done[key]
            cap = f" (cap {maxnreg})" if maxnreg else ""
            print(f"{label:22s} {tag:14s} {warps} warps {stages} stages  smem {smem:6d} B  regs {regs:3d}{cap}  "
                  f"stack {stack:5d} B  vector loads {vec:3d}/{loads:3d}  ptx {code} body {code_body}", flush=True)
        except Exception as error:  # a variant that does not compile says why
            print(f"{label:22s} {tag:14s} {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    main()
