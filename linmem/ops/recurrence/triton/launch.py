"""Launchers of the Triton kernels: tensors in, tensors out, no autograd.

``chunk_forward`` and ``chunk_backward`` run the kernel family of ``chunk_fwd`` and
``chunk_bwd`` for one configuration (decay kind, rule, bonus, varlen); ``recurrent_step``
runs the fused recurrent kernel. Everything here is shape arithmetic: no host
synchronisation, so a varlen batch costs no more host time than a fixed one.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import triton.runtime.errors

try:  # Triton 3.4 on: the launch hooks live in knobs; before it, every launch goes through the dispatcher
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:
    _knobs = _driver = None

from . import chunk_bwd, chunk_fwd, recurrent
from .common import CHUNK, SUB

logger = logging.getLogger("linmem.ops")

#: decay kinds of the kernels (``constant`` is expanded to ``scalar`` before the chunk kernels' launch)
DECAY_CODES = {"none": 0, "scalar": 1, "vector": 2}
#: the recurrent kernel's code for a constant decay, read as given ([H]): expanded per token and copied, it cost
#: each decoding step a copy kernel and its host time
CONSTANT_DECAY = 3

#: (num_warps, num_stages) per kernel but the sequential passes (``SEQUENTIAL``; ``linmem bench ops --launch``
#: tries others). Measured on an H200 at B x T = 8 x 2048, H = 16, K = V = 128: prep at 4 warps (deltanet
#: forward 1.47 -> 0.85 ms); score_grads at
#: 4 warps (8: deltanet 2.84 -> 2.97 ms), grads at 8 (4: gla 5.39 -> 5.93 ms). Stages, per kernel alone
#: (session 4): prep 2 -> 3 (deltanet 0.446 -> 0.423 ms), output 2 -> 3 (gla 0.843 -> 0.789, deltanet
#: 0.188 -> 0.162); score_grads 1 -> 2 lost (deltanet 0.340 -> 0.535). Session 7, with the delta rule's
#: WY part in its own kernel: grads 1 -> 2 stages for the decayed delta rules only ("grads_pipelined":
#: gated 0.453 -> 0.434, kda 2.16 -> 2.11; deltanet's went 0.284 -> 0.393); wy_grads at 4 warps, 1 stage
#: (deltanet 0.315 ms; 0.488 at 8 warps, 0.332 at 2 stages). Session 8: the additive rule's dv at 4 warps,
#: 1 stage (gla 0.141 ms, rwkv6 0.190; at 2 stages 0.157 and 0.208, at 3 0.180 and 0.260; linear attention
#: and mamba2 within 6 us of their best, 2 stages). With the intra-chunk parts out of grads_kernel, per-channel
#: decays' grads also take 2 stages ("grads_pipelined": gla 0.857 -> 0.776 ms, rwkv6 0.897 -> 0.851; 4 warps and 2
#: stages miscompiles rwkv6, and 16 warps lost). Session 10, with the pairs in halves of its blocks: intra_grads at
#: 4 warps, 2 stages (gla 0.677 ms, rwkv6 0.779, kda 0.678; at 2 warps, 2 stages 0.721, 0.950, 0.720; 4 warps,
#: 1 stage 0.724, 0.785, 0.725; 8 warps, 2 stages 0.967, 0.828, 0.966). With one reverse cumulative sum in
#: grads_kernel, per-channel decays' grads take 3 stages ("grads_vector": gla 0.675 -> 0.642 ms, rwkv6 0.742 ->
#: 0.712; 16 warps at 2 stages 0.728, 0.867). Session 12, with a scalar decay's gate gradient as two row sums
#: per key block: every scalar decay's grads take 2 stages (mamba2 0.393 ms at 1 stage before -> 0.322, 0.420 at
#: 1 stage; gated delta 0.378 -> 0.354). Without a decay, grads runs as two launches (the query side, then the key
#: side: ``grads_query`` and ``grads_key``) at key blocks of 128, about 120 registers each, two 8-warp programs per
#: SM: deltanet 0.262 -> 0.240 ms, linear attention 0.239 -> 0.212 (at key blocks of 64: 0.264). Session 13: the output
#: kernel of the rules without a per-channel decay at 4 warps ("output"; per-channel decays keep 8, "output_vector"):
#: linear attention 0.155 -> 0.128 ms at 8 x 2048 and 1 x 16384; deltanet fwd+bwd 1.496 -> 1.466 and 1.810 -> 1.776.
#: Session 19, at 4 x 4096 and 1 x 16384: the per-channel output kernel at 4 warps, 3 stages, 168 registers (three
#: programs per SM; MAX_REGISTERS): gla 0.285 -> 0.213 ms, kda 0.318 -> 0.233 (4 warps at 128 registers: 0.235 and
#: 0.243; uncapped: 0.252 and 0.274; 2 or 4 stages lost); the delta rule's score_grads at 2 stages
#: ("score_grads_delta"): deltanet 0.239 -> 0.222 ms, gated delta 0.255 -> 0.238, kda 0.240 -> 0.222 (3 stages the
#: same). The additive rules' score_grads stay at 1 stage: at 2 or 3 Triton 3.6 miscompiles rwkv6's on Hopper (dq
#: 9.3e-3 and 1.6e-3 off the 1-stage kernel's), and the others gained under 6 us. Capped at 168 registers (three
#: 4-warp programs per SM, MAX_REGISTERS), at 4 x 4096: the other rules' output kernel, gated delta and mamba2 0.161
#: -> 0.137 ms (deltanet's and linear attention's take 168 uncapped); deltanet's prep 0.314 -> 0.301 and wy_grads
#: 0.172 -> 0.157 (gated delta's the same within 2 us). KDA's prep and wy_grads lost capped (0.485 -> 0.551, 0.467
#: -> 0.720; their own entries, "prep_vector" and "wy_grads_vector"), as did the delta rule's score_grads (0.224 ->
#: 0.273), the scalar decays' grads at 128 (gated 0.352 -> 0.576, mamba2 0.324 -> 0.548) and the per-channel
#: decays' at 128 (kda 0.833 -> 1.016). The decay-free grads' two launches one stage deeper (grads_query 2 -> 3,
#: grads_key 1 -> 2): deltanet 0.240 -> 0.224 ms at 4 x 4096 and 8 x 2048 (linear attention's query side 0.211
#: -> 0.206 alone, its key side 0.211 -> 0.213 alone). Session 21, the decoding kernel (B = 64, one step in a CUDA
#: graph, us; V block 32): 4 -> 2 warps, deltanet 43.0 -> 41.3, kda 45.0 -> 42.9, gla 41.4 -> 41.5, mamba2 40.2 -> 40.0
#: (V blocks of 16 or 64, 1 or 8 warps, 1 stage: none faster over the four). Session 23, a scalar decay's grads as
#: two launches too ("grads_scalar_query", "grads_scalar_key"; the gate gradient's row sums joined through dg): with
#: fp32 inputs at 4 x 4096, gated delta grads 4.28 -> 2.27 ms, mamba2 4.16 -> 2.26 with IEEE products (the one
#: kernel spilled 1.4 KB), 2.78 -> 2.24 and 2.75 -> 2.20 with tf32x3 products (``common.mm``); with
#: bf16 they lost at 8 x 2048, gated delta 0.353 -> 0.527, mamba2 0.322 -> 0.503 (136 and 243 registers, one
#: 8-warp program per SM each; best of key blocks of 64, 4 warps, 1 to 3 stages and a 128-register cap: 0.436 and
#: 0.396), so bf16 and fp16 inputs keep the one kernel. Session 27, with the key blocks on the grid (``key_grid``),
#: at 4 x 4096 (8 x 2048 alike): the per-channel grads at 4 warps, 3 stages (two programs per SM; kda 0.836 ->
#: 0.631 ms, gla 0.741 -> 0.564; at 8 warps unchanged, at 2 or 4 stages, key blocks of 32 or a 168-register cap
#: slower), the scalar decays' at 4 warps, 3 stages ("grads_scalar": gated delta 0.355 -> 0.293, mamba2 0.324 ->
#: 0.267; 8 warps 0.323 and 0.295, 2 stages 0.306 and 0.280); RWKV-6's (a bonus) keeps its loop at 8 warps
#: ("grads_vector_loop": 0.806 -> 0.822 on the grid); the decay-free launches keep their configs (deltanet 0.225 ->
#: 0.215; 0.214 at 4 warps). Session 28: the per-channel grads at 1 stage. At 2 or 3 stages (4 warps) Triton 3.6
#: compiles a race on Hopper: rerun on the same inputs, dq and dg (kda: dk too) of a few key columns of a few chunks
#: changed from run to run, by up to 6 (gla) and 0.5 (kda) at 4 x 4096 (bf16), in 9 to 12 of 12 reruns; at 1 stage
#: (and at 8 warps, 2 or 3 stages) no launch differed in 12 reruns (``scripts/kernel_reruns.py``). Moving the
#: intra-chunk products after the V loop moved the race, not removed it. Cost at 4 x 4096:
#: gla 0.537 -> 0.583 ms, kda 0.619 -> 0.669 (8 warps: 0.751 and 0.845). ``test_gpu_backward_is_deterministic``
#: reruns every rule's backward. A barrier before and after the V loop did not remove the race (4 warps at 2 and 3
#: stages still differed in 6 to 12 of 12 reruns; session 29). Session 29, on the key grid at 4 x 4096, as two
#: launches (query side 8 warps, 3 stages; key side 8 warps, 2 stages): the scalar decays' lost (gated delta 0.294
#: -> 0.425 ms, mamba2 0.267 -> 0.414; their key side raced at 2 stages) and so did the per-channel decays' (gla
#: 0.588 -> 1.018, kda 0.677 -> 1.108); the scalar decays' one launch at 4 warps, 2 stages or 8 warps, 3 stages
#: lost too (gated delta 0.276 -> 0.297, 0.299), as did register caps of 168 and 128 on it (0.303, 0.537) and of 168
#: on the per-channel grads (kda 0.669 -> 0.969, gla 0.582 -> 0.821). What removed the race: the per-channel grads
#: on the grid load the h and dH tiles of the chunk-end term sum_v h dH apart from the tiles that feed the products
#: (``chunk_bwd.grads_kernel``); then 2 and 3 stages gave the same bits in every rerun (bf16, fp16, fp32, packed
#: sequences), at 2 stages kda 0.677 -> 0.632 ms, gla 0.588 -> 0.564 (3 stages 0.637, 0.593; the extra loads at 1
#: stage 0.716, 0.648). Session 31, at 4 x 4096: intra_grads at 1 warp, 2 stages (255 registers, eight programs an
#: SM against four). With the bench's gates every program stops after its span check, and those programs' turnover
#: sets the time: kda, gla and rwkv6 0.057-0.058 -> 0.029 ms. Gates 10 times stronger (block products): kda and gla
#: 0.424 -> 0.323, rwkv6 0.429 -> 0.338; 100 times (pairwise): kda and gla 0.732 -> 0.683, rwkv6 0.802 -> 0.815.
#: fp16 and fp32 at 2 x 4096, gates x10: 0.222 -> 0.172 and 0.237 -> 0.233. 2 warps at 1, 2 or 3 stages: between
#: the two (kda 0.038 with the bench's gates, 0.357 at x10, 0.752 at x100). The same bits. Session 33, at 4 x 4096,
#: 8 warps for the 255-register kernels, which then compile without spills but hold an SM alone: prep_vector 8 x 2
#: (kda 0.402 -> 0.717 ms), prep 8 x 3 (gated delta 0.250 -> 0.472, deltanet 0.224 -> 0.442), score_wy_grads 8 x 2
#: (kda 0.453 -> 0.793, gated delta 0.322 -> 0.540), grads_vector 8 x 2 (kda 0.582 -> 0.871, gla 0.506 -> 0.778),
#: grads_scalar 8 x 3 (gated delta 0.275 -> 0.300).
LAUNCH = {
    "cumsum": (4, 2),
    "prep": (4, 3),
    "prep_vector": (4, 3),
    "output": (4, 3),
    "output_vector": (4, 3),
    "dv": (4, 1),
    "score_grads": (4, 1),
    "score_grads_delta": (4, 2),
    "score_wy_grads": (4, 3),
    "grads_pipelined": (8, 2),  # scalar decays, fp16 (the loop over key blocks; see key_grid)
    "grads_scalar": (4, 3),  # scalar decays, bf16 (key blocks on the grid)
    "grads_vector": (4, 2),  # per-channel decays but RWKV-6 (key blocks on the grid; session 29 above)
    "grads_vector_loop": (8, 3),  # RWKV-6 (see key_grid)
    "intra_grads": (1, 2),  # session 31 above
    "wy_grads": (4, 1),
    "wy_grads_vector": (4, 1),
    "grads_query": (8, 3),
    "grads_key": (8, 2),
    "grads_scalar_query": (8, 2),  # fp32 inputs only (see chunk_backward)
    "grads_scalar_key": (8, 2),
    "recurrent": (2, 2),
}
#: the delta rules (decay codes) whose ``wy_grads_kernel`` runs inside ``score_grads_kernel`` (WY) for bf16 inputs,
#: reading Y and dL back as the same program stored them ("score_wy_grads" in LAUNCH). Session 25, H200, H = 16,
#: K = V = 128, against the two kernels (bit-identical results): at 8 x 2048 deltanet 0.223 + 0.157 -> 0.358 ms
#: (fwd+bwd 1.318 -> 1.291), gated delta 0.238 + 0.175 -> 0.392 (1.556 -> 1.536); the same at 4 x 4096 and 1 x 16384.
#: At 2 stages it lost (0.391 deltanet); 4 stages equal 3; 8 warps lost (0.566 at 3 stages). KDA's lost (0.69 ->
#: 0.78; its per-channel WY part runs at key blocks of 32, ``Shapes.wy_BK``). fp16 tied at 2 stages (0.470 -> 0.467 at
#: 4 x 4096) and lost at 3 (0.653: 139 KB of shared memory, one program per SM); fp32 lost (1.51 -> 1.78). Session 28,
#: with a per-channel decay's WY part in two products per key block where its chunk's gates stay within CHUNK_SPAN
#: (``chunk_bwd._wy_one_ref``): KDA's fused kernel 0.461 ms against 0.179 + 0.382 apart at 4 x 4096 (1 x 16384 alike)
WY_FUSED = (0, 1, 2)
#: registers per thread (``maxnreg``) of a LAUNCH entry, where the compiler would take more than the programs per
#: SM that the kernel runs best at allow: 168 lets three 4-warp programs share an SM (see LAUNCH). The per-channel
#: output kernel holds two paths for the intra-chunk scores (block products and pairwise loops,
#: ``common.chunk_scores``): at 4 warps they compile to 237-255 registers (Triton 3.6, sm_90), two programs per SM;
#: capped, they spill 16 bytes (64 with the bonus). The scalar decays' output kernel takes 173 uncapped, no spill
#: capped; the delta rule's wy_grads 255, and spills capped, which still won for deltanet. Its prep was capped too
#: until its W and U became whole-chunk products (session 22): then uncapped won (deltanet 0.276 -> 0.263 ms at
#: 8 x 2048, 0.307 -> 0.290 at 4 x 4096; capped it spilled 360 bytes)
MAX_REGISTERS = {"output_vector": 168, "output": 168, "wy_grads": 168}
#: V block of the recurrent kernel (its state tile is [K, RECURRENT_BV] fp32)
RECURRENT_BV = 32
#: (V block, pipeline stages) of the sequential passes per (pass, delta rule, decay kind) on a grid of at least
#: one program per SM; they run at ``SEQUENTIAL_WARPS``. Measured on an H200 at 8 x 2048, H = 16, K = V = 128,
#: bf16, kernel ms against the session 8 configs (V block 32 for all; stages 2 (3 for the decayed delta rules)
#: forward, 2 (1 for kda) backward), with the delta rule's state in tiles of 64 key rows. Forward: deltanet
#: 0.200 -> 0.169, gated delta 0.230 -> 0.179, kda 0.440 -> 0.332, gla 0.185 -> 0.114, mamba2 0.117 -> 0.074.
#: Backward: deltanet 0.307 -> 0.209, gated delta 0.260 (V block 64: 0.401), kda 0.599 -> 0.451, gla 0.173 ->
#: 0.105, mamba2 0.107 -> 0.071. Linear attention takes Mamba-2's, RWKV-6 GLA's (their decay kinds). Session 11,
#: with the gated delta rule's decay on rows in state_bwd: 3 stages (0.281 -> 0.236 ms; main's 2 stages: 0.247).
#: Session 17, with KDA's passes reading q and k decayed (``saved_buffers``' Qg and Kg) instead of q, k and the
#: fp32 gates: forward (64, 2) -> (64, 3) (kda 0.302 -> 0.232 ms; the new kernel took 0.242 at (64, 2), 0.282 at
#: (32, 3)), backward (64, 2) -> (32, 3) (0.403 -> 0.253; 0.269 at (64, 2), 0.314 at (32, 2)); the old backward
#: kernel did not fit (32, 3) in shared memory.
SEQUENTIAL = {
    ("state_fwd", False, 0): (64, 3),
    ("state_fwd", False, 1): (64, 3),
    ("state_fwd", False, 2): (64, 2),
    ("state_fwd", True, 0): (64, 3),
    ("state_fwd", True, 1): (64, 3),
    ("state_fwd", True, 2): (64, 3),
    ("state_bwd", False, 0): (64, 3),
    ("state_bwd", False, 1): (64, 3),
    ("state_bwd", False, 2): (64, 2),
    ("state_bwd", True, 0): (32, 3),
    ("state_bwd", True, 1): (32, 3),
    ("state_bwd", True, 2): (32, 3),
    # the delta rule's forward pass with bf16 inputs, K <= BF16_FACTORS_MAX_K, on a grid that fills at least half the
    # SMs at this V block (``factors_dtype``): its W and U stored in bf16 and its products split (``common.mm_split``:
    # W h and k^T d as two bf16 products each, on h and d in two bf16 parts), so that two programs share an SM (98 KB
    # of shared memory at 2 stages, where fp32 W and U took 205 KB at 3). Measured on an H200 (session 21, H = 16, K = V =
    # 128), kernel ms against fp32 factors at (64, 3): 8 x 2048 (256 programs): deltanet 0.160 -> 0.135, gated
    # delta 0.169 -> 0.136, kda 0.234 -> 0.150 (with W h alone split: 0.134, 0.155, 0.165). On grids of one
    # program per SM or fewer, the pass alone lost at every V block and stage count tried (deltanet at 4 x 4096,
    # 128 programs at 64: 0.158 -> 0.164 at best; 2 x 8192: 0.207 -> 0.216; 1 x 16384: 0.341 -> 0.355), but from
    # session 22 the prep kernel gains more where the grid fills half the SMs (``factors_dtype``); there the pass
    # runs at ``NARROW_STAGES``, and on narrower grids (``NARROW_BF16_FACTORS``) at its narrowed V block
    ("state_fwd_bf16", True, 0): (64, 2),
    ("state_fwd_bf16", True, 1): (64, 2),
    ("state_fwd_bf16", True, 2): (64, 2),
}
#: the largest K whose delta rule takes bf16 W and U on a wide grid (``factors_dtype``). Measured on an H200 at 8 x 2048
#: (bf16, state_fwd kernel ms, fp32 factors -> bf16): H = 32, K = V = 64: deltanet 0.117 -> 0.106, gated delta 0.119 ->
#: 0.108, kda 0.150 -> 0.116; H = 8, K = V = 256 (four state tiles per program): deltanet 0.409 -> 0.685, gated delta
#: 0.607 -> 0.716
BF16_FACTORS_MAX_K = 128
#: decay kinds whose delta rule, with bf16 W and U (``factors_dtype``), reads W in its forward pass from the transposed
#: copy per chunk that the backward reads (Wt, the same bf16 values), so that the prep kernel does not store W by
#: tokens as well. Measured on an H200 (session 24, H = 16, K = V = 128, fwd+bwd ms): prep 0.264 -> 0.249 (deltanet),
#: 0.284 -> 0.265 (gated delta), forward pass +0.002 to +0.004; deltanet 1.333 -> 1.318 at 8 x 2048, 1.366 -> 1.355 at
#: 4 x 4096, gated delta 1.582 -> 1.566 and 1.644 -> 1.622. KDA's pass, which spills (24 bytes) reading W transposed,
#: lost at 4 x 4096 (state_fwd 0.197 -> 0.231, fwd+bwd 2.746 -> 2.768) and keeps W by tokens
W_READ_TRANSPOSED = (0, 1)
#: decay kinds whose delta rule takes bf16 W and U (bf16 inputs, K <= BF16_FACTORS_MAX_K) on grids narrower than half
#: the SMs too, with the forward pass's k^T d there as one tf32 product on the widened k tile and only W h split
#: (``state_fwd_kernel``'s NARROW). Measured on an H200 (session 25, H = 16, K = V = 128, fwd+bwd ms, A/B against fp32
#: factors there): prep 0.292 -> 0.248 (deltanet at 2 x 8192), forward pass 0.217 -> 0.238; deltanet 1.41 -> 1.394
#: at 2 x 8192, 1.681 -> 1.673 at 1 x 16384, 3.297 -> 3.276 at 1 x 32768; gated delta 1.690 -> 1.678, 1.953 ->
#: 1.932, 3.854 -> 3.817. With k^T d split as well (bf16 factors forced, session 25's first call) deltanet had
#: tied at 2 x 8192 and lost at 1 x 32768 (3.342 -> 3.361). KDA, with both products split or with k^T d in tf32,
#: gained at 2 x 8192 (2.853 -> 2.813) and lost at 1 x 16384 (3.204 -> 3.240; its pass 0.459 -> 0.524), so it keeps
#: fp32 factors there
NARROW_BF16_FACTORS = (0, 1)
#: warps of the sequential passes: with 8, Triton 3.6 miscompiles them on Hopper for the delta rule (wrong
#: gradients or illegal addresses at K = 100, 128, 256; H200, 2026-11-21)
SEQUENTIAL_WARPS = 4
#: stages of the sequential passes on a grid of fewer programs than SMs: one program per SM, and no other
#: program there to hide its loads. Measured on an H200 (kernel ms, H = 16, K = V = 128, bf16) at 2 x 8192
#: (V block 32, 128 programs; stages 2 -> 3): forward deltanet 0.322 -> 0.210, gated delta 0.331 -> 0.226,
#: gla 0.284 -> 0.215, mamba2 0.186 -> 0.137; backward 0.313 -> 0.202, 0.408 -> 0.310, 0.280 -> 0.242, 0.164 ->
#: 0.116. At 1 x 16384 (V block 16, 128 programs) likewise: backward deltanet 0.496 -> 0.347, gated delta 0.698
#: -> 0.566, gla 0.499 -> 0.362, mamba2 0.303 -> 0.191. kda's 3 stages do not fit in shared memory: it runs 2.
NARROW_STAGES = 3
#: key rows per state tile of the delta rule's sequential passes (the additive rule's hold the whole K as one tile)
STATE_KB = 64
#: sub-block of the per-channel decays' pairwise loops in the output and gradient kernels (the delta rule's
#: inverse keeps SUB = 16). Halving it halves the pairwise exponentials and adds cross-sub-block products, whose
#: exponentials no longer grow with their number (``common.chunk_scores``). Measured on an H200 at 8 x 2048,
#: H = 16, K = V = 128, bf16, forward+backward: gla 4.24 (16) / 3.80 (8) / 4.12 ms (4), kda 11.13 / 10.31 / 11.32
PAIR_SUB = 8
#: row block of ``intra_grads_kernel`` (per-channel decays): the other blocks of the chunk, and pairs across the
#: block's two halves, enter through matrix products; pairs inside a half take one exponential each
INTRA_ROWS = 16
#: per-channel decays: the most a gate may fall (log2 units) inside one block of ``common.FAST_BLOCK`` rows (of
#: ``INTRA_ROWS`` in ``intra_grads_kernel``) for the pairs inside the blocks to take products instead of pairwise
#: exponentials: the decay from the row before the block is then split off as a factor of at most 2^BLOCK_SPAN,
#: finite in tf32 for any input below 2^64. For chunks past ``CHUNK_SPAN``, the forward's scores decide per chunk,
#: ``intra_grads_kernel`` per program (its rows and key block); past the bound they run the pairwise loops
#: (``PAIR_SUB``), and a negative value sends everything there
BLOCK_SPAN = 64
#: per-channel decays: the most a gate may fall (log2 units) over a whole chunk for every decay inside it to split
#: at the chunk's start (``common.chunk_span``), as a scalar decay's do: one product per key block for the forward's
#: scores and per side for the intra-chunk gradients, with right factors up to 2^CHUNK_SPAN. Chunks past it take
#: the block products (``BLOCK_SPAN``) or the pairwise loops; a negative value sends every chunk there
CHUNK_SPAN = 64
#: SMs assumed by the Triton interpreter (the H200's), so CPU tests take the blocks small GPU grids take
INTERPRETER_SMS = 132


@dataclass(frozen=True)
class Precision:
    """Dtypes of the saved intermediates; a product involving one runs in its dtype (fp32 ones in
    tf32 for bf16/fp16 inputs, in tf32x3 for fp32 inputs)."""

    state: torch.dtype  # chunk-start states hs and chunk-end state gradients dHs
    scores: torch.dtype  # the scaled intra-chunk scores A
    wy: torch.dtype  # delta rule: T, W, U (W and U bf16 where ``factors_dtype`` says so; W's transposed copy,
    # read only by the backward's product W^T dd, takes the states' dtype)
    writes: torch.dtype  # delta rule: the corrected writes d = U - W h and their gradient dd


@functools.lru_cache(maxsize=None)
def precision_for(dtype: torch.dtype) -> Precision:
    """The intermediates of fp16/bf16 inputs: the delta rule's WY factors stay fp32 (their products
    cancel: d = U - W h; ``factors_dtype`` names where W and U are bf16), states and scores take the input
    dtype. The corrected writes d and their gradient dd are rounded after that cancellation: bf16 for bf16
    inputs, else fp32 (dd sums the state gradients of every later chunk, which fp16's narrow range is not
    trusted to hold)."""
    writes = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return Precision(state=dtype, scores=dtype, wy=torch.float32, writes=writes)


def key_grid(decay: int, bonus: bool, dtype: torch.dtype) -> bool:
    """Whether ``grads_kernel`` takes its key blocks from the grid (one block of 64 channels per program; KGRID)
    rather than looping over them in one program per chunk and head. Its key blocks share no work but a scalar
    decay's gate gradient, a sum over every channel, which each block then writes as its own part (summed after
    the kernel; the reverse cumulative sum in it is linear). On the grid, at 4 warps, two programs fit an SM
    where the loop's 8-warp program, at the same registers a thread (about 230-255), ran alone: a chunk's loads
    wait beside another chunk's work (``LAUNCH``, session 27). Not on the grid: RWKV-6 (per-channel decay with a
    bonus), which lost there; a scalar decay's fp32 query and key sides, which join their row sums through dg;
    and a scalar decay with fp16 inputs, whose gated delta rule on the grid (4 warps, 3 stages) computed a dk
    1.1e-2 off the loop's on an H200 with Triton 3.6 (bf16: the same bits; the CPU interpreter agrees with the
    reference either way; by its look the race of the per-channel grads at 3 stages, ``LAUNCH``, session 28)."""
    if decay == 2:
        return not bonus
    return decay == 0 or dtype == torch.bfloat16


def _pow2(n: int) -> int:
    """The smallest power of two >= n, at least 16 (plain integer arithmetic: ``triton.next_power_of_2`` is a
    constexpr function whose wrapper costs microseconds a call, and a forward+backward asks dozens of these)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b), plain integers (as ``_pow2``, not ``triton.cdiv``)."""
    return -(-a // b)


@dataclass(frozen=True)
class Shapes:
    """Static sizes of one call: tokens TT = B * T (packed), N sequences, chunk slots. The sizes derived from
    them alone are computed once (``shapes_of`` hands out one instance per call shape)."""

    T: int  # tokens per sequence (fixed length) or all tokens (varlen)
    TT: int  # rows of the [tokens, H, D] views
    N: int
    H: int
    K: int
    V: int
    varlen: bool

    @functools.cached_property
    def slots(self) -> int:
        if self.varlen:
            return self.TT // CHUNK + self.N + 1
        return self.N * _cdiv(self.T, CHUNK)

    @functools.cached_property
    def BKF(self) -> int:  # the whole key dimension as one tile
        return _pow2(self.K)

    @functools.cached_property
    def BK(self) -> int:
        return min(self.BKF, 64)

    def scores_BK(self, decay: int) -> int:
        """K block of the output kernel: 32 for per-channel decays, whose pairwise loop holds [64, BK]
        tiles of fp32 gates and exponentials (measured on an H200 at 8 x 2048, H = 16, K = V = 128:
        gla output 1.01 -> 0.84 ms; deltanet's output, without that loop, 0.187 -> 0.207 ms at 32;
        session 10, with the pairs scattered once per chunk: gla 0.578 at 32, 0.930 at 64)."""
        return min(self.BK, 32) if decay == 2 else self.BK

    def grads_BK(self, decay: int, key_grid: bool) -> int:
        """K block of the gradient kernel: 64 with its key blocks on the grid (:func:`key_grid`) and for
        per-channel decays; in a loop over the key blocks, up to 128 for the others (a scalar decay's fp16
        and fp32 launches), whose per-block decay factors and gate-gradient reductions then run once
        (measured on an H200 at 8 x 2048, H = 16, K = V = 128, in a loop: mamba2 grads 0.496 -> 0.399 ms,
        gated delta's 0.541 -> 0.434; gla's went 2.00 -> 2.40)."""
        return self.BK if key_grid or decay == 2 else min(self.BKF, 128)

    def wy_BK(self, decay: int) -> int:
        """K block of the delta rule's ``wy_grads_kernel``: 32 for per-channel decays, whose pairwise loops
        hold [64, BK] fp32 gates and exponentials (measured on an H200 at 8 x 2048, H = 16, K = V = 128:
        kda wy_grads 1.95 -> 1.69 ms; deltanet's went 0.315 -> 0.388 at 32). Blocks of 64 on the one-reference
        chunks alone lost too (session 33, 4 x 4096: kda score_grads 0.453 -> 0.524 ms)."""
        return min(self.BK, 32) if decay == 2 else self.BK

    def dv_BV(self, decay: int) -> int:
        """V block of the additive rule's ``dv_kernel``: one block of up to 128 for the decayed rules, whose k
        tiles then take their decay factors once (measured on an H200 at 8 x 2048, H = 16, K = V = 128, 4 warps,
        1 stage: gla 0.142 -> 0.131 ms, rwkv6 0.190 -> 0.176, mamba2 0.114 -> 0.102; linear attention, without
        decay factors, went 0.104 -> 0.118 and keeps 64)."""
        return min(_pow2(self.V), 128) if decay else self.BV

    def state_KB(self, delta: bool) -> int:
        """Key rows per state tile of the sequential passes: ``STATE_KB`` for the delta rule, the whole K otherwise."""
        return min(self.BKF, STATE_KB) if delta else self.BKF

    @functools.cached_property
    def BV(self) -> int:
        return min(_pow2(self.V), 64)


def sequential_config(kernel: str, s: Shapes, delta: bool, decay: int, device: torch.device) -> tuple[int, int]:
    """(V block, stages) of a sequential pass (``state_fwd`` or ``state_bwd``; grid: V blocks x N * H).

    ``SEQUENTIAL`` gives both for a grid of at least one program per SM. On a smaller grid (few long
    sequences) the pass takes ``NARROW_STAGES`` and halves its V block while the grid fills less than
    half the SMs. Measured on an H200 at 1 x 16384, H = 16 (64 programs at 32, 128 at 16), backward
    kernel ms at 3 stages: deltanet 0.410 (32) -> 0.347 (16), gated delta 0.632 -> 0.566, gla 0.463 ->
    0.362; at 2 x 8192 (128 programs at 32) halving lost: deltanet 0.202 -> 0.344, gated delta 0.310 -> 0.564.
    """
    bv, stages = SEQUENTIAL[(kernel, delta, decay)]
    bv = min(bv, _pow2(s.V))
    sms = sm_count(device)
    if _sequential_programs(s, bv) >= sms:
        return bv, stages
    while bv > 16 and 2 * _sequential_programs(s, bv) < sms:
        bv //= 2
    return bv, max(stages, NARROW_STAGES)


def _sequential_programs(s: Shapes, bv: int) -> int:
    """Programs of a sequential pass at V block bv: V blocks x N * H."""
    return _cdiv(s.V, bv) * s.N * s.H


def factors_dtype(s: Shapes, dtype: torch.dtype, decay: int, device: torch.device) -> torch.dtype:
    """dtype of the delta rule's W and U: bf16 for bf16 inputs with K <= ``BF16_FACTORS_MAX_K`` where the grid of
    ``SEQUENTIAL``'s "state_fwd_bf16" fills at least half the SMs (at its V block: the grids that
    :func:`sequential_config` does not narrow) or the decay kind is one of ``NARROW_BF16_FACTORS``, else fp32
    (``precision_for``).

    Measured on an H200 (H = 16, K = V = 128, bf16, session 24): at 4 x 4096 (128 programs on 132 SMs, one per SM)
    bf16 factors took the prep kernel 0.293 -> 0.265 ms (deltanet), 0.312 -> 0.283 (gated delta), 0.450 -> 0.420
    (kda) and the forward pass 0.159 -> 0.170, 0.167 -> 0.188, 0.231 -> 0.197: fwd+bwd 1.378 -> 1.361, 1.644 ->
    1.635, 2.802 -> 2.734. On the narrowed grid of 1 x 16384, bf16 factors forced, deltanet lost (1.695 -> 1.708;
    with k^T d in tf32 there it gained, session 25: ``NARROW_BF16_FACTORS``). Session 21's bound (a full grid) had
    compared the forward pass alone, before the prep kernel's whole-chunk products (session 22) made bf16 factors
    cheaper there."""
    if dtype != torch.bfloat16 or s.K > BF16_FACTORS_MAX_K:
        return torch.float32
    return torch.bfloat16 if decay in NARROW_BF16_FACTORS or _fills_half(s, decay, device) else torch.float32


def _fills_half(s: Shapes, decay: int, device: torch.device) -> bool:
    """Whether the delta rule's forward pass with bf16 factors fills at least half the SMs at its V block (the grids
    that :func:`sequential_config` does not narrow)."""
    bv = min(SEQUENTIAL[("state_fwd_bf16", True, decay)][0], _pow2(s.V))
    return 2 * _sequential_programs(s, bv) >= sm_count(device)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (``INTERPRETER_SMS`` for a CPU tensor in the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def shapes_of(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> Shapes:
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    sizes = (T, B * T, N, H, K, v.shape[-1], cu_seqlens is not None)
    if all(type(x) is int for x in sizes[:6]):
        return _shapes(*sizes)
    return Shapes(*sizes)  # symbolic sizes (the custom ops' fake impls under torch.compile) do not hash


@functools.lru_cache(maxsize=1024)
def _shapes(T: int, TT: int, N: int, H: int, K: int, V: int, varlen: bool) -> Shapes:
    """One Shapes per call shape, so that its derived sizes are computed once (a forward+backward read them about
    30 times, 17 of them through ``_pow2``)."""
    return Shapes(T=T, TT=TT, N=N, H=H, K=K, V=V, varlen=varlen)


#: (kernel, current CUDA device, the arguments' specialization, constexprs, options) -> (the compiled kernel's
#: launcher, its function handle, its packed metadata, the constexprs' values in parameter order), or None where
#: the launcher does not take the arguments that way (then Triton's dispatcher launches it every time)
_COMPILED: dict = {}


def _arg_key(args: tuple) -> tuple:
    """What Triton's dispatcher specializes the non-constexpr arguments on, or more: a tensor's dtype and whether
    its address is 16-byte aligned, a number's equality to 1, divisibility by 16 and 32-bit range."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                  else (a == 1, a % 16 == 0, -2147483648 <= a < 2147483648) for a in args])


