"""The chunked Bayesian filter's forward kernel and its launcher (backend "chunk_triton").

One program per (sequence, head) runs the chunks of C tokens one after another, holding the belief ``m [K, V]``
and ``P [K, K]`` in fp32 on chip. Per chunk it builds the C x C innovation matrix S, factors it and inverts the
factor (``Li = L^-1``, :func:`inverse_factor`), so that the whitening of chunk.py's triangular solves is a product
on tensor cores::

    Z = Li (Y - Yhat),   W = U * (Li H),   F = Li R
    o_t   = scale (alpha_t q_t^T m + sum_{i <= t} W_it Z_i)
    var_t = alpha_t^2 q_t^T P q_t + beta_t |q_t|^2 - sum_{i <= t} W_it^2 + r_t
    m' = alpha_C m + F^T Z,   P' = sym(alpha_C^2 P + beta_C I - F^T F)

(the formulas and their names: :mod:`.chunk`). A chunk shorter than C is padded with neutral tokens (k = q = v =
0, a = 1, r = 1, w = 0): their rows of S are those of the identity, so they change nothing. For the backward it
saves every chunk's ``Li`` (``factors [slots, H, C C]`` fp32: C floats a token) and the start ``(m, P)`` of every
GROUP-th chunk (``states [group slots, H, K V + K K]`` fp32); the backward recomputes the starts between them
(:func:`chunk_end`). Layout: q, k ``[tokens, H, K]``, v ``[tokens, H, V]``, the gates ``[tokens, H, 3]`` fp32
(log decay, observation noise, process noise); sequence n owns tokens ``[bos, eos)`` and chunk slots from
:func:`~linmem.ops.recurrence.triton.layout.first_slot`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..recurrence.triton.layout import first_slot, sequence_bounds
from ..recurrence.triton.numerics import exp, mm, rounded, running_total, total
from ..triton_launch import next_power_of_2, run_kernel
from .conditioning import FUSED_CHUNK_SIZE

# Zero tiles are tl.full(shape, 0.0, tl.float32): see kernels.py.

#: the largest key and value head dims: P [K, K] and m [K, V] (and in the backward their adjoints) live on chip
MAX_HEAD_DIM = 128
#: the largest head dim of float32 inputs (Hopper's shared memory)
MAX_FP32_HEAD_DIM = 64
#: software-pipelining stages of every launch (Triton's default)
STAGES = 3
#: chunks per saved state: the forward saves the start (m, P) of every GROUP-th chunk, the backward recomputes the
#: others from it (one more chunk step each), which keeps K (K + V) / GROUP floats per chunk instead of K (K + V)
GROUP = 4
#: GROUP as the kernels read it (a global of a kernel must be a constexpr instance)
GROUP_TL = tl.constexpr(GROUP)


@triton.jit
def dot(a, b):
    """a @ b of fp32 tiles at about fp32's accuracy (three tf32 products). The right operand is staged in shared
    memory as two fp32 copies (its tf32 part and the rest), the left one stays in registers: a state-sized right
    operand ([K, K] or [K, V]: 128 KiB at K = V = 128) would not fit beside the others, so the products with a
    state take it on the left (:func:`dot_sym`, :func:`dot_state`, :func:`dot_state_t`)."""
    return mm(a, b, tl.float32, True)


@triton.jit
def dot_sym(x, S):
    """x @ S for a symmetric state S [K, K], as (S x^T)^T."""
    return tl.trans(dot(S, tl.trans(x)))


@triton.jit
def dot_state(x, Y):
    """x @ Y for a state Y [K, V], as (Y^T x^T)^T."""
    return tl.trans(dot(tl.trans(Y), tl.trans(x)))


@triton.jit
def dot_state_t(x, Y):
    """x @ Y^T for a state Y [K, V], as (Y x^T)^T."""
    return tl.trans(dot(Y, tl.trans(x)))


@triton.jit
def load_rows(x, tok, valid, cols, D, mcol):
    """The fp32 tile x[tok, cols] of a [tokens * H, D] tensor (tok: token * H + head) for the valid rows, else 0."""
    return tl.load(x + tok[:, None] * D + cols[None, :], mask=valid[:, None] & mcol[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_rows(x, tok, valid, cols, D, mcol, value):
    """Store the fp32 tile value to x[tok, cols] of a [tokens * H, D] tensor, rounded to x's dtype, valid rows only."""
    tl.store(x + tok[:, None] * D + cols[None, :], rounded(value, x.dtype.element_ty),
             mask=valid[:, None] & mcol[None, :])


