"""The launch configurations of the forgetting-attention kernels: tiles per kernel and head dim, and the shared
memory each takes.

Imports neither torch nor triton, so that ``dev/gpu/tools/fox_compile.py`` compiles the configurations and sets the
estimate of :func:`shared_memory` beside what Triton allocates, on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Tiles:
    """The tile shape and launch of one kernel."""

    block_m: int  # queries per tile
    block_n: int  # keys per tile
    warps: int  # warps per program
    stages: int  # software-pipelining stages of the tile loop
    split: bool = False  # dkdv only: dk (with dc) and dv by two launches, each holding one [block_n, D] accumulator


#: per kernel and the larger head dim of q/k and v, on CUDA for bf16 and fp16. forward and dq: a program owns
#: block_m queries and walks key tiles of block_n; dkdv: a program owns block_n keys and walks query tiles of block_m
#: (block_n a multiple of block_m); decode: block_n keys per tile (block_m unused: the rows are the queries). The
#: tiles are D and Dv wide rounded up to powers of two (96 -> 128, 192 -> 256; the kernels mask the padded columns),
#: so 96 takes 128's tiles and 192 takes 256's.
#: Chosen from the sm_90 code (Triton 3.6, ``dev/gpu/tools/fox_compile.py``), to be confirmed by the timings of
#: ``dev/gpu/tools/fox_bench.py --only variants``: at least 3 stages where shared memory allows (with 2, the loop waits
#: for each tile's loads as it starts), no wgmma narrower than 64 on the shared-memory operand (dkdv's 64 keys x 32
#: queries at 8 warps split into 64 x 16 products and moved P through shared memory each tile), and the fewest
#: instructions per score element without spills in the loops. D = 128: dkdv 64 x 128 at 8 warps issues 25% fewer
#: instructions per element than 32 x 128 but spills (56 bytes at 2 stages, 344 with GQA's loop over the group's
#: heads, whose spills land in the tile loops); 32 x 128 spills in no loop. D = 256: a [128, 256] fp32 accumulator
#: takes 128 registers of each of 256 threads, so the key tiles narrow to 32 (forward 128 x 64 fits only 2 stages;
#: dq 128 x 32 at 3 stages takes 224 of the 227 KB); dkdv's two accumulators spill at every tile that fits (32 x 64:
#: 68 instructions per score element with spills in both loops), so dk and dv run as two launches, each recomputing
#: P (about 39 instructions per element together, no spills in the loops). decode: timed by
#: ``dev/gpu/tools/decode_sweep.py --tiles`` (H200, batch 8, 16 heads, 2K-128K keys): at D <= 128 tiles of 128 keys
#: at 3 stages read the cache at 4.2-4.5 TB/s, where 64 keys at 2 stages read 3.0-3.7 (FoX at D = 128: 3.0).
TILES: dict[str, dict[int, Tiles]] = {
    "forward": {32: Tiles(64, 128, 4, 3), 64: Tiles(64, 128, 4, 3), 96: Tiles(128, 64, 8, 3),
                128: Tiles(128, 64, 8, 3), 192: Tiles(128, 32, 8, 3), 256: Tiles(128, 32, 8, 3)},
    "dq": {32: Tiles(128, 64, 8, 3), 64: Tiles(128, 64, 8, 3), 96: Tiles(128, 64, 8, 3), 128: Tiles(128, 64, 8, 3),
           192: Tiles(128, 32, 8, 3), 256: Tiles(128, 32, 8, 3)},
    "dkdv": {32: Tiles(64, 128, 8, 3), 64: Tiles(64, 128, 8, 3), 96: Tiles(32, 128, 8, 3), 128: Tiles(32, 128, 8, 3),
             192: Tiles(32, 128, 8, 3, split=True), 256: Tiles(32, 128, 8, 3, split=True)},
    "decode": {32: Tiles(16, 128, 8, 3), 64: Tiles(16, 128, 8, 3), 96: Tiles(16, 128, 4, 3),
               128: Tiles(16, 128, 4, 3), 192: Tiles(16, 64, 8, 2), 256: Tiles(16, 64, 8, 2)},
}
#: decoding with more than 16 query rows a KV head (a group of query heads, several new tokens), whose scores go
#: through tensor cores: the one-row tiles spill there (at D = 96 and 128, 128 keys at 4 warps: 68 spill operations
#: a tile at 2 stages, where 3 overflow shared memory)
DECODE_MANY_ROWS_TILES: dict[int, Tiles] = {
    32: Tiles(16, 64, 4, 2), 64: Tiles(16, 64, 4, 2), 96: Tiles(16, 64, 8, 2), 128: Tiles(16, 64, 8, 2),
    192: Tiles(16, 64, 8, 2), 256: Tiles(16, 64, 8, 2)}
#: per kernel for fp32 inputs (head dims up to ``FP32_MAX_HEAD_DIM``): fp32 tiles take twice the registers and
#: shared memory, and the three tf32 products of each fp32 product split both operands in two
FP32_TILES: dict[str, Tiles] = {
    "forward": Tiles(32, 32, 4, 2), "dq": Tiles(64, 32, 4, 2), "dkdv": Tiles(16, 32, 4, 2),
    "decode": Tiles(16, 32, 4, 2),
}
#: in the Triton interpreter (CPU tests): small tiles, so that short sequences cross several of them; dkdv splits
#: where ``TILES`` does, so that the CPU tests run the launches of the GPU
INTERPRETER_TILES: dict[str, Tiles] = {
    "forward": Tiles(32, 16, 1, 1), "dq": Tiles(32, 16, 1, 1), "dkdv": Tiles(16, 32, 1, 1),
    "decode": Tiles(16, 16, 1, 1),
}
#: the fewest key tiles one split of a decoding call reads, on CUDA (2048 keys) and in the interpreter (whose CPU
#: tests split a cache of 70 keys in two)
DECODE_SPLIT_TILES = 16
INTERPRETER_DECODE_SPLIT_TILES = 2
#: streaming multiprocessors assumed in the interpreter (how many splits decoding takes)
INTERPRETER_SMS = 4
#: shared memory one program may take on sm_90 (H100, H200): 227 of the SM's 228 KB
SHARED_MEMORY = 227 * 1024
#: shared memory of the reductions across warps (row statistics, dkdv's column sums), at most
SCRATCH_BYTES = 2048


def shared_memory(kernel: str, t: Tiles, head_dim: int, value_dim: int, elem_bytes: int, rows: int = 16) -> int:
    """Bytes of shared memory one program of ``kernel`` takes at most on sm_90, at tiles ``t``, head dims
    ``head_dim`` (q, k) and ``value_dim`` (v), activations of ``elem_bytes`` bytes and (decode) ``rows`` query rows.

    The model, an upper bound of what Triton 3.6 allocates (``dev/gpu/tools/fox_compile.py`` prints both): the tiles
    a program holds throughout once (forward: q; dq: q and dO; dkdv: k and v; decode: q), the tiles its loop streams
    once per pipelining stage (forward, dq and decode: k and v of a key tile; dkdv: q and dO of a query tile; a
    split dkdv's dk launch, the larger, holds and streams the same), each as wide as the head dim rounded up to a
    power of two. Besides: in decoding a [rows, block_n] fp32 tile (the forget bias of each query row and key
    changes layout through shared memory), with fp32 inputs both operands of the largest product twice
    (tf32x3 splits each into a high and a low part), and ``SCRATCH_BYTES`` for the reductions across warps.

    Example:
        >>> shared_memory("forward", Tiles(128, 64, 8, 3), 128, 128, 2)  # q 32 KB, 3 x (k 16 KB + v 16 KB), 2 KB
        133120
    """
    bd, bdv = 1 << (head_dim - 1).bit_length(), 1 << (value_dim - 1).bit_length()  # powers of two
    m, n = (rows, t.block_n) if kernel == "decode" else (t.block_m, t.block_n)
    # elements held and streamed per stage; the products (rows, inner, columns)
    if kernel in ("forward", "decode"):
        held, streamed, products = m * bd, n * (bd + bdv), [(m, bd, n), (m, n, bdv)]
    elif kernel == "dq":
        held, streamed, products = m * (bd + bdv), n * (bd + bdv), [(m, bd, n), (m, bdv, n), (m, n, bd)]
    elif kernel == "dkdv":
        held, streamed, products = n * (bd + bdv), m * (bd + bdv), [(n, bd, m), (n, bdv, m), (n, m, bdv), (n, m, bd)]
    else:
        raise ValueError(f"shared_memory: `kernel` must be one of {sorted(TILES)}, got {kernel!r}")
    total = elem_bytes * (held + t.stages * streamed) + SCRATCH_BYTES
    if kernel == "decode":  # the forget bias, gathered per query row and key, changes layout through shared memory
        total += 4 * m * n
    if elem_bytes == 4:  # tf32x3: the high and low parts of both operands of the largest product
        total += 2 * 4 * max(r * k + k * c for r, k, c in products)
    return total