def _cache_key(kernel, args: tuple, constexprs: dict, warps: int, stages: int, maxnreg: Optional[int]) -> tuple:
    """The key of ``_COMPILED`` for one launch on the current CUDA device."""
    return kernel, torch.cuda.current_device(), _arg_key(args), *constexprs.items(), warps, stages, maxnreg


def _hooked() -> bool:
    """Whether a launch hook is installed (a profiler such as Proton): those launches go through Triton's
    dispatcher, which builds the hooks' metadata."""
    rt = _knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def _run(kernel, grid: tuple, args: tuple, constexprs: dict, warps: int, stages: int,
         maxnreg: Optional[int] = None, compiled: Optional[tuple] = None) -> Optional[tuple]:
    """kernel[grid](*args, **constexprs) at these warps, stages and register cap, on the current stream; returns
    the compiled kernel's entry of ``_COMPILED`` (None in the interpreter, or where Triton's dispatcher launches
    it every time), which a later launch of the same specialization passes back as ``compiled`` (``_launch``'s
    plans) to skip building the key.

    Triton's dispatcher costs 27-45 us of host time per launch (binding, specializing and keying every argument,
    building launch metadata, calling the launch hooks; measured on an H200's host with Triton 3.6), which short
    sequences do not hide behind the GPU. So on CUDA the first launch of each configuration goes through it and
    keeps the compiled kernel, keyed on everything the dispatcher keys it on (``_arg_key``, the constexprs, the
    options, the device), and later launches call that kernel's launcher directly: 16-20 us, 6-7 of them for
    the key, 7-8 in Triton's launcher (session 30, H200 host). Like the dispatcher's own cache, the key assumes
    that the Triton environment variables that change code generation (``TRITON_DEBUG``) keep their values once a
    kernel ran."""
    cuda = args[0].is_cuda  # else the interpreter runs it
    cacheable = cuda and _knobs is not None
    if cacheable and compiled is None:
        key = _cache_key(kernel, args, constexprs, warps, stages, maxnreg)
        compiled = _COMPILED.get(key, False)
    if compiled and not _hooked():
        run, function, metadata, tail = compiled
        x, y, z = grid if len(grid) == 3 else (*grid, 1, 1)[:3]
        run(x, y, z, _driver.active.get_current_stream(args[0].get_device()), function, metadata, None, None, None,
            *args, *tail)
        return compiled
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    launched = kernel[grid](*args, **constexprs, **options)
    if not cacheable or compiled is not False:  # the interpreter, a hooked launch, or a kernel already keyed
        return compiled or None
    names = kernel.arg_names
    if list(getattr(launched.src, "signature", ())) == names and set(names[len(args):]) == set(constexprs):
        entry = (launched.run, launched.function, launched.packed_metadata,
                 tuple(constexprs[n] for n in names[len(args):]))
    else:
        logger.debug("linear_recurrence: %s launches through Triton's dispatcher (its compiled kernel's "
                     "signature does not list every parameter in order)", kernel.__name__)
        entry = None
    _COMPILED[key] = entry
    return entry


