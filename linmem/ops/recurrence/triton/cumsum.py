"""Stage 1 of the forward: the chunk-local cumulative gates.

``G = log2(e) cumsum(g)`` inside each chunk, fp32, for a scalar decay (``g`` [tokens, H]) or a per-channel one
(``g`` [tokens, H, K]); every later stage takes its decays as ``2^`` of differences of ``G``. The delta rule with
a scalar decay has its prep stage write ``G`` itself (``scalar_cumsum``), which saves this launch.

Each log decay is floored at ``LOG_DECAY_FLOOR`` as it is loaded (:func:`floored`). Any log decay in [-inf, 0]
is valid input: -inf is a decay of 0 (forget everything), and RWKV-6's ``-exp(d)`` or a bf16 ``log(sigmoid(x))``
reach it. Unfloored, a -inf gate makes ``G`` -inf from its token on, and the differences ``G_t - G_s`` of two such
tokens NaN; finite gates below about -1.7e38 overflow ``G`` to -inf when two of them meet in a chunk. A floored
gate decays by ``e^LOG_DECAY_FLOOR``, which is 0 in fp32 (and flushes to 0 in every ``exp2`` of the kernels, whose
results under 2^-126 flush), so every decay across it is exactly 0, as the reference's; ``G`` stays finite, at
most 64 floors below 0 in a chunk. A gate at or above the floor is loaded unchanged, so ``G``, and everything the
later stages compute from it, keeps its bits. The floor lies below -CHUNK_SPAN and -BLOCK_SPAN (log2 units), so a
chunk holding a floored gate never takes the one-reference or block paths, whose split factors would overflow.
The gradient of a floored gate is the cancellation of terms that meet at it (the exact value is 0), so it lies
within the rounding of those terms of 0.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .configs import CHUNK, Shapes, cdiv
from .launch import launch_kernel
from .layout import load_gate_rows, load_rows, locate_chunk, store_rows
from .numerics import LOG2E, running_total
from .switches import Decay

#: the least log decay the chunk kernels take (natural log units): e^-110 is 0 in fp32 (the least subnormal is
#: about e^-103), and 110 log2(e) = 158.7 exceeds the spans of configs.CHUNK_SPAN and BLOCK_SPAN (64)
LOG_DECAY_FLOOR: tl.constexpr = tl.constexpr(-110.0)


@triton.jit
def chunk_cumsum_kernel(g, G, cu_seqlens, T, H, N, K,
                        VECTOR: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """G = log2(e) x the cumulative sum of the log decay g inside each chunk, fp32 (decays are 2^(G_t - G_s)).

    g, G: [tokens, H] (one gate per token) or [tokens, H, K] (VECTOR). Grid (slots, H, K blocks).
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    slot, h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    if VECTOR:
        cols = kb * BK + tl.arange(0, BK)
        x = floored(load_rows(g, t0, nrows, h, H, K, rows, cols, False))
        store_rows(G, running_total(x, 0) * LOG2E, t0, nrows, h, H, K, rows, cols)
    else:
        scalar_cumsum(g, G, t0, nrows, h, H, C)


@triton.jit
def scalar_cumsum(g, G, t0, nrows, h, H, C: tl.constexpr):
    """A scalar decay's G ([tokens, H]) for one chunk (:func:`chunk_cumsum_kernel`)."""
    rows = tl.arange(0, C)
    x = floored(load_gate_rows(g, t0, nrows, h, H, rows))
    tl.store(G + (t0 * H + h) + rows * H, running_total(x, 0) * LOG2E, mask=rows < nrows)


@triton.jit
def floored(x):
    """Log decays below ``LOG_DECAY_FLOOR`` (-inf among them) raised to it; the others, and NaN, unchanged."""
    return tl.where(x < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, x)


def cumulative_gates(plan: dict, s: Shapes, *, g: torch.Tensor, G: torch.Tensor,
                     cu_seqlens: Optional[torch.Tensor], decay: Decay) -> None:
    """G = log2(e) x the chunk-local cumulative sum of g.

    g, G: [B, T, H] (scalar decay) or [B, T, H, K] (per-channel decay) fp32; cu_seqlens: [N + 1] int32 or None.
    """
    nkb = cdiv(s.K, s.BK) if decay == Decay.CHANNEL else 1
    launch_kernel(plan, "cumsum", chunk_cumsum_kernel, (s.slots, s.H, nkb),
                  g, G, cu_seqlens, s.T, s.H, s.N, s.K, VECTOR=int(decay == Decay.CHANNEL), C=CHUNK, BK=s.BK)
