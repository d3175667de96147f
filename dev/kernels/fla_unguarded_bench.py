"""`linmem bench ops` with flash-linear-attention's Hopper guard turned off, to time fla's gated kernels.

fla 0.6.0 refuses the backward of ``chunk_gated_delta_rule`` and ``chunk_simple_gla`` on Hopper with
Triton 3.4 to 3.7.0, where a miscompilation of its gated ``chunk_bwd_dqkwg`` kernel gave wrong gradients
(fla issue 640). The guard is one module flag; this script sets it and runs the bench, so that our gated
delta rule and Mamba-2 can be timed beside fla's in the same run. Timing only: check fla's gradients on
the same stack with ``--accuracy`` (they were right at 2 x 1024 on Triton 3.6, H200) and do not
train with them. Arguments are those of ``linmem bench ops``::

    python dev/kernels/fla_unguarded_bench.py --peers fla --ops gated_deltanet,mamba2 --accuracy
"""

from __future__ import annotations

import sys

import fla.ops.common.chunk_o as chunk_o

from linmem.cli import main

chunk_o.TRITON_ABOVE_3_7_1 = True  # the guard's flag: "this Triton is not in the miscompiling range"

if __name__ == "__main__":
    sys.exit(main(["bench", "ops", *sys.argv[1:]]))