#: the module's settings that the launchers read (configs, blocks, bounds). A change to one (``linmem bench ops
#: --launch``, ``scripts/kernel_ab.py --try``, a test's monkeypatch) drops every plan at the next call (``_plan``)
_SETTINGS = ("LAUNCH", "MAX_REGISTERS", "SEQUENTIAL", "WY_FUSED", "RECURRENT_BV", "BF16_FACTORS_MAX_K",
             "W_READ_TRANSPOSED", "NARROW_BF16_FACTORS", "SEQUENTIAL_WARPS", "NARROW_STAGES", "STATE_KB", "PAIR_SUB",
             "INTRA_ROWS", "BLOCK_SPAN", "CHUNK_SPAN", "INTERPRETER_SMS", "CHUNK", "SUB")
#: the settings' values (dicts copied) when the plans were made
_SNAPSHOT: list = []
#: plan key (``_plan``) -> {launch name: what ``_launch`` or ``_launch_sequential`` found for it}, the oldest
#: dropped past ``_PLANS_KEPT`` (varlen batches of changing lengths make a key each)
_PLANS: dict = {}
_PLANS_KEPT = 512


def _plan(launcher: str, *parts) -> dict:
    """The launch plan of one call of ``launcher``, keyed on ``parts`` (the call's arguments, the first a tensor:
    its device; of every tensor its dtype, shape and whether its address is 16-byte aligned; other values as
    given; None for absent ones). Its launches then take, by name, the config that fitted and the compiled kernel
    of the last call with that key: no config search, no per-launch key (H200 host, session 30: a forward+
    backward's launchers 281-537 -> 191-437 us at 1 x 256, bf16, five ops). Plans hold while the module's settings
    (``_SETTINGS``) keep their values; comparing them costs less than hashing them into every key.

    Everything a launch depends on is a function of that key and the settings: its constexprs and integers (the
    shapes), its configs (the device's SMs), and the specialization of its tensors (the arguments' dtypes and
    alignment; the buffers the launcher allocates are fresh, so aligned). ``test_plans_key_every_launch`` checks
    that: one key, one launch specialization."""
    module = globals()
    settings = [module[name] for name in _SETTINGS]
    if settings != _SNAPSHOT:
        _PLANS.clear()
        _SNAPSHOT[:] = [dict(x) if isinstance(x, dict) else x for x in settings]
    key = (launcher, parts[0].device,
           *[(p.dtype, p.shape, not p.data_ptr() & 15) if isinstance(p, torch.Tensor) else p for p in parts])
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
        plan = _PLANS[key] = {}
    return plan


