"""Stage 2 of the forward (delta rule): the WY/UT factors of each chunk.

``T = (I + diag(beta) strict(A_kk))^-1`` [C, C] by 16 x 16 blocks (:func:`unit_lower_inverse`), then
``W = T (beta k e^G)`` [C, K] and ``U = T (beta v)`` [C, V] as whole-chunk products. The corrected writes of the
state pass are ``d = U - W h``. ``T`` and ``W`` are also stored transposed, as the backward reads them.
"""

from __future__ import annotations

from typing import Optional

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import configs
from .configs import CHUNK, SUB, Shapes, factors_dtype, fills_half
from .cumsum import scalar_cumsum
from .launch import launch_kernel
from .layout import load_gate_rows, load_rows, locate_chunk, store_rows, store_rows_t, store_state
from .numerics import _INTERP, exp2, masked_exp2, mm, mm_split
from .scores import chunk_scores
from .switches import CHANNEL_DECAY, SCALAR_DECAY, Decay


@triton.jit
def _inv_mm(a, b, X: tl.constexpr):
    """a @ b for the inverse's small products, a and b fp32: in IEEE fp32 for fp32 inputs (X), else as three bf16
    products on both split in two bf16 parts (``numerics.mm_split``, about 16 mantissa bits each)."""
    if X:
        if _INTERP:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")
    return mm_split(a, b)


@triton.jit
def _lower_block(Lp, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, i: tl.constexpr, j: tl.constexpr):
    """Block (i, j) [SB, SB] of a chunk's [C, C] matrix stored as rows of a [tokens, H, C] buffer."""
    return load_rows(Lp, t0, nrows, h, H, C, i * SB + tl.arange(0, SB), j * SB + tl.arange(0, SB), False)