@triton.jit
def load_gates(gates, tok, valid):
    """(log decay g, observation noise r, process noise w) [C] of the chunk's rows; padding rows take the neutral
    token a = 1, r = 1, w = 0."""
    g = tl.load(gates + tok * 3, mask=valid, other=0.0)
    r = tl.load(gates + tok * 3 + 1, mask=valid, other=1.0)
    w = tl.load(gates + tok * 3 + 2, mask=valid, other=0.0)
    return g, r, w


@triton.jit
def decays(g, w, rows, cols):
    """The chunk's decays: alpha_i = exp(G_i) [C], A = U * alpha_{i:j} [C, C], AA = alpha_i alpha_j [C, C], beta
    [C] (process noise gathered since the chunk start: beta_j = sum_l A_lj^2 w_l) and B = A * beta_i [C, C]."""
    G = running_total(g, 0)
    upper = rows[:, None] <= cols[None, :]
    A = tl.where(upper, exp(tl.where(upper, G[None, :] - G[:, None], 0.0)), 0.0)
    AA = exp(G[:, None] + G[None, :])
    beta = total(A * A * w[:, None], 0)
    return exp(G), A, AA, beta, A * beta[:, None]


@triton.jit
def last(x, rows, C: tl.constexpr):
    """x[C - 1] of a [C] vector."""
    return total(tl.where(rows == C - 1, x, 0.0), 0)


@triton.jit
def inverse_factor(S, rows, cols, C: tl.constexpr):
    """Li = L^-1 for S = L L^T [C, C] symmetric positive definite, by elimination on [S | I]: step j subtracts
    (S_ij / S_jj) times row j from every row i > j of both, which leaves S's trailing block its Schur complement
    (symmetric: its row j is its column j) and turns I into X, the inverse of the unit lower triangular factor of
    ``S = X^-1 diag(p) X^-T``, the p_j the pivots S_jj. Then ``Li = diag(p)^-1/2 X``: Cholesky's factor, inverted."""
    X = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
    pivots = tl.full([C], 1.0, tl.float32)
    for j in range(C):
        col = total(tl.where(cols[None, :] == j, S, 0.0), 1)  # column j of the trailing block, = its row j
        p = total(tl.where(rows == j, col, 0.0), 0)
        factor = tl.where(rows > j, col / p, 0.0)
        S = S - factor[:, None] * tl.where(rows >= j, col, 0.0)[None, :]
        X = X - factor[:, None] * total(tl.where(rows[:, None] == j, X, 0.0), 0)[None, :]
        pivots = tl.where(rows == j, p, pivots)
    return X / tl.sqrt(pivots)[:, None]


@triton.jit
def whitening(P, q, k, g, r, w, rows, cols, C: tl.constexpr):
    """What a chunk's covariance gives, independent of the values: (Li, Wf = Li H, F = Li R) and the pieces the
    read-outs and the next covariance take. See the module docstring; H and R as chunk.py's."""
    alpha, A, AA, beta, B = decays(g, w, rows, cols)
    diag = rows[:, None] == cols[None, :]
    upper = rows[:, None] <= cols[None, :]
    kP = dot_sym(k, P)
    KK = dot(k, tl.trans(k))
    B_sym = B + tl.trans(B) - tl.where(diag, B, 0.0)
    S = AA * dot(kP, tl.trans(k)) + B_sym * KK + tl.where(diag, r[:, None], 0.0)
    Li = inverse_factor(S, rows, cols, C)
    Hm = tl.where(upper, AA * dot(kP, tl.trans(q)), 0.0) + B * dot(k, tl.trans(q))
    aC = last(alpha, rows, C)
    Alast = total(tl.where(cols[None, :] == C - 1, A, 0.0), 1)  # alpha_{i:C}
    R = (alpha * aC)[:, None] * kP + (Alast * beta)[:, None] * k
    return Li, dot(Li, Hm), dot(Li, R), alpha, aC, beta


