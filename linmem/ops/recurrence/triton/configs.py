"""Launch configurations of the Triton kernels, and the shape arithmetic that picks blocks and grids from them.

Everything a launcher decides besides the inputs lives here: warps and stages per launch, register caps, the
sequential passes' V blocks, the dtypes of the saved intermediates, and the bounds that pick the per-channel
decays' paths. The values were chosen on an H200 with Triton 3.6 at H = 16, K = V = 128 by timing each beside its
alternatives (``docs/kernels.md``, "Launch configurations", lists them with their dates). The dev tools
(``dev/kernels``) import this module rather than repeat it.

The tables are read-only. A tool or a test that tries other values does so through :func:`override`, which also
drops the launchers' plans made under the old values.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator, Optional

import torch

from linmem.ops.triton_launch import cdiv, next_power_of_2
from .switches import Decay

#: chunk length of the chunked algorithm
CHUNK = 64
#: sub-block length of the delta rule's blockwise inverse (CHUNK = 4 SUB)
SUB = 16

#: (num_warps, num_stages) per launch name (the sequential passes take ``SEQUENTIAL``). Any change must pass the
#: GPU suite: Triton 3.6 miscompiles some configurations on Hopper.
LAUNCH = MappingProxyType({
    "cumsum": (4, 2),
    "prep": (4, 3),  # the delta rule's WY factors, no or a scalar decay
    "prep_vector": (4, 3),  # per-channel decay (KDA)
    "output": (4, 3),
    "output_vector": (4, 3),  # per-channel decays
    "dv": (4, 1),
    # WORKAROUND(triton 3.6, sm_90): the additive rules' score_grads at 2 or 3 stages miscompiles RWKV-6's dq
    "score_grads": (4, 1),
    "score_grads_delta": (4, 2),
    "score_wy_grads": (4, 3),  # score_grads with the WY stage inside (WY_FUSED)
    "grads_pipelined": (8, 2),  # scalar decays, fp16: one program loops over the key blocks
    "grads_scalar": (4, 3),  # scalar decays, bf16: key blocks on the grid (key_grid)
    "grads_vector": (4, 2),  # per-channel decays but RWKV-6: key blocks on the grid
    "grads_vector_loop": (8, 3),  # RWKV-6: one program loops over the key blocks
    "intra_grads": (1, 2),
    "wy_grads": (4, 1),
    "wy_grads_vector": (4, 1),  # per-channel decay (KDA)
    "grads_query": (8, 3),  # no decay: the query side and the key side as two launches
    "grads_key": (8, 2),
    "grads_scalar_query": (8, 2),  # scalar decays, fp32: two launches too
    "grads_scalar_key": (8, 2),
    "recurrent": (2, 2),
})
#: registers per thread (``maxnreg``) of a LAUNCH entry where the compiler would take more than the programs per SM
#: that the kernel runs best at allow: 168 lets three 4-warp programs share an SM
MAX_REGISTERS = MappingProxyType({"output_vector": 168, "output": 168, "wy_grads": 168})
#: decay kinds whose delta rule runs the WY stage inside the score-gradient stage for bf16 inputs, reading Y and dL
#: back as the same program stored them ("score_wy_grads"); fp16 and fp32 inputs keep two launches
WY_FUSED = (Decay.NONE, Decay.SCALAR, Decay.CHANNEL)
#: V block of the recurrent kernel (its state tile is [K, RECURRENT_BV] fp32)
RECURRENT_BV = 32
#: (V block, pipeline stages) of the sequential passes per (pass, delta rule, decay kind) on a grid of at least one
#: program per SM (``sequential_config``); they run at ``SEQUENTIAL_WARPS``. "state_fwd_bf16": the delta rule's
#: forward pass with bf16 W and U (``factors_dtype``)
SEQUENTIAL = MappingProxyType({
    ("state_fwd", False, Decay.NONE): (64, 3),
    ("state_fwd", False, Decay.SCALAR): (64, 3),
    ("state_fwd", False, Decay.CHANNEL): (64, 2),
    ("state_fwd", True, Decay.NONE): (64, 3),
    ("state_fwd", True, Decay.SCALAR): (64, 3),
    ("state_fwd", True, Decay.CHANNEL): (64, 3),
    ("state_bwd", False, Decay.NONE): (64, 3),
    ("state_bwd", False, Decay.SCALAR): (64, 3),
    ("state_bwd", False, Decay.CHANNEL): (64, 2),
    ("state_bwd", True, Decay.NONE): (32, 3),
    ("state_bwd", True, Decay.SCALAR): (32, 3),
    ("state_bwd", True, Decay.CHANNEL): (32, 3),
    ("state_fwd_bf16", True, Decay.NONE): (64, 2),
    ("state_fwd_bf16", True, Decay.SCALAR): (64, 2),
    ("state_fwd_bf16", True, Decay.CHANNEL): (64, 2),
})
#: the largest K whose delta rule takes bf16 W and U (``factors_dtype``); at K = 256 the passes hold four state
#: tiles, and bf16 factors cost them more than they saved
BF16_FACTORS_MAX_K = 128
#: decay kinds whose delta rule, with bf16 W and U, reads W in its forward pass from the transposed copy per chunk
#: that the backward reads (Wt, the same bf16 values), so that the prep stage stores W once; KDA's pass spills that
#: way and keeps W by tokens
W_READ_TRANSPOSED = (Decay.NONE, Decay.SCALAR)
#: decay kinds whose delta rule keeps bf16 W and U on grids narrower than half the SMs, with the forward pass's
#: k^T d there as one tf32 product on the widened k tile (``state_fwd_kernel``'s NARROW); KDA keeps fp32 factors there
NARROW_BF16_FACTORS = (Decay.NONE, Decay.SCALAR)
# WORKAROUND(triton 3.6, sm_90): the delta rule's sequential passes at 8 warps give wrong gradients or illegal addresses
#: warps of the sequential passes
SEQUENTIAL_WARPS = 4
#: stages of the sequential passes on a grid of fewer programs than SMs: one program per SM, and no other program
#: there to hide its loads
NARROW_STAGES = 3
#: key rows per state tile of the delta rule's sequential passes (the additive rule's hold the whole K as one tile)
STATE_KB = 64
#: sub-block of the per-channel decays' pairwise loops in the output and gradient kernels (the delta rule's
#: inverse keeps SUB): the pairs inside one take one exponential each, the pairs across sub-blocks products
PAIR_SUB = 8
#: row block of the intra-chunk gradient stage (per-channel decays): the other blocks of the chunk, and pairs across
#: the block's two halves, enter through matrix products; pairs inside a half take one exponential each
INTRA_ROWS = 16
#: per-channel decays: the most a gate may fall (log2 units) inside one block of ``scores.FAST_BLOCK`` rows (of
#: ``INTRA_ROWS`` in the intra-chunk gradient stage) for the pairs inside the blocks to take products instead of
#: pairwise exponentials; the factor split off is then at most 2^BLOCK_SPAN, finite in tf32. A negative value sends
#: every chunk past ``CHUNK_SPAN`` to the pairwise loops
BLOCK_SPAN = 64
#: per-channel decays: the most a gate may fall (log2 units) over a whole chunk for every decay inside it to split at
#: the chunk's start (``gates.chunk_span``), as a scalar decay's do: one product per key block, with right factors up
#: to 2^CHUNK_SPAN. Chunks past it take the block products or the pairwise loops; a negative value sends every chunk
#: there
CHUNK_SPAN = 64
#: SMs assumed by the Triton interpreter (the H200's), so CPU tests take the blocks small GPU grids take
INTERPRETER_SMS = 132
#: the most BLOCK_SPAN and CHUNK_SPAN may be: a gate at the chunk kernels' floor (``cumsum.LOG_DECAY_FLOOR``, -110,
#: 158.7 in log2 units) must fall past them, so that a chunk holding one never splits its decays by a factor that
#: overflows
MAX_SPAN = 150

#: whether the forward keeps the chunk-start states for the backward, and for the delta rule also T^T, W^T and the
#: corrected writes (the default). Off, the backward recomputes them from the inputs, as fla's does: one more WY
#: stage and forward pass per backward, for (K V / C) state-dtype bytes a token and head less (the delta rule's
#: another 4 C + 2 K + 2 V): at 8 x 2K and 370M, 64-208 MB a layer (``dev/gpu/tools/saved_tensors.py``), 9-20% of
#: a model's peak, for 1.5-1.7% of a GLA step's GPU time on an H200 (docs/kernels.md)
KEEP_STATES = True

#: the names :func:`override` may change
SETTINGS = ("KEEP_STATES", "LAUNCH", "MAX_REGISTERS", "WY_FUSED", "RECURRENT_BV", "SEQUENTIAL", "BF16_FACTORS_MAX_K",
            "W_READ_TRANSPOSED", "NARROW_BF16_FACTORS", "SEQUENTIAL_WARPS", "NARROW_STAGES", "STATE_KB", "PAIR_SUB",
            "INTRA_ROWS", "BLOCK_SPAN", "CHUNK_SPAN", "INTERPRETER_SMS")
#: how many times :func:`override` changed the settings (the launchers' plans are keyed on it)
_generation = 0


def generation() -> int:
    """A number that changes whenever the settings change (the launch plans key on it)."""
    return _generation


@contextlib.contextmanager
def override(**changes) -> Iterator[None]:
    """The settings changed while the block runs, then restored: ``override(CHUNK_SPAN=-1)``; a table's changed
    entries are merged into it, ``override(LAUNCH={"output": (2, 1)})``. Plans made under other settings are not
    reused.

    >>> with override(LAUNCH={"output": (8, 2)}):
    ...     LAUNCH["output"]
    (8, 2)
    """
    global _generation
    module = globals()
    unknown = set(changes) - set(SETTINGS)
    if unknown:
        raise ValueError(f"override: {sorted(unknown)} are not settings; expected some of {', '.join(SETTINGS)}")
    for name in ("BLOCK_SPAN", "CHUNK_SPAN"):
        if changes.get(name, 0) > MAX_SPAN:
            raise ValueError(f"override: {name} must be at most MAX_SPAN = {MAX_SPAN}, got {changes[name]}")
    saved = {name: module[name] for name in changes}
    for name, value in changes.items():
        old = module[name]
        module[name] = MappingProxyType({**old, **value}) if isinstance(old, MappingProxyType) else value
    _generation += 1
    try:
        yield
    finally:
        module.update(saved)
        _generation += 1


@dataclass(frozen=True)
class Precision:
    """Dtypes of the saved intermediates; a product involving one runs in its dtype (fp32 ones in tf32 for bf16/fp16
    inputs, in tf32x3 for fp32 inputs)."""

    state: torch.dtype  # chunk-start states hs and chunk-end state gradients dHs
    scores: torch.dtype  # the scaled intra-chunk scores A
    wy: torch.dtype  # delta rule: T, W, U (W and U bf16 where ``factors_dtype`` says so; W's transposed copy,
    # read only by the backward's product W^T dd, takes the states' dtype)
    writes: torch.dtype  # delta rule: the corrected writes d = U - W h and their gradient dd


@functools.lru_cache(maxsize=None)
def precision_for(dtype: torch.dtype) -> Precision:
    """The intermediates of fp16/bf16 inputs: the delta rule's WY factors stay fp32 (their products cancel:
    d = U - W h; ``factors_dtype`` names where W and U are bf16), states and scores take the input dtype. The
    corrected writes d and their gradient dd are rounded after that cancellation: bf16 for bf16 inputs, else fp32
    (dd sums the state gradients of every later chunk, which fp16's narrow range is not trusted to hold)."""
    writes = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return Precision(state=dtype, scores=dtype, wy=torch.float32, writes=writes)


def key_grid(decay: int, bonus: bool, dtype: torch.dtype) -> bool:
    """Whether the key-channel gradient stage takes its key blocks from the grid (one block of 64 channels per
    program; KGRID) rather than looping over them in one program per chunk and head. Its key blocks share no work
    but a scalar decay's gate gradient, a sum over every channel, which each block then writes as its own part
    (summed after the kernel). On the grid two 4-warp programs share an SM, where the loop's 8-warp program ran
    alone. Not on the grid: RWKV-6 (per-channel decay with a bonus), which is faster in the loop; a scalar decay's
    fp32 query and key sides, which join their row sums through dg; and a scalar decay with fp16 inputs (below)."""
    if decay == Decay.CHANNEL:
        return not bonus
    # WORKAROUND(triton 3.6, sm_90): on the grid the fp16 gated delta rule's dk comes out 1.1e-2 off the loop's
    return decay == Decay.NONE or dtype == torch.bfloat16


def pow2(n: int) -> int:
    """The smallest power of two >= n, at least 16 (plain integers, as :func:`cdiv`)."""
    return max(16, next_power_of_2(n))


@dataclass(frozen=True)
class Shapes:
    """Static sizes of one call: tokens TT = B * T (packed), N sequences, chunk slots. The sizes derived from them
    alone are computed once (``shapes_of`` hands out one instance per call shape)."""

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
        return self.N * cdiv(self.T, CHUNK)

    @functools.cached_property
    def BKF(self) -> int:  # the whole key dimension as one tile
        return pow2(self.K)

    @functools.cached_property
    def BK(self) -> int:
        return min(self.BKF, 64)

    def scores_BK(self, decay: int) -> int:
        """K block of the output stage: 32 for per-channel decays, whose pairwise loop holds [64, BK] tiles of fp32
        gates and exponentials."""
        return min(self.BK, 32) if decay == Decay.CHANNEL else self.BK

    def grads_BK(self, decay: int, key_grid: bool) -> int:
        """K block of the key-channel gradient stage: 64 with its key blocks on the grid (:func:`key_grid`) and for
        per-channel decays; in a loop over the key blocks, up to 128 for the others (a scalar decay's fp16 and fp32
        launches), whose per-block decay factors and gate-gradient reductions then run once."""
        return self.BK if key_grid or decay == Decay.CHANNEL else min(self.BKF, 128)

    def wy_BK(self, decay: int) -> int:
        """K block of the delta rule's WY gradient stage: 32 for per-channel decays, whose pairwise loops hold
        [64, BK] fp32 gates and exponentials."""
        return min(self.BK, 32) if decay == Decay.CHANNEL else self.BK

    def dv_BV(self, decay: int) -> int:
        """V block of the additive rule's dv stage: one block of up to 128 for the decayed rules, whose k tiles then
        take their decay factors once; 64 without a decay."""
        return min(pow2(self.V), 128) if decay != Decay.NONE else self.BV

    def state_KB(self, delta: bool) -> int:
        """Key rows per state tile of the sequential passes: ``STATE_KB`` for the delta rule, the whole K otherwise."""
        return min(self.BKF, STATE_KB) if delta else self.BKF

    @functools.cached_property
    def BV(self) -> int:
        return min(pow2(self.V), 64)


def sequential_config(kernel: str, s: Shapes, delta: bool, decay: int, device: torch.device) -> tuple[int, int]:
    """(V block, stages) of a sequential pass (``state_fwd``, ``state_fwd_bf16`` or ``state_bwd``; grid: V blocks x
    N * H). ``SEQUENTIAL`` gives both for a grid of at least one program per SM. On a smaller grid (few long
    sequences) the pass takes ``NARROW_STAGES`` and halves its V block while the grid fills less than half the SMs.
    """
    bv, stages = SEQUENTIAL[(kernel, delta, decay)]
    bv = min(bv, pow2(s.V))
    sms = sm_count(device)
    if _sequential_programs(s, bv) >= sms:
        return bv, stages
    while bv > 16 and 2 * _sequential_programs(s, bv) < sms:
        bv //= 2
    return bv, max(stages, NARROW_STAGES)


def _sequential_programs(s: Shapes, bv: int) -> int:
    """Programs of a sequential pass at V block bv: V blocks x N * H."""
    return cdiv(s.V, bv) * s.N * s.H


def factors_dtype(s: Shapes, dtype: torch.dtype, decay: int, device: torch.device) -> torch.dtype:
    """dtype of the delta rule's W and U: bf16 for bf16 inputs with K <= ``BF16_FACTORS_MAX_K`` where the grid of
    the "state_fwd_bf16" pass fills at least half the SMs (:func:`fills_half`) or the decay kind is one of
    ``NARROW_BF16_FACTORS``, else fp32 (``precision_for``). bf16 factors make the prep stage's products and stores
    cheaper and let two forward-pass programs share an SM; on narrow grids the pass is bound by its chain of
    dependent products instead."""
    if dtype != torch.bfloat16 or s.K > BF16_FACTORS_MAX_K:
        return torch.float32
    return torch.bfloat16 if decay in NARROW_BF16_FACTORS or fills_half(s, decay, device) else torch.float32


def fills_half(s: Shapes, decay: int, device: torch.device) -> bool:
    """Whether the delta rule's forward pass with bf16 factors fills at least half the SMs at its V block (the grids
    that :func:`sequential_config` does not narrow)."""
    bv = min(SEQUENTIAL[("state_fwd_bf16", True, decay)][0], pow2(s.V))
    return 2 * _sequential_programs(s, bv) >= sm_count(device)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (``INTERPRETER_SMS`` for a tensor elsewhere: the interpreter's
    CPU tensors, and the meta tensors ``dev/kernels/kernel_resources.py`` runs the launchers on)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def shapes_of(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> Shapes:
    """The Shapes of a call on q [B, T, H, K], v [B, T, H, V] and cu_seqlens [N + 1] (or None)."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    sizes = (T, B * T, N, H, K, v.shape[-1], cu_seqlens is not None)
    if all(type(x) is int for x in sizes[:6]):
        return _shapes(*sizes)
    return Shapes(*sizes)  # symbolic sizes (the custom ops' fake impls under torch.compile) do not hash


@functools.lru_cache(maxsize=1024)
def _shapes(T: int, TT: int, N: int, H: int, K: int, V: int, varlen: bool) -> Shapes:
    """One Shapes per call shape, so that its derived sizes are computed once."""
    return Shapes(T=T, TT=TT, N=N, H=H, K=K, V=V, varlen=varlen)