#: (kernel, input dtype, its constexprs' values, first config) -> the first config of its fallbacks that fit in
#: shared memory
_FITTING: dict = {}


def _launch_fitting(name: str, tries: list, launch, describe, args: tuple, constexprs: dict) -> tuple:
    """launch(config) for the first of ``tries`` whose software pipelining fits the device's shared memory
    (fp32 or K = 256 tiles), starting from the one that fitted for the same kernel, input dtype, constexprs
    and ``tries`` before; each miss is logged at debug level, ``describe(config)`` naming the config. Returns
    that config and what launch returned.

    The first argument is an input activation, whose dtype fixes every other tensor's, and each kernel
    name has one call site, which passes its constexprs in one order: so the key reads one dtype and the
    constexprs' values as given (sorting them and reading every argument's dtype took 5 us a launch)."""
    key = (name, args[0].dtype, *constexprs.values(), tries[0])
    if key in _FITTING:
        tries = tries[tries.index(_FITTING[key]):]
    for i, config in enumerate(tries):
        try:
            launched = launch(config)
            _FITTING[key] = config
            return config, launched
        except triton.runtime.errors.OutOfResources as error:
            if i == len(tries) - 1:
                raise
            logger.debug("linear_recurrence: %s %s does not fit (%s); trying %s", name, describe(config), error,
                         describe(tries[i + 1]))


