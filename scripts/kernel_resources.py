"""Compile the Triton kernels of the recurrence for sm_90 (Hopper) without a GPU and print what each
variant needs: shared memory, registers per thread and the local-memory stack (register spills).

Needs only triton (no torch): the kernel modules import nothing else, and the launch configs are
read from ``launch.py`` as text. Use the Triton of the GPU image to see what it will build::

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python scripts/kernel_resources.py                  # bf16, K = V = 128, every kernel
    /tmp/t36/bin/python scripts/kernel_resources.py --only state_bwd,grads --K 256 --dtype fp32

A stack above 0 bytes is a spill. "vector loads" counts the global loads of the PTX that move
more than one element per instruction: a kernel whose addresses lose their alignment or
contiguity facts falls back to 2-byte loads (an opaque offset added to an arange does that).
Pointers and the sizes T, H, K, V are compiled as the JIT launch specialises them at the
benchmark shapes (16-byte aligned, divisible by 16); without that, every kernel looks scalar
and spills more than it does on the GPU. "ptx" hashes the generated code without its debug
information (line directives, and the labels that mark inlined functions' scopes): a refactor of
the kernels that leaves every hash unchanged (compare the output before and after, for each
dtype and with --varlen) compiles to the code that was verified on the GPU.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNELS = Path(__file__).resolve().parent.parent / "linmem" / "ops" / "recurrence" / "triton"


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"lk.{name}", KERNELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"lk.{name}"] = module
    spec.loader.exec_module(module)
    return module


def launch_setting(name: str):
    """A literal module-level setting of launch.py (``LAUNCH``, ``SEQUENTIAL``, ``PAIR_SUB``, ...), read without
    importing it (it imports torch)."""
    tree = ast.parse((KERNELS / "launch.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return ast.literal_eval(node.value)


def variants(fwd, bwd, rec, dt: str, K: int, varlen: int):
    """(kernel name, tag, function, pointer dtypes, constexprs, (warps, stages)) of every kernel a benchmark run
    uses; the sequential passes as ``launch.sequential_config`` sets them on a grid of one program per SM or more."""
    f32 = "*fp32"
    LAUNCH, PAIR_SUB, SPAN = launch_setting("LAUNCH"), launch_setting("PAIR_SUB"), launch_setting("BLOCK_SPAN")
    CSPAN = launch_setting("CHUNK_SPAN")
    CAP = launch_setting("MAX_REGISTERS")
    cfg = lambda key: (*LAUNCH[key], CAP.get(key))  # noqa: E731  (warps, stages, maxnreg)
    SEQUENTIAL, WARPS = launch_setting("SEQUENTIAL"), launch_setting("SEQUENTIAL_WARPS")
    BKF, BK, BV = max(16, 1 << (K - 1).bit_length()), min(64, max(16, 1 << (K - 1).bit_length())), 64
    for decay, delta, bonus in [(2, 1, 0), (2, 0, 0), (2, 0, 1), (1, 1, 0), (1, 0, 0), (0, 1, 0), (0, 0, 0)]:
        tag = f"d{decay}{'delta' if delta else 'add'}{'B' if bonus else ''}"
        bf16 = dt == "*bf16"  # bf16 inputs: the delta rule's corrected writes are bf16 (launch.Precision), and so are
        factors = bf16 and K <= launch_setting("BF16_FACTORS_MAX_K")  # its W and U (launch.factors_dtype)
        wy = (dt if factors else f32) if delta else dt  # the delta rule's W and U (T is fp32)
        w_t = bool(delta and factors) and decay in launch_setting("W_READ_TRANSPOSED")  # state_fwd reads W from Wt
        wt = (dt if bf16 else f32) if delta else dt  # the writes
        sc = f32 if decay == 2 and dt == "*fp16" else dt  # the score gradients dA and dL (launch.chunk_backward)
        if decay == 2 and not bonus or decay == 1 and not delta:  # the delta rule's prep kernel takes a scalar one
            yield "cumsum", tag, fwd.chunk_cumsum_kernel, {"g": f32, "G": f32, "cu_seqlens": "*i32"}, \
                dict(VECTOR=int(decay == 2), IS_VARLEN=varlen, C=64, BK=BK), cfg("cumsum")
        if delta:
            yield "prep", tag, fwd.delta_prep_kernel, {"k": dt, "v": dt, "beta": dt, "g": f32 if decay == 1 else dt,
                                                       "G": f32, "Tt": f32, "W": wy, "Wt": dt, "U": wy, "kg": dt,
                                                       "cu_seqlens": "*i32"}, \
                dict(DECAY=decay, IS_VARLEN=varlen, STORE_W=int(not w_t), C=64, SB=16, BK=BK, BV=BV, SPAN=SPAN,
                     CSPAN=CSPAN, KP=BKF), cfg("prep_vector" if decay == 2 else "prep")
        # bf16 inputs' delta rule: the wide grid's pass with bf16 W and U (launch.factors_dtype)
        fbv, fstages = SEQUENTIAL[("state_fwd_bf16" if delta and factors else "state_fwd", bool(delta), decay)]
        bbv, bstages = SEQUENTIAL[("state_bwd", bool(delta), decay)]
        yield "state_fwd", tag, fwd.state_fwd_kernel, {"k": dt, "vu": wy, "W": wy, "G": f32, "hs": dt, "d_out": wt,
                                                       "h0": f32, "hN": f32, "cu_seqlens": "*i32"}, \
            dict(DECAY=decay, DELTA=delta, IS_VARLEN=varlen, HAS_INIT=1, STORE_FINAL=1, W_T=int(w_t), NARROW=0,
                 C=64, BKF=BKF, KB=BK if delta else BKF, BV=fbv), (WARPS, fstages, None)  # launch.Shapes.state_KB
        yield "output", tag, fwd.output_kernel, {"q": dt, "k": dt, "d": wt, "v": dt, "G": f32, "u": dt, "hs": dt,
                                                 "A_out": dt, "o": dt, "qg": dt, "cu_seqlens": "*i32"}, \
            dict(DECAY=decay, BONUS=bonus, IS_VARLEN=varlen, STORE_QG=int(decay == 2 and delta), C=64, SB=PAIR_SUB,
                 BK=min(BK, 32) if decay == 2 else BK, BV=BV, SPAN=SPAN, CSPAN=CSPAN, KP=BKF), \
            cfg("output_vector" if decay == 2 else "output")  # launch.chunk_forward
        yield "state_bwd", tag, bwd.state_bwd_kernel, {"q": dt, "k": dt, "Wt": dt, "G": f32, "A": dt, "do": dt,
                                                       "dd_out": wt, "dHs": dt, "dhN": f32, "dh0": f32,
                                                       "cu_seqlens": "*i32"}, \
            dict(DECAY=decay, DELTA=delta, BONUS=bonus, IS_VARLEN=varlen, HAS_DFINAL=1, STORE_DINIT=1, C=64,
                 BKF=BKF, KB=BK if delta else BKF, BV=bbv), (WARPS, bstages, None)  # launch.Shapes.state_KB
        if not delta:
            yield "dv", tag, bwd.dv_kernel, {"q": dt, "k": dt, "G": f32, "u": dt, "A": dt, "do": dt, "dHs": dt,
                                             "dv": dt, "cu_seqlens": "*i32"}, \
                dict(DECAY=decay, BONUS=bonus, IS_VARLEN=varlen, C=64, BK=BK,
                     BV=min(triton.next_power_of_2(K), 128) if decay else BV), cfg("dv")  # launch.Shapes.dv_BV
        wy_fused = bool(delta) and bf16 and decay in launch_setting("WY_FUSED")  # wy_grads inside score_grads
        wy_BK = min(BK, 32) if decay == 2 else BK  # launch.Shapes.wy_BK
        yield "score_grads", tag, bwd.score_grads_kernel, {"q": dt, "v": dt, "beta": dt, "G": f32, "Tt": f32,
                                                           "d": wt, "do": dt, "dd": wt, "dA_out": sc, "dL_out": sc,
                                                           "Y_out": dt, "dv": dt, "dbeta": f32, "dov_out": f32,
                                                           "k": dt, "hs": dt, "dk": dt, "dg": f32,
                                                           "cu_seqlens": "*i32"}, \
            dict(DECAY=decay, DELTA=delta, BONUS=bonus, IS_VARLEN=varlen, WY=int(wy_fused), C=64, SB=PAIR_SUB,
                 BK=wy_BK, BV=BV, SPAN=SPAN, CSPAN=CSPAN, KP=BKF), \
            cfg(("score_wy_grads" if wy_fused else "score_grads_delta") if delta else "score_grads")  # chunk_backward
        key_grid = not bonus if decay == 2 else (decay == 0 or bf16)  # launch.key_grid
        grads_BK = BK if key_grid or decay == 2 else min(BKF, 128)  # launch.Shapes.grads_BK
        if delta and not wy_fused:
            yield "wy_grads", tag, bwd.wy_grads_kernel, \
                {"k": dt, "beta": dt, "G": f32, "hs": dt, "Y": dt, "dL_in": sc, "dk": dt, "dbeta": f32, "dg": f32,
                 "cu_seqlens": "*i32"}, \
                dict(DECAY=decay, IS_VARLEN=varlen, C=64, SB=PAIR_SUB, BK=wy_BK, BV=BV, SPAN=SPAN, CSPAN=CSPAN,
                     KP=BKF), \
                cfg("wy_grads_vector" if decay == 2 else "wy_grads")
        if decay == 2:
            yield "intra_grads", tag, bwd.intra_grads_kernel, {"q": dt, "k": dt, "G": f32, "dA_in": sc, "dqi": f32,
                                                              "dki": f32, "cu_seqlens": "*i32"}, \
                dict(BONUS=bonus, IS_VARLEN=varlen, C=64, RB=launch_setting("INTRA_ROWS"), BK=BK, SPAN=SPAN,
                     CSPAN=CSPAN, KP=BKF), \
                cfg("intra_grads")
        if decay == 0 or (decay == 1 and dt == f32):  # launch.chunk_backward
            sides = [(1, f"grads{'_scalar' if decay else ''}_query"), (2, f"grads{'_scalar' if decay else ''}_key")]
        else:
            sides = [(0, ("grads_vector" if key_grid else "grads_vector_loop") if decay == 2 else
                      ("grads_scalar" if key_grid else "grads_pipelined"))]
        for side, grads in sides:
            yield grads, tag, bwd.grads_kernel, \
                {"q": dt, "k": dt, "G": f32, "u": dt, "d": wt, "hs": dt, "dHs": dt, "do": dt, "dA_in": sc,
                 "dov_in": f32, "dqi": f32, "dki": f32, "dq": dt, "dk": dt, "dg": f32, "du": f32, "cu_seqlens": "*i32"}, \
                dict(DECAY=decay, DELTA=delta, BONUS=bonus, IS_VARLEN=varlen, SIDE=side, C=64, BK=grads_BK, BV=BV,
                     CSPAN=CSPAN, KP=BKF, KGRID=-(-K // grads_BK) if key_grid else 1), \
                cfg(grads)
    yield "recurrent", "d2delta", rec.recurrent_kernel, \
        {n: dt for n in "q k v o u beta".split()} | {"g": f32, "S": f32}, \
        dict(DECAY=2, DELTA=1, BONUS=0, BK=BKF, BV=launch_setting("RECURRENT_BV")), cfg("recurrent")


def resources(fn, pointers: dict, constexprs: dict, warps: int, stages: int, maxnreg: Optional[int]
              ) -> tuple[int, int, int, int, int, str]:
    """(shared memory bytes, registers per thread, stack bytes per thread, vectorised and all global
    load instructions of the PTX, a hash of the PTX without its debug line information) of one
    compiled variant (``maxnreg``: launch.MAX_REGISTERS, or None)."""
    names = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else pointers.get(p, "fp32" if p == "scale" else "i32")
                 for p in names}
    # what the JIT launch specialises: 16-byte aligned pointers and sizes divisible by 16
    # (T, H, K, V of the benchmark shapes; N = B is not); without it no load is vectorised
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(names)
             if p not in constexprs and (signature[p].startswith("*") or p in ("T", "H", "K", "V"))}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        text = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", text).groups())
    ptx = compiled.asm["ptx"].split(".section")[0]  # the debug sections hold source paths and lines
    code = "\n".join(line for line in ptx.splitlines()  # $L__tmp labels mark inlined functions' debug scopes
                     if not line.strip().startswith((".loc", ".file", "//", "$L__tmp")))
    loads = re.findall(r"\bld\.global\.(v\d)?", ptx)
    return (compiled.metadata.shared, regs, stack, sum(1 for width in loads if width), len(loads),
            hashlib.sha1(code.encode()).hexdigest()[:10])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="kernel names, comma-separated (cumsum, prep, state_fwd, output, "
                                       "state_bwd, dv, score_grads, wy_grads, intra_grads, grads_query, "
                                       "grads_key, grads_scalar_query, grads_scalar_key, grads_pipelined, "
                                       "grads_scalar, grads_vector, grads_vector_loop, recurrent)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--K", type=int, default=128, help="head dim K (= V)")
    parser.add_argument("--varlen", action="store_true")
    args = parser.parse_args()
    sys.modules["lk"] = types.ModuleType("lk")
    sys.modules["lk"].__path__ = [str(KERNELS)]
    _load("common")
    fwd, bwd, rec = _load("chunk_fwd"), _load("chunk_bwd"), _load("recurrent")
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, K = V = {args.K}{', varlen' if args.varlen else ''}")
    kernels = variants(fwd, bwd, rec, f"*{args.dtype}", args.K, int(args.varlen))
    for name, tag, fn, pointers, constexprs, (warps, stages, maxnreg) in kernels:
        if args.only and name not in args.only.split(","):
            continue
        try:
            smem, regs, stack, vec, loads, code = resources(fn, pointers, constexprs, warps, stages, maxnreg)
            cap = f" (cap {maxnreg})" if maxnreg else ""
            print(f"{name:15s} {tag:9s} {warps} warps {stages} stages  smem {smem:6d} B  regs {regs:3d}{cap}  "
                  f"stack {stack:5d} B  vector loads {vec:3d}/{loads:3d}  ptx {code}")
        except Exception as error:  # a variant that does not compile says why
            print(f"{name:15s} {tag:9s} {type(error).__name__}: {str(error).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
