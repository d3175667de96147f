"""Compile the chunked Bayesian filter's kernels (backend "chunk_triton") for sm_90 (Hopper) without a GPU, and print
what each needs: shared memory against the 227 KiB a block may take, registers per thread and the local-memory
stack (register spills). The kernels hold the states on chip, so a head dim or chunk size that does not fit fails
only at launch; this says so beforehand. Without a GPU (and with TRITON_INTERPRET unset)::

    python dev/kernels/bayes_chunk_resources.py                      # the default launches at K = V = 64 and 128
    python dev/kernels/bayes_chunk_resources.py --K 128 --chunk 16 --warps 4

The tensors are compiled as bf16 inputs with fp32 states, the variance on, fixed length (the variants that hold
the most). A compile takes one to a few minutes per kernel on one CPU core.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel_resources import usage  # noqa: E402  (this folder's tool)
from linmem.ops.bayes import chunk_bwd, chunk_fwd  # noqa: E402

#: the shared memory one block may take on an H100 / H200
SHARED_LIMIT = 227 * 1024
F32, BF16 = "*fp32", "*bf16"


def signatures(K: int, chunk: int) -> dict:
    """(kernel, signature, constexprs) of the forward and the backward at key and value head dim K."""
    BK = chunk_fwd.pow2(K)
    fwd = dict(q=BF16, k=BF16, v=BF16, gates=F32, M0=F32, P0=F32, o=BF16, var=F32, MT=F32, PT=F32, states=F32,
               factors=F32, cu_seqlens="*i32", scale="fp32", prior="fp32", T="i32", H="i32", K="i32", V="i32")
    bwd = dict(q=BF16, k=BF16, v=BF16, gates=F32, states=F32, factors=F32, scratch=F32, do=BF16, dvar=F32, dMT=F32,
               dPT=F32, dq=BF16, dk=BF16, dv=BF16, dgates=F32, dM0=F32, dP0=F32, cu_seqlens="*i32", scale="fp32",
               T="i32", H="i32", K="i32", V="i32")
    shape = dict(IS_VARLEN=False, C=chunk, BK=BK, BV=BK)
    return {
        "forward": (chunk_fwd.chunk_fwd_kernel, fwd, dict(HAS_INIT=True, VAR=True, SAVE=True, **shape)),
        "backward": (chunk_bwd.chunk_bwd_kernel, bwd, dict(VAR=True, **shape)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--K", type=int, nargs="+", default=[64, 128], help="key = value head dims")
    parser.add_argument("--chunk", type=int, help="tokens per chunk (default: ChunkLaunch.default's)")
    parser.add_argument("--warps", type=int, help="warps per program (default: ChunkLaunch.default's)")
    args = parser.parse_args()
    for K in args.K:
        default = chunk_fwd.ChunkLaunch.default(K, K)
        chunk, warps = args.chunk or default.chunk, args.warps or default.num_warps
        for name, (kernel, signature, constexprs) in signatures(K, chunk).items():
            source = ASTSource(fn=kernel, signature={**signature, **{c: "constexpr" for c in constexprs}},
                               constexprs=constexprs)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
            shared, regs, stack = usage(compiled)
            verdict = "fits" if shared <= SHARED_LIMIT else f"DOES NOT FIT ({SHARED_LIMIT // 1024} KiB)"
            print(f"K = V = {K:3d}  C = {chunk:2d}  warps {warps}  {name:8s}  shared {shared / 1024:6.1f} KiB {verdict}"
                  f"  registers {regs:3d}  stack {stack:5d} B", flush=True)


if __name__ == "__main__":
    main()