def _launch(plan: dict, name: str, kernel, grid: tuple, *args, **constexprs) -> None:
    """kernel[grid](*args) with the LAUNCH config (warps, stages) of ``name`` (and its MAX_REGISTERS); a config
    whose software pipelining does not fit the device's shared memory runs with one stage fewer, until it fits.
    ``plan`` (:func:`_plan`) keeps the config and the compiled kernel for the call's next launch of ``name``."""
    planned = plan.get(name)
    if planned is not None:
        warps, stages, cap, compiled = planned
        _run(kernel, grid, args, constexprs, warps, stages, cap, compiled)
        return
    warps, stages = LAUNCH[name]
    cap = MAX_REGISTERS.get(name)
    stages, compiled = _launch_fitting(name, list(range(stages, 0, -1)),
                                       lambda st: _run(kernel, grid, args, constexprs, warps, st, cap),
                                       lambda st: f"with {st} stages", args, constexprs)
    plan[name] = (warps, stages, cap, compiled)


def _sequential_fallbacks(bv: int, stages: int) -> list[tuple[int, int]]:
    """(V block, stages) to try in order: the configured ones, fewer stages down to 2, then V blocks halved down
    to 16 at 2 stages, then 1 stage at the configured V block."""
    tries = [(bv, st) for st in range(stages, 1, -1)]
    if stages >= 2:
        b = bv // 2
        while b >= 16:
            tries.append((b, 2))
            b //= 2
    return tries + [(bv, 1)]