@triton.jit
def _diag_inverse(Lp, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, i: tl.constexpr, X: tl.constexpr):
    """(I + L_ii)^-1 for the diagonal block i [SB, SB] of the strictly lower L stored in Lp, by doubling (see
    :func:`unit_lower_inverse`), as one [SB, SB] tile: the four diagonal blocks are independent chains of
    products, and a tile each needs no cross-thread reduction to take a block out of a [4, SB, SB] tensor."""
    a = tl.arange(0, SB)[:, None]
    c = tl.arange(0, SB)[None, :]
    Li = _lower_block(Lp, t0, nrows, h, H, C, SB, i, i)
    # s = 1: the inverse of each 2 x 2 block [[1, 0], [l, 1]] is [[1, 0], [-l, 1]]
    D = tl.where(a == c, 1.0, 0.0) - tl.where((a // 2 == c // 2) & (a % 2 == 1) & (c % 2 == 0), Li, 0.0)
    for m in tl.static_range(1, 5):
        if (1 << m) < SB:  # from blocks of s = 2^m rows to blocks of 2s
            Lo = tl.where((a // (2 << m) == c // (2 << m)) & ((a >> m) % 2 == 1) & ((c >> m) % 2 == 0), Li, 0.0)
            D -= _inv_mm(_inv_mm(D, Lo, X), D, X)
    return D


@triton.jit
def unit_lower_inverse(Lp, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, X: tl.constexpr):
    """T = (I + L)^-1 for the strictly lower L [C, C] (fp32, stored in Lp); returns T's ten nonzero
    blocks [SB, SB] (C = 4 SB), row by row: T00, T10, T11, T20, ..., T33.

    The diagonal blocks D_b = (I + L_bb)^-1, each by doubling (:func:`_diag_inverse`): with D the
    inverse of the diagonal s x s blocks of I + L_bb and Lo the entries of L_bb in the lower-left
    s x s block of each 2s x 2s block, ``D - D Lo D`` is the inverse of the 2s x 2s blocks
    (``[[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``). From s = 1 (D = I) that is two
    products per doubling, six for SB = 16, instead of SB - 1 dependent substitution steps, and no
    product grows past the inverse's own blocks; the four blocks' chains are independent. (The nilpotent
    series ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` takes as many products, but its powers of L grow with
    correlated keys and beta near 2: their cancellation costs ``T x`` up to 5% relative error in fp32,
    ``dev/kernels/wy_inverse_accuracy.py``.)
    Then the blocks below the diagonal, ``T_ij = -D_i sum_{j<=m<i} L_im T_mj`` ((I + L) T = I solved
    for block (i, j)), nearest the diagonal first: 16 products of [SB, SB] blocks, none on the six
    zero blocks above the diagonal. Products in IEEE fp32 for fp32 inputs (X), else bf16 x3 (:func:`_inv_mm`).
    """
    tl.static_assert(C == 4 * SB)
    tl.static_assert(SB <= 32)
    D0 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 0, X)
    D1 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 1, X)
    D2 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 2, X)
    D3 = _diag_inverse(Lp, t0, nrows, h, H, C, SB, 3, X)
    L10 = _lower_block(Lp, t0, nrows, h, H, C, SB, 1, 0)
    L21 = _lower_block(Lp, t0, nrows, h, H, C, SB, 2, 1)
    L32 = _lower_block(Lp, t0, nrows, h, H, C, SB, 3, 2)
    T10 = -_inv_mm(D1, _inv_mm(L10, D0, X), X)
    T21 = -_inv_mm(D2, _inv_mm(L21, D1, X), X)
    T32 = -_inv_mm(D3, _inv_mm(L32, D2, X), X)
    L31 = _lower_block(Lp, t0, nrows, h, H, C, SB, 3, 1)
    T20 = -_inv_mm(D2, _inv_mm(_lower_block(Lp, t0, nrows, h, H, C, SB, 2, 0), D0, X) + _inv_mm(L21, T10, X), X)
    T31 = -_inv_mm(D3, _inv_mm(L31, D1, X) + _inv_mm(L32, T21, X), X)
    T30 = -_inv_mm(D3, _inv_mm(_lower_block(Lp, t0, nrows, h, H, C, SB, 3, 0), D0, X) + _inv_mm(L31, T10, X)
                   + _inv_mm(L32, T20, X), X)
    return D0, T10, D1, T20, T21, D2, T30, T31, T32, D3


@triton.jit
def _store_t_block(Tt, x, t0, nrows, h, H, C: tl.constexpr, SB: tl.constexpr, i: tl.constexpr, j: tl.constexpr):
    """Block (i, j) [SB, SB] of T into Tt, transposed (Tt[t0 + s, h, c] = T[c, s])."""
    r = tl.arange(0, SB)
    store_rows_t(Tt, x, t0, nrows, h, H, C, j * SB + r, i * SB + r)


@triton.jit
def _factor_product(Tp, x, X: tl.constexpr):
    """Tp @ x for the delta rule's W and U: Tp [C, C] fp32 (T with its columns scaled), x [C, BD] (the keys or
    values, or KDA's decayed keys in fp32). bf16 and fp16 inputs: bf16 products on Tp and x split in two bf16 parts
    where they are not bf16 already (``numerics.mm_split``: about 16 mantissa bits, where a tf32 product keeps 10;
    an fp16 value is exactly the sum of its two parts). fp32 inputs (X): ``mm``'s fp32-accurate product."""
    if X:
        return mm(Tp, x, tl.float32, X)
    if x.dtype != tl.bfloat16:
        x = x.to(tl.float32)
    return mm_split(Tp, x)


@triton.jit
def delta_prep_kernel(k, v, beta, g, G, Tt, W, Wt, U, kg, cu_seqlens, T, H, N, K, V,
                      DECAY: tl.constexpr, C: tl.constexpr,
                      SB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPAN: tl.constexpr, CSPAN: tl.constexpr,
                      KP: tl.constexpr):
    """Delta rule, per chunk: T = (I + diag(beta) strict(A_kk))^-1 [C, C], W = T (beta k e^G) [C, K],
    U = T (beta v) [C, V] (the WY/UT form); the inverse by blocks (:func:`unit_lower_inverse`).

    k: [tokens, H, K], v: [tokens, H, V], beta: [tokens, H]; G: [tokens, H(, K)], which a scalar decay
    (SCALAR_DECAY) given its log decay g ([tokens, H]) stores here first, as ``cumsum.chunk_cumsum_kernel`` would
    (the forward), and without g reads as given (the backward's recomputation: the G this kernel stored);
    outputs Tt: [tokens, H, C] (fp32, T transposed: row s of a chunk holds T[:, s]; first used as scratch for L),
    W: [tokens, H, K], Wt: [slots, H, K, C] (W transposed, per chunk, in the dtype of the backward's W^T dd
    product), U: [tokens, H, V] (W and U fp32, or bf16 where ``configs.factors_dtype`` says so; W is stored only if
    W is given: with bf16 factors Wt holds the same values, and the forward pass reads those). The backward reads
    T and W only transposed, and fp32 operands of tensor-core products must not be transposed on the way
    in: they would go through shared memory one element at a time. A per-channel decay (CHANNEL_DECAY) also
    stores the keys decayed to the chunk's end, kg = k e^(Gamma - G) ([tokens, H, K], k's dtype), which the
    sequential passes read instead of k and G. Grid (slots, H).

    W and U are one [C, C] product per column block, on T read back whole (a strided load of Tt) with its
    columns scaled by beta (and e^G), so that the keys and values enter as they are (:func:`_factor_product`).
    """
    IS_VARLEN: tl.constexpr = cu_seqlens is not None  # packed sequences
    STORE_W: tl.constexpr = W is not None  # else Wt holds W (bf16 factors the forward pass reads transposed)
    X: tl.constexpr = k.dtype.element_ty == tl.float32  # fp32 inputs: fp32-accurate products
    slot, h = tl.program_id(0), tl.program_id(1)
    n, t0, nrows = locate_chunk(slot, cu_seqlens, N, T, C, IS_VARLEN)
    rows = tl.arange(0, C)
    valid = rows < nrows
    if DECAY == SCALAR_DECAY and g is not None:  # G first, read back below after the barrier: this saves the cumsum
        # stage's launch (a per-channel G here costs this kernel more than the cumsum stage takes)
        scalar_cumsum(g, G, t0, nrows, h, H, C)
        tl.debug_barrier()
    b = load_gate_rows(beta, t0, nrows, h, H, rows)
    L = b[:, None] * chunk_scores(k, k, G, t0, nrows, h, H, K, DECAY, True, 0, C, SB, BK, X, SPAN, CSPAN, KP)
    store_rows(Tt, L, t0, nrows, h, H, C, rows, rows)
    tl.debug_barrier()  # L is read back by blocks, by other threads
    T00, T10, T11, T20, T21, T22, T30, T31, T32, T33 = unit_lower_inverse(Tt, t0, nrows, h, H, C, SB, X)
    tl.debug_barrier()  # every block of L is read before T overwrites it
    for i in tl.static_range(3):  # the zero blocks above the diagonal: the scratch holds L's entries there
        for j in tl.static_range(i + 1, 4):
            _store_t_block(Tt, tl.full([SB, SB], 0.0, tl.float32), t0, nrows, h, H, C, SB, i, j)
    _store_t_block(Tt, T00, t0, nrows, h, H, C, SB, 0, 0)
    _store_t_block(Tt, T10, t0, nrows, h, H, C, SB, 1, 0)
    _store_t_block(Tt, T11, t0, nrows, h, H, C, SB, 1, 1)
    _store_t_block(Tt, T20, t0, nrows, h, H, C, SB, 2, 0)
    _store_t_block(Tt, T21, t0, nrows, h, H, C, SB, 2, 1)
    _store_t_block(Tt, T22, t0, nrows, h, H, C, SB, 2, 2)
    _store_t_block(Tt, T30, t0, nrows, h, H, C, SB, 3, 0)
    _store_t_block(Tt, T31, t0, nrows, h, H, C, SB, 3, 1)
    _store_t_block(Tt, T32, t0, nrows, h, H, C, SB, 3, 2)
    _store_t_block(Tt, T33, t0, nrows, h, H, C, SB, 3, 3)
    tl.debug_barrier()  # T's blocks are stored before T is read back whole
    # T [C, C] (columns past the chunk's end 0), its columns scaled by beta (U) and beta e^G (W): the products then
    # take the keys and values as they are, which bf16 inputs keep exact
    TU = load_rows(Tt, t0, nrows, h, H, C, rows, rows, True) * b[None, :]
    TW = TU
    if DECAY == SCALAR_DECAY:
        TW = TU * exp2(load_gate_rows(G, t0, nrows, h, H, rows))[None, :]
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = load_rows(k, t0, nrows, h, H, K, rows, cols, False)
        if DECAY == CHANNEL_DECAY:  # the per-channel decay on the keys, and kg, the keys decayed to the chunk's end
            Gr = load_rows(G, t0, nrows, h, H, K, rows, cols, False)
            last = tl.load(G + ((t0 + nrows - 1) * H + h) * K + cols, mask=cols < K, other=0.0)
            store_rows(kg, x * masked_exp2(valid[:, None], last[None, :] - Gr), t0, nrows, h, H, K, rows, cols)
            x = x * exp2(Gr)
        y = _factor_product(TW, x, X)
        if STORE_W:
            store_rows(W, y, t0, nrows, h, H, K, rows, cols)
        store_state(Wt, y, slot, h, H, K, C, cols, rows, True)  # every row of the slot: 0 past the chunk's end
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        store_rows(U, _factor_product(TU, load_rows(v, t0, nrows, h, H, V, rows, cols, False), X), t0, nrows, h,
                   H, V, rows, cols)


class Factors(NamedTuple):
    """The delta rule's W and U as the state pass reads them."""

    W: torch.Tensor  # [B, T, H, K], or with ``transposed`` its copy per chunk Wt [slots, H, K, C]
    U: torch.Tensor  # [B, T, H, V]
    transposed: bool  # W is read from Wt (bf16 factors of the decay kinds of configs.W_READ_TRANSPOSED)
    bf16: bool  # W and U are bf16 (configs.factors_dtype)
    narrow: bool  # bf16 factors on a grid narrower than half the SMs (configs.NARROW_BF16_FACTORS)


def wy_factors(plan: dict, s: Shapes, *, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
               g: Optional[torch.Tensor], G: Optional[torch.Tensor], Tt: torch.Tensor, Wt: torch.Tensor,
               Kg: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], decay: Decay) -> Factors:
    """T, W and U of every chunk: Tt [B, T, H, C] fp32 (T transposed per chunk), Wt [slots, H, K, C] (W transposed
    per chunk, in the states' dtype) and, for a per-channel decay, Kg [B, T, H, K] (k e^(Gamma - G)) are filled
    in; W and U come back. k: [B, T, H, K], v: [B, T, H, V], beta: [B, T, H]; g: a scalar decay's log decay
    [B, T, H], whose G [B, T, H] this stage writes, or None (no decay, a per-channel one, or G written already:
    the backward's recomputation reads it); G: [B, T, H(, K)] fp32, None without a decay."""
    dtype = factors_dtype(s, k.dtype, decay, k.device)
    bf16 = dtype == torch.bfloat16
    transposed = bf16 and decay in configs.W_READ_TRANSPOSED  # Wt is then bf16 too (the states' dtype)
    narrow = bf16 and not fills_half(s, decay, k.device)
    W = None if transposed else torch.empty_like(k, dtype=dtype)  # else the pass reads W from Wt
    U = torch.empty_like(v, dtype=dtype)
    launch_kernel(plan, "prep_vector" if decay == Decay.CHANNEL else "prep", delta_prep_kernel, (s.slots, s.H),
                  k, v, beta, g, G, Tt, W, Wt, U, Kg, cu_seqlens, s.T, s.H, s.N, s.K, s.V, DECAY=decay, C=CHUNK,
                  SB=SUB, BK=s.BK, BV=s.BV, SPAN=configs.BLOCK_SPAN, CSPAN=configs.CHUNK_SPAN, KP=s.BKF)
    return Factors(Wt if transposed else W, U, transposed, bf16, narrow)
