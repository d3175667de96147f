"""Compile every fused kernel for a GPU target ahead of time (Triton's bundled ptxas; no GPU needed) and report
its registers and stack (spills) per thread, as the launchers configure it.

    python dev/gpu/tools/fused_compile_check.py [--arch 90]        # exits 1 if a kernel fails to compile or spills

Run it after changing a kernel or a tile size: it needs no device, and a spill shows as STACK > 0. Pointers are
compiled as 16-byte aligned and the convolution's sizes and strides as multiples of 16, as the JIT specialises
them at the models' shapes (C = 1024, T = 2048): that decides which loads and stores are vectorised.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from linmem.ops.fused.triton import conv, cross_entropy, norm, swiglu  # noqa: E402

BF, F32, I32P = "*bf16", "*fp32", "*i32"
CONV = dict(x=BF, w=BF, bias=BF, h0=BF, y=BF, dy=BF, dz=F32, dfinal=BF, dx=BF, dw=F32, db=F32, dh0=F32, final=BF,
            state=BF, cu_seqlens=I32P, sxb="i64")
#: the convolution's integer arguments that are multiples of 16 at the models' shapes
CONV_ALIGNED = ("T", "C", "CHUNK", "sxb", "sxt")
ROWS = dict(x=BF, res=BF, gate=BF, w=BF, y=BF, h=BF, dy=BF, dh=BF, dx=BF, dgate=BF, dw=F32, rinv=F32, eps="fp32")


def kernels():
    """(name, kernel, pointer/float argument types (the rest i32), constexprs, warps) as the launchers run them."""
    conv_tile = dict(BT=conv.BLOCK_T, BC=conv.BLOCK_C)
    dx_tile = dict(BT=min(conv.BLOCK_T, conv.DW_ROWS // 4), BC=conv.BLOCK_C, BW=4)  # as conv_backward at W = 4
    for varlen in (0, 1):
        for h0 in (False, True):
            flags = dict(W=4, HAS_BIAS=True, HAS_H0=h0, IS_VARLEN=varlen)
            yield (f"conv_fwd varlen={varlen} h0={h0}", conv.conv_fwd_kernel, CONV, dict(ACT=1, **flags, **conv_tile),
                   conv.WARPS)
            yield (f"conv_dz varlen={varlen} h0={h0}", conv.conv_dz_kernel, CONV, dict(ACT=1, **flags, **conv_tile),
                   conv.WARPS)
            for dfinal in (True, False) if not h0 else (True,):  # training: no history, no final state
                yield (f"conv_dx varlen={varlen} h0={h0} dfinal={dfinal}", conv.conv_dx_kernel, CONV,
                       dict(HAS_DFINAL=dfinal, **flags, **dx_tile), conv.WARPS)
        small = dict(W=4, IS_VARLEN=varlen, BJ=4, BC=conv.BLOCK_C)
        yield f"conv_state_bwd varlen={varlen}", conv.conv_state_bwd_kernel, CONV, dict(HAS_DFINAL=True, **small), 4
        yield f"final_state varlen={varlen}", conv.final_state_kernel, CONV, dict(HAS_H0=True, **small), 4
    yield "conv_step", conv.conv_step_kernel, CONV, dict(W=4, ACT=1, HAS_BIAS=True, BJ=4, BC=conv.BLOCK_C), 4
    for D in (128, 1024, 4096):
        BM, BD = norm._tile(1 << 14, D)
        warps = norm._warps(BD)
        for res, gate in ((True, 0), (False, 1), (False, 2)):
            yield (f"rms_norm_fwd D={D} res={res} gate={gate}", norm.rms_norm_fwd_kernel, ROWS,
                   dict(HAS_RES=res, GATE=gate, BM=BM, BD=BD), warps)
            yield (f"rms_norm_bwd D={D} res={res} gate={gate}", norm.rms_norm_bwd_kernel, ROWS,
                   dict(HAS_DH=res, GATE=gate, BM=BM, BD=BD), warps)
        yield f"l2_norm_fwd D={D}", norm.l2_norm_fwd_kernel, ROWS, dict(BM=BM, BD=BD), warps
        yield f"l2_norm_bwd D={D}", norm.l2_norm_bwd_kernel, ROWS, dict(BR=BM, BD=BD), warps
    BM, BD = swiglu._tile(1 << 14, 2752)
    glu = dict(g=BF, u=BF, y=BF, dy=BF, dg=BF, du=BF)
    yield "swiglu_fwd", swiglu.swiglu_fwd_kernel, glu, dict(BM=BM, BD=BD), swiglu.WARPS
    yield "swiglu_bwd", swiglu.swiglu_bwd_kernel, glu, dict(BM=BM, BD=BD), swiglu.WARPS
    yield ("ce_grad V=32000", cross_entropy.ce_grad_kernel, dict(logits=BF, labels="*i64", loss=F32, scale=F32),
           dict(GRAD=True, BV=cross_entropy.BLOCK_V), 8)


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK (per thread) and SHARED (static bytes; the launch adds the compiled kernel's dynamic shared
    memory, printed beside it)."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    fields = next(line for line in out.splitlines() if "REG:" in line).split()
    return {k: int(v) for k, v in (f.split(":") for f in fields if f.startswith(("REG:", "STACK:", "SHARED:")))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    target = GPUTarget("cuda", args.arch, 32)
    failed = False
    print(f"{'kernel':48s} {'warps':>5s} {'REG':>4s} {'STACK':>6s} {'SHARED':>7s} {'DYNAMIC':>7s}")
    for name, fn, types, constexprs, warps in kernels():
        signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in fn.arg_names}
        consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
        aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.arg_names)
                   if signature[p].startswith("*") or (types is CONV and p in CONV_ALIGNED)}
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned),
                                      target=target, options={"num_warps": warps})
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            print(f"{name:48s} FAILED: {type(e).__name__}: {str(e)[:300]}")
            failed = True
            continue
        use = resource_usage(compiled.asm["cubin"])
        failed |= use["STACK"] > 0
        print(f"{name:48s} {warps:5d} {use['REG']:4d} {use['STACK']:6d} {use['SHARED']:7d} "
              f"{compiled.metadata.shared:7d}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