def _launch_sequential(plan: dict, name: str, kernel, s: Shapes, delta: bool, decay: int, *args,
                       **constexprs) -> None:
    """A sequential pass, grid (V blocks, N * H), at the (V block, stages) of :func:`sequential_config`. A config
    whose pipelining does not fit the device's shared memory (K = 256, fp32) takes the next of
    :func:`_sequential_fallbacks` that fits: narrower V blocks come before a single stage, since at one stage
    Triton 3.6 miscompiles the gated delta rule's backward pass on Hopper: at K = 256 illegal addresses (H200,
    2026-11-22), at K = 128 wrong gradients (dk, dv, dg, dbeta off by 0.86 at V blocks of 16 and 32; session 21).
    Both fit two stages at V blocks of 16. ``plan`` as in :func:`_launch`."""
    planned = plan.get(name)
    if planned is not None:
        bv, stages, compiled = planned
        _run(kernel, (_cdiv(s.V, bv), s.N * s.H), args, {**constexprs, "BV": bv}, SEQUENTIAL_WARPS, stages, None,
             compiled)
        return
    tries = _sequential_fallbacks(*sequential_config(name, s, delta, decay, args[0].device))
    (bv, stages), compiled = _launch_fitting(
        name, tries, lambda c: _run(kernel, (_cdiv(s.V, c[0]), s.N * s.H), args, {**constexprs, "BV": c[0]},
                                    SEQUENTIAL_WARPS, c[1]),
        lambda c: f"at V block {c[0]}, {c[1]} stages", args, constexprs)
    plan[name] = (bv, stages, compiled)


def _on_inputs_device(launcher):
    """The launcher run with its first argument's CUDA device current. Triton launches on the current device and
    its current stream, and a model split over GPUs in one process (``device_map="auto"``) calls layers whose
    tensors live on another device than the current one."""

    @functools.wraps(launcher)
    def run(q: torch.Tensor, *args, **kwargs):
        if q.is_cuda and q.get_device() != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                return launcher(q, *args, **kwargs)
        return launcher(q, *args, **kwargs)

    return run