@triton.jit
def advance(m, P, F, Z, aC, beta_C, eye):
    """The next chunk's start: m' = alpha_C m + F^T Z, P' = sym(alpha_C^2 P + beta_C I - F^T F)."""
    m = aC * m + dot(tl.trans(F), Z)
    P = (aC * aC) * P + beta_C * eye - dot(tl.trans(F), F)
    return m, 0.5 * (P + tl.trans(P))


@triton.jit
def chunk_end(m, P, k, v, g, w, Li, eye, rows, cols, C: tl.constexpr):
    """(m', P') of a chunk from its start (m, P) and its inverse factor Li: the forward's step without the
    read-outs (the same products, so the same values), for the backward's recomputation of chunk starts."""
    alpha, A, AA, beta, B = decays(g, w, rows, cols)
    aC = last(alpha, rows, C)
    Alast = total(tl.where(cols[None, :] == C - 1, A, 0.0), 1)
    R = (alpha * aC)[:, None] * dot_sym(k, P) + (Alast * beta)[:, None] * k
    Z = dot(Li, v - alpha[:, None] * dot_state(k, m))
    return advance(m, P, dot(Li, R), Z, aC, last(beta, rows, C), eye)


@triton.jit
def state_offsets(K, V, kr, vr):
    """Offsets of m [K, V] and P [K, K] in a saved state (K V + K K floats)."""
    return kr[:, None] * V + vr[None, :], K * V + kr[:, None] * K + kr[None, :]