def saved_buffers(q: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], delta: bool,
                  cu_seqlens: Optional[torch.Tensor]) -> tuple:
    """Empty buffers of what the forward saves for the backward, ``(G, hs, A, d, Tt, Wt, Qg, Kg)``, in the dtypes
    of :func:`precision_for`: ``G`` [g's shape] fp32 only with a decay (g given), ``d``, ``Tt`` and ``Wt`` only
    for the delta rule, ``Qg`` and ``Kg`` (q e^G and k e^(Gamma - G) in q's dtype, which the sequential passes
    read instead of q, k and G) only for the delta rule with a per-channel decay (else None). The forward fills
    them; ``ops`` takes its fake outputs from here too."""
    s = shapes_of(q, v, cu_seqlens)
    P = precision_for(q.dtype)
    G = q.new_empty(g.shape, dtype=torch.float32) if g is not None else None
    hs = q.new_empty(s.slots, s.H, s.K, s.V, dtype=P.state)
    A = q.new_empty(*q.shape[:3], CHUNK, dtype=P.scores)
    if not delta:
        return G, hs, A, None, None, None, None, None
    Qg = Kg = None
    if g is not None and g.dim() == 4:
        Qg, Kg = torch.empty_like(q), torch.empty_like(q)
    return (G, hs, A, v.new_empty(v.shape, dtype=P.writes), q.new_empty(*q.shape[:3], CHUNK, dtype=P.wy),
            q.new_empty(s.slots, s.H, s.K, CHUNK, dtype=P.state), Qg, Kg)


@_on_inputs_device
def chunk_forward(q, k, v, g, beta, u, h0, cu_seqlens, scale: float, decay: int, output_final: bool):
    """Forward of the chunked recurrence.

    q, k: [B, T, H, K], v: [B, T, H, V] (contiguous, one dtype); g: None, [B, T, H] or
    [B, T, H, K] fp32; beta: [B, T, H] or None; u: [H, K] or None; h0: [N, H, K, V] fp32 or
    None. Returns ``(o, hN, saved)`` with ``saved = (G, hs, A, d, Tt, Wt, Qg, Kg)`` for the backward
    (``d``, ``Tt``, ``Wt`` only for the delta rule, else None; ``Tt``: T transposed per chunk
    [B, T, H, C], ``Wt``: W transposed per chunk [slots, H, K, C], in the states' dtype; ``Qg``, ``Kg``:
    the delta rule's queries and keys decayed by a per-channel decay, see :func:`saved_buffers`).
    """
    plan = _plan("forward", q, k, v, g, beta, u, h0, cu_seqlens, scale, decay, output_final)
    s = shapes_of(q, v, cu_seqlens)
    dev = q.device
    cu = cu_seqlens if cu_seqlens is not None else q
    delta, bonus = beta is not None, u is not None
    G, hs, A, d, Tt, Wt, Qg, Kg = saved_buffers(q, v, g, delta, cu_seqlens)
    if decay == 2 or (decay == 1 and not delta):  # the delta rule's prep kernel stores a scalar decay's G
        nkb = _cdiv(s.K, s.BK) if decay == 2 else 1
        _launch(plan, "cumsum", chunk_fwd.chunk_cumsum_kernel, (s.slots, s.H, nkb),
                g, G, cu, s.T, s.H, s.N, s.K, VECTOR=int(decay == 2), IS_VARLEN=int(s.varlen), C=CHUNK, BK=s.BK)
    Gp = G if G is not None else q
    W = U = None
    forward_pass = "state_fwd"
    w_t = False  # the forward pass reads W from its transposed copy Wt (see W_READ_TRANSPOSED)
    narrow = False  # bf16 factors on a narrow grid (NARROW_BF16_FACTORS)
    if delta:
        factors = factors_dtype(s, q.dtype, decay, dev)
        w_t = factors == torch.bfloat16 and decay in W_READ_TRANSPOSED  # Wt is then bf16 too (the states' dtype)
        if factors == torch.bfloat16:
            forward_pass = "state_fwd_bf16"
            narrow = not _fills_half(s, decay, dev)
        W = Wt if w_t else torch.empty_like(k, dtype=factors)
        U = torch.empty_like(v, dtype=factors)
        _launch(plan, "prep_vector" if decay == 2 else "prep", chunk_fwd.delta_prep_kernel, (s.slots, s.H),
                k, v, beta, g if decay == 1 else k, Gp, Tt, W, Wt, U, Kg if Kg is not None else k, cu, s.T, s.H, s.N,
                s.K, s.V, DECAY=decay, IS_VARLEN=int(s.varlen), STORE_W=int(not w_t), C=CHUNK, SB=SUB, BK=s.BK,
                BV=s.BV, SPAN=BLOCK_SPAN, CSPAN=CHUNK_SPAN, KP=s.BKF)
    hN = torch.empty(s.N, s.H, s.K, s.V, device=dev, dtype=torch.float32) if output_final else None
    _launch_sequential(plan, forward_pass, chunk_fwd.state_fwd_kernel, s, delta, decay,
                       Kg if Kg is not None else k, U if delta else v, W if delta else k, Gp, hs, d if delta else v,
                       h0 if h0 is not None else hs, hN if hN is not None else hs, cu, s.T, s.H, s.N, s.K, s.V,
                       DECAY=decay, DELTA=int(delta), IS_VARLEN=int(s.varlen), HAS_INIT=int(h0 is not None),
                       STORE_FINAL=int(output_final), W_T=int(w_t), NARROW=int(narrow), C=CHUNK, BKF=s.BKF,
                       KB=s.state_KB(delta))
    o = torch.empty_like(v)
    _launch(plan, "output_vector" if decay == 2 else "output", chunk_fwd.output_kernel, (s.slots, s.H),
            q, k, d if delta else v, v, Gp, u if bonus else q, hs, A, o, Qg if Qg is not None else q, cu, scale, s.T,
            s.H, s.N, s.K, s.V, DECAY=decay, BONUS=int(bonus), IS_VARLEN=int(s.varlen), STORE_QG=int(Qg is not None),
            C=CHUNK, SB=PAIR_SUB, BK=s.scores_BK(decay), BV=s.BV, SPAN=BLOCK_SPAN, CSPAN=CHUNK_SPAN, KP=s.BKF)
    return o, hN, (G, hs, A, d, Tt, Wt, Qg, Kg)