@triton.jit
def chunk_fwd_kernel(q, k, v, gates, M0, P0, o, var, MT, PT, states, factors, cu_seqlens, scale, prior, T, H, K, V,
                     HAS_INIT: tl.constexpr, VAR: tl.constexpr, SAVE: tl.constexpr, IS_VARLEN: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The filter over one sequence and head, a chunk at a time. o: [tokens, H, V] (the dtype of v); var
    [tokens, H] fp32; M0, MT [N, H, K, V], P0, PT [N, H, K, K] fp32; states [group slots, H, K V + K K], factors
    [slots, H, C C] (see the module docstring)."""
    nh = tl.program_id(0)
    n, h = nh // H, nh % H
    bos, eos = sequence_bounds(n, cu_seqlens, T, IS_VARLEN)
    rows, cols = tl.arange(0, C), tl.arange(0, C)
    kr, vr = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = kr < K, vr < V
    mkk, mkv = mk[:, None] & mk[None, :], mk[:, None] & mv[None, :]
    eye = tl.where((kr[:, None] == kr[None, :]) & mk[:, None], 1.0, 0.0)
    state_m = nh.to(tl.int64) * K * V + kr[:, None] * V + vr[None, :]
    state_P = nh.to(tl.int64) * K * K + kr[:, None] * K + kr[None, :]
    if HAS_INIT:
        m = tl.load(M0 + state_m, mask=mkv, other=0.0)
        P = tl.load(P0 + state_P, mask=mkk, other=0.0)
        P = 0.5 * (P + tl.trans(P))
    else:
        m = tl.full([BK, BV], 0.0, tl.float32)
        P = prior * eye
    slot = first_slot(n, bos, T, C, IS_VARLEN)
    group_slot = first_slot(n, bos, T, C * GROUP_TL, IS_VARLEN)
    at_m, at_P = state_offsets(K, V, kr, vr)
    upper = rows[:, None] <= cols[None, :]
    for t0 in range(bos, eos, C):
        valid = t0 + rows < eos
        tok = (t0 + rows) * H + h
        qc = load_rows(q, tok, valid, kr, K, mk)
        kc = load_rows(k, tok, valid, kr, K, mk)
        vc = load_rows(v, tok, valid, vr, V, mv)
        g, r, w = load_gates(gates, tok, valid)
        Li, Wf, F, alpha, aC, beta = whitening(P, qc, kc, g, r, w, rows, cols, C)
        if SAVE:
            tl.store(factors + (slot * H + h) * C * C + rows[:, None] * C + cols[None, :], Li)
            first = (kr * 0 + (t0 - bos) % (C * GROUP_TL)) == 0  # the group's first chunk: its start is saved
            base = states + (group_slot * H + h) * (K * V + K * K)
            tl.store(base + at_m, m, mask=mkv & first[:, None])
            tl.store(base + at_P, P, mask=mkk & first[:, None])
            group_slot += tl.where((t0 - bos) % (C * GROUP_TL) == C * (GROUP_TL - 1), 1, 0)
        W = tl.where(upper, Wf, 0.0)
        Z = dot(Li, vc - alpha[:, None] * dot_state(kc, m))
        out = scale * (alpha[:, None] * dot_state(qc, m) + dot(tl.trans(W), Z))
        store_rows(o, tok, valid, vr, V, mv, out)
        if VAR:
            qPq = total(dot_sym(qc, P) * qc, 1)
            tl.store(var + tok, alpha * alpha * qPq + beta * total(qc * qc, 1) - total(W * W, 0) + r, mask=valid)
        m, P = advance(m, P, F, Z, aC, last(beta, rows, C), eye)
        slot += 1
    tl.store(MT + state_m, m, mask=mkv)
    tl.store(PT + state_P, P, mask=mkk)


@dataclass(frozen=True)
class ChunkLaunch:
    """How the chunked kernels run: tokens per chunk and warps per program."""

    chunk: int  # C: tokens per chunk, 16 (tl.dot's smallest tile) or FUSED_CHUNK_SIZE = 32
    num_warps: int  # warps per program

    def __post_init__(self) -> None:
        if self.chunk not in (16, FUSED_CHUNK_SIZE):
            raise ValueError(f"ChunkLaunch: `chunk` must be 16 or {FUSED_CHUNK_SIZE} (the chunk length the "
                             f"conditioning bound assumes, and the most the backward's shared memory holds on Hopper "
                             f"at K = V = 128), got {self.chunk!r}")

    @staticmethod
    def default(K: int, V: int) -> "ChunkLaunch":
        return ChunkLaunch(FUSED_CHUNK_SIZE, 4 if max(K, V) <= 64 else 8)


def pow2(n: int) -> int:
    """The smallest power of two >= n, at least 16 (tl.dot's smallest tile)."""
    return max(16, next_power_of_2(n))


def num_slots(B: int, T: int, N: int, C: int, varlen: bool) -> int:
    """Slots of a call for chunks of C tokens (C * GROUP for the saved states): every sequence's chunks, at
    first_slot's offsets."""
    return B * T // C + N + 1 if varlen else N * -(-T // C)


def chunk_forward(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, M0: Optional[Tensor], P0: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], scale: float, prior: float, variance: bool, save: bool,
                  launch: ChunkLaunch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (o [B, T, H, V], var [B, T, H] fp32 (empty without ``variance``), M_T [N, H, K, V], P_T [N, H, K, K],
    and for the backward states [group slots, H, K V + K K] and factors [slots, H, C C] fp32, empty without
    ``save``).

    q, k [B, T, H, K], v [B, T, H, V] contiguous; gates [B, T, H, 3] fp32 contiguous (log decay, observation
    noise, process noise); M0 [N, H, K, V], P0 [N, H, K, K] fp32 contiguous or None (the prior).
    """
    B, T, H, K = q.shape
    V, C = v.shape[-1], launch.chunk
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty_like(v)
    var = torch.empty(B, T, H, **f32) if variance else q.new_empty(0, dtype=torch.float32)
    MT, PT = torch.empty(N, H, K, V, **f32), torch.empty(N, H, K, K, **f32)
    states, factors = (torch.empty(size, **f32) if save else q.new_empty(0, dtype=torch.float32)
                       for size in saved_sizes(B, T, H, K, V, N, C, cu_seqlens is not None))
    run_kernel(
        chunk_fwd_kernel, (N * H,),
        (q, k, v, gates, MT if M0 is None else M0, PT if P0 is None else P0, o, var if variance else gates, MT, PT,
         states if save else gates, factors if save else gates, gates if cu_seqlens is None else cu_seqlens, scale,
         prior, T, H, K, V),
        {"HAS_INIT": M0 is not None, "VAR": variance, "SAVE": save, "IS_VARLEN": cu_seqlens is not None, "C": C,
         "BK": pow2(K), "BV": pow2(V)}, launch.num_warps, STAGES)
    return o, var, MT, PT, states, factors


def saved_sizes(B: int, T: int, H: int, K: int, V: int, N: int, C: int, varlen: bool
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of the forward's states and factors (:func:`chunk_forward`)."""
    return ((num_slots(B, T, N, C * GROUP, varlen), H, K * V + K * K), (num_slots(B, T, N, C, varlen), H, C * C))