@_on_inputs_device
def chunk_backward(q, k, v, g, beta, u, h0, cu_seqlens, saved, do, dhN, scale: float, decay: int):
    """Backward of :func:`chunk_forward`: returns ``(dq, dk, dv, dg, dbeta, du, dh0)``.

    do: [B, T, H, V]; dhN: [N, H, K, V] or None. dg is fp32 shaped like g, dbeta fp32
    [B, T, H], du fp32 [H, K], dh0 fp32; entries for absent inputs are None.
    """
    G, hs, A, d, Tt, Wt, Qg, Kg = saved
    s = shapes_of(q, v, cu_seqlens)
    dev = q.device
    cu = cu_seqlens if cu_seqlens is not None else q
    delta, bonus = beta is not None, u is not None
    Gp = G if G is not None else q
    do = do.contiguous()
    dhN = dhN.contiguous() if dhN is not None else None
    plan = _plan("backward", q, k, v, g, beta, u, h0, cu_seqlens, *saved, do, dhN, scale, decay)
    dHs = torch.empty_like(hs)
    dd = torch.empty_like(d) if delta else None  # the delta rule's gradient of the corrected writes
    dh0 = torch.empty(s.N, s.H, s.K, s.V, device=dev, dtype=torch.float32) if h0 is not None else None
    _launch_sequential(plan, "state_bwd", chunk_bwd.state_bwd_kernel, s, delta, decay,
                       Qg if Qg is not None else q, Kg if Kg is not None else k, Wt if delta else q, Gp, A, do,
                       dd if delta else q, dHs, dhN if dhN is not None else dHs,
                       dh0 if dh0 is not None else dHs, cu, scale, s.T, s.H, s.N, s.K, s.V, DECAY=decay,
                       DELTA=int(delta), BONUS=int(bonus), IS_VARLEN=int(s.varlen), HAS_DFINAL=int(dhN is not None),
                       STORE_DINIT=int(dh0 is not None), C=CHUNK, BKF=s.BKF, KB=s.state_KB(delta))
    dv = torch.empty_like(v)
    if not delta:
        bv = s.dv_BV(decay)
        _launch(plan, "dv", chunk_bwd.dv_kernel, (_cdiv(s.V, bv), s.slots, s.H),
                q, k, Gp, u if bonus else q, A, do, dHs, dv, cu, scale, s.T, s.H, s.N, s.K, s.V, DECAY=decay,
                BONUS=int(bonus), IS_VARLEN=int(s.varlen), C=CHUNK, BK=s.BK, BV=bv)
    dbeta = torch.empty(beta.shape, device=dev, dtype=torch.float32) if delta else None
    # the score gradients dA and dL, and Y, in the states' dtype: the products that read them run in it. A
    # per-channel decay's dA and dL feed tf32 products instead (in bf16 ones the gate gradient q dq - k dk broke
    # its bound; and Triton 3.6 miscompiles wy_grads_kernel's on Hopper), and stay fp32 for fp16 inputs (the
    # products' right factors, up to 2^CHUNK_SPAN, exceed fp16's range): docs/kernels.md, "Precision"
    state_dtype = precision_for(q.dtype).state
    score_dtype = torch.float32 if decay == 2 and state_dtype == torch.float16 else state_dtype
    dA = torch.empty(*q.shape[:3], CHUNK, device=dev, dtype=score_dtype)
    dL = torch.empty(*q.shape[:3], CHUNK, device=dev, dtype=score_dtype) if delta else None
    Y = torch.empty_like(d, dtype=state_dtype) if delta else None
    dov = torch.empty(q.shape[:3], device=dev, dtype=torch.float32) if bonus else None
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    grid_keys = key_grid(decay, bonus, q.dtype)
    grads_bk = s.grads_BK(decay, grid_keys)
    kg = _cdiv(s.K, grads_bk) if grid_keys else 1  # grads_kernel's programs per chunk and head
    # a scalar decay's gate gradient, one [tokens, H] part per key block (summed after grads_kernel); its first
    # part takes the delta rule's WY part first
    dg_parts = torch.empty(kg if decay == 1 else 1, *g.shape, device=dev, dtype=torch.float32) if decay else None
    dg = dg_parts[0] if decay else None
    du = torch.empty(s.slots, s.H, s.K, device=dev, dtype=torch.float32) if bonus else None
    wy_fused = delta and decay in WY_FUSED and q.dtype == torch.bfloat16
    _launch(plan, ("score_wy_grads" if wy_fused else "score_grads_delta") if delta else "score_grads",
            chunk_bwd.score_grads_kernel, (s.slots, s.H),
            q, v, beta if delta else q, Gp, Tt if delta else q, d if delta else v, do, dd if delta else dA, dA,
            dL if delta else dA, Y if delta else dA, dv, dbeta if delta else q, dov if bonus else q, k, hs, dk,
            dg if decay else q, cu, scale, s.T, s.H, s.N, s.K, s.V, DECAY=decay, DELTA=int(delta), BONUS=int(bonus),
            IS_VARLEN=int(s.varlen), WY=int(wy_fused), C=CHUNK, SB=PAIR_SUB, BK=s.wy_BK(decay), BV=s.BV,
            SPAN=BLOCK_SPAN, CSPAN=CHUNK_SPAN, KP=s.BKF)
    if delta and not wy_fused:  # dk's and dg's parts through W and L first; grads_kernel adds the rest
        _launch(plan, "wy_grads_vector" if decay == 2 else "wy_grads", chunk_bwd.wy_grads_kernel, (s.slots, s.H),
                k, beta, Gp, hs, Y, dL, dk, dbeta, dg if decay else q, cu, s.T, s.H, s.N, s.K, s.V, DECAY=decay,
                IS_VARLEN=int(s.varlen), C=CHUNK, SB=PAIR_SUB, BK=s.wy_BK(decay), BV=s.BV, SPAN=BLOCK_SPAN,
                CSPAN=CHUNK_SPAN, KP=s.BKF)
    dqi = dki = dq  # per-channel decays: the intra-chunk parts of dq and dk, in blocks of INTRA_ROWS rows
    if decay == 2:
        dqi, dki = torch.empty_like(q, dtype=torch.float32), torch.empty_like(k, dtype=torch.float32)
        grid = (_cdiv(s.K, s.BK), s.slots * (CHUNK // INTRA_ROWS), s.H)
        _launch(plan, "intra_grads", chunk_bwd.intra_grads_kernel, grid, q, k, Gp, dA, dqi, dki, cu, s.T, s.H, s.N,
                s.K, BONUS=int(bonus), IS_VARLEN=int(s.varlen), C=CHUNK, RB=INTRA_ROWS, BK=s.BK, SPAN=BLOCK_SPAN,
                CSPAN=CHUNK_SPAN, KP=s.BKF)
    args = (q, k, Gp, u if bonus else q, d if delta else v, hs, dHs, do, dA, dov if bonus else q, dqi, dki, dq, dk,
            dg if decay else q, du if bonus else q, cu, scale, s.T, s.H, s.N, s.K, s.V)
    flags = dict(DECAY=decay, DELTA=int(delta), BONUS=int(bonus), IS_VARLEN=int(s.varlen), C=CHUNK,
                 BK=grads_bk, BV=s.BV, CSPAN=CHUNK_SPAN, KP=s.BKF, KGRID=kg)
    if decay == 0 or (decay == 1 and q.dtype == torch.float32):  # the query side, then the key side (LAUNCH)
        tag = "_scalar" if decay else ""
        _launch(plan, "grads" + tag + "_query", chunk_bwd.grads_kernel, (s.slots * kg, s.H), *args, **flags, SIDE=1)
        _launch(plan, "grads" + tag + "_key", chunk_bwd.grads_kernel, (s.slots * kg, s.H), *args, **flags, SIDE=2)
    else:
        name = ("grads_vector" if grid_keys else "grads_vector_loop") if decay == 2 else (
            "grads_scalar" if grid_keys else "grads_pipelined")
        _launch(plan, name, chunk_bwd.grads_kernel, (s.slots * kg, s.H), *args, **flags, SIDE=0)
    if decay == 1 and kg > 1:
        dg = dg_parts.sum(0)
    return dq, dk, dv, dg, dbeta, (du.sum(0) if bonus else None), dh0


@_on_inputs_device
def recurrent_step(q, k, v, g, beta, u, state, scale: float, decay: int) -> torch.Tensor:
    """Tokens q, k: [N, T, H, K], v: [N, T, H, V] against ``state`` [N, H, K, V] fp32 (updated in place).

    g: None, [N, T, H] (decay 1), [N, T, H, K] (decay 2) or [H] (``CONSTANT_DECAY``); beta: [N, T, H] or None;
    u: [H, K] or None. Returns o: [N, T, H, V] in the dtype of q.
    """
    plan = _plan("step", q, k, v, g, beta, u, state, scale, decay)
    N, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    BK = _pow2(K)
    BV = min(_pow2(V), RECURRENT_BV)
    _launch(plan, "recurrent", recurrent.recurrent_kernel, (_cdiv(V, BV), N * H),
            q, k, v, g if decay else q, beta if beta is not None else q, u if u is not None else q, state, o, scale,
            T, H, K, V, DECAY=decay, DELTA=int(beta is not None), BONUS=int(u is not None), BK=BK, BV=BV)
    return o
