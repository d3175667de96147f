"""The unified linear recurrence in chunked parallel form, in plain PyTorch.

One algorithm serves every rule. Each rule is written as a *generalised low-rank
transition* ::

    S_t = diag(exp g_t) S_{t-1} + a_t^T x_t + k_t^T w_t,     x_t = b_t S^(b)_t

* additive:  no a, b;                      w = v
* delta:     a = -beta k, b = k, w = beta v, and S^(b)_t = diag(exp g_t) S_{t-1}
* DPLR:      a, b as given,      w = v,      and S^(b)_t = S_{t-1}

Inside a chunk of C tokens, with ``G_t`` the cumulative log decay from the chunk
start (fp32), the unknown low-rank reads ``x`` solve one unit-lower-triangular
system (the WY/UT form of the delta rule), solved with the explicit inverse of ``I - A_ba``
(``unit_lower_inverse``)::

    (I - A_ba) X = (b * exp(G^(b))) S_0 + A_bk W,   A_xy[t, s] = sum_k x_tk y_sk exp(G^(x)_tk - G_sk)

and outputs and the next chunk's state are products with ``S_0``::

    O       = (q * exp(G^(q)) + A_qa Wx) S_0 + A_qk W + A_qa X_0     (+ the bonus diagonal)
    S_next  = (diag(exp G_C) + A_d^T Wx) S_0 + K_d^T W + A_d^T X_0

so the only loop is over chunks (``S_{c+1} = M_c S_c + N_c``), never over tokens.
Decays only ever enter as ``exp`` of a non-positive difference of cumulative
sums, so strong gates cannot overflow; gates are clamped at ``LOG_DECAY_FLOOR`` first, so that
``-inf`` (forget everything) gives the reference's answer instead of ``-inf - -inf``.
Gradients come from autograd, with two hand-written backwards: the pairwise per-channel decays
inside a sub-block (``_PairwiseScores``) and the triangular inverse (``unit_lower_inverse``).

A full ``[K, V]`` decay acts column by column, so it is served by folding the V
columns into heads (each column is a vector-decay recurrence with V = 1); packed (varlen)
sequences are laid out from chunk boundaries of one row, with neutral steps (no decay, no write)
after each sequence's last token, and the carry restarts at each sequence's first chunk.

A NaN or Inf in one token's k, v, beta, a or b reaches every output of its chunk (a masked-out
score is 0 * NaN inside a matmul), not only the outputs from that token on as in the token loop;
outputs of earlier chunks stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F

from ..varlen import count_at_or_below, sequence_ids
from .inputs import LOG_DECAY_FLOOR, RecurrenceInputs, compute_dtype

DEFAULT_CHUNK_SIZE = 64


def chunk_recurrence(
    inputs: RecurrenceInputs, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked backend of :func:`linmem.ops.linear_recurrence` (inputs already validated).

    ``chunk_size`` trades the C x C intra-chunk products against the number of
    sequential chunk steps. For a per-channel decay the intra-chunk decay tensor
    is C x C x K per chunk; the Triton backend avoids that on GPU.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_recurrence: `chunk_size` must be >= 1, got {chunk_size}")
    if inputs.decay_kind == "full":
        return _fold_value_columns(inputs, chunk_size)
    if inputs.decay_kind == "constant":  # [H] -> one scalar per token
        B, T, H, _ = inputs.q.shape
        inputs = replace(inputs, log_decay=inputs.log_decay[None, None, :].expand(B, T, H), decay_kind="scalar")
    if inputs.cu_seqlens is not None:
        return _varlen(inputs, chunk_size)
    B, T, H, K = inputs.q.shape
    terms = _chunk_terms(inputs, chunk_size)
    S0 = inputs.q.new_zeros(B, H, K, inputs.v.shape[-1], dtype=terms.Q.dtype) if inputs.initial_state is None \
        else inputs.initial_state.to(terms.Q.dtype)
    starts, S = _carry(terms, S0)
    o = (terms.Q @ starts + terms.O).flatten(2, 3)[:, :, :T].movedim(1, 2)  # [B, T, H, V]
    return o.to(inputs.q.dtype), (S if inputs.output_final_state else None)


# --------------------------------------------------------------------------------------
# the chunked algorithm for a fixed-length batch; decay kind 'none', 'scalar' or 'vector'


@dataclass
class _ChunkTerms:
    """Per chunk c (of C tokens): outputs ``o = Q S_c + O`` and the carry ``S_{c+1} = M S_c + N``."""

    Q: torch.Tensor  # [B, H, n, C, K]: the queries against the state at the chunk start
    O: torch.Tensor  # [B, H, n, C, V]: the chunk's own contribution
    M: torch.Tensor  # [B, H, n, K, K] (low-rank rules), or the diagonal [B, H, n, K or 1, 1]
    N: torch.Tensor  # [B, H, n, K, V]
    low_rank: bool  # whether M is a matrix


def _chunk_terms(inputs: RecurrenceInputs, C: int) -> _ChunkTerms:
    """The closed forms of the module docstring for every chunk of every sequence, at once."""
    acc = compute_dtype(inputs.q)
    B, T, H, K = inputs.q.shape
    n = max(1, -(-T // C))
    q = inputs.q.to(acc) * inputs.scale
    k, v = inputs.k.to(acc), inputs.v.to(acc)
    beta, bonus = inputs.beta, inputs.bonus
    a_scale = None  # delta rule: a = a_scale * k, so scores against a are scores against k, rescaled
    if beta is not None:  # delta rule as a low-rank transition read after the decay
        beta = beta.to(acc)[..., None]
        lr_a, lr_b, w, b_after_decay = -beta * k, k, beta * v, True
        a_scale = -beta[..., 0]
    elif inputs.a is not None:  # DPLR, read before the decay
        lr_a, lr_b, w, b_after_decay = inputs.a.to(acc), inputs.b.to(acc), v, False
    else:
        lr_a = lr_b = None
        w, b_after_decay = v, False
    low_rank = lr_a is not None
    vector = inputs.decay_kind == "vector"
    if inputs.log_decay is None:
        g = q.new_zeros(B, T, H)
    else:  # a gate below the floor has erased the state already (see LOG_DECAY_FLOOR)
        g = inputs.log_decay.to(acc).clamp(min=LOG_DECAY_FLOOR)

    def chunks(x):  # [B, T, H, ...] -> [B, H, n, C, ...], zero-padded at the end
        x = x.movedim(2, 1)
        pad = n * C - T
        if pad:
            x = torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], pad, *x.shape[3:])], dim=2)
        return x.reshape(x.shape[0], x.shape[1], n, C, *x.shape[3:])

    q, k, w, g = chunks(q), chunks(k), chunks(w), chunks(g)
    if a_scale is not None:
        a_scale = chunks(a_scale)[..., None, :]  # [B, H, n, 1, C]: scales the key (column) side
    v_raw = chunks(v) if bonus is not None else None
    if low_rank:
        lr_a, lr_b = chunks(lr_a), chunks(lr_b)

    G = g.cumsum(dim=3)  # cumulative log decay from the chunk start, fp32
    G_prev = G - g
    G_q = G_prev if bonus is not None else G
    col = (lambda x: x) if vector else (lambda x: x[..., None])  # broadcast a decay onto [.., C, K]

    A_qk = _scores(q, G_q, k, G, strict=bonus is not None, vector=vector)
    O = A_qk @ w
    Q = q * torch.exp(col(G_q))
    if bonus is not None:  # RWKV-6: the current token enters with weight u
        u = bonus.to(acc)[None, :, None, None, :]
        O = O + (q * u * k).sum(-1, keepdim=True) * v_raw

    decay_to_end = torch.exp(col(G[:, :, :, -1:]) - col(G))  # [B, H, n, C, K or 1]
    N = (k * decay_to_end).transpose(-1, -2) @ w  # [B, H, n, K, V]
    chunk_decay = torch.exp(G[:, :, :, -1])  # [B, H, n] or [B, H, n, K]
    M = chunk_decay[..., None] if vector else chunk_decay[..., None, None]  # the diagonal carry

    if low_rank:
        G_b = G if b_after_decay else G_prev
        A_bk = _scores(lr_b, G_b, k, G, strict=True, vector=vector)
        A_ba = A_bk * a_scale if a_scale is not None else _scores(lr_b, G_b, lr_a, G, strict=True, vector=vector)
        L_inv = unit_lower_inverse(A_ba)  # (I - A_ba)^{-1}
        Wx = L_inv @ (lr_b * torch.exp(col(G_b)))
        X0 = L_inv @ (A_bk @ w)
        A_qa = A_qk * a_scale if a_scale is not None else _scores(q, G_q, lr_a, G, strict=bonus is not None,
                                                                  vector=vector)
        O = O + A_qa @ X0
        Q = Q + A_qa @ Wx
        a_d = (lr_a * decay_to_end).transpose(-1, -2)  # [B, H, n, K, C]
        N = N + a_d @ X0
        if vector:
            M = torch.diag_embed(chunk_decay) + a_d @ Wx
        else:
            M = chunk_decay[..., None, None] * torch.eye(K, dtype=acc, device=q.device) + a_d @ Wx
    return _ChunkTerms(Q=Q, O=O, M=M, N=N, low_rank=low_rank)


def _carry(terms: _ChunkTerms, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry the state from chunk to chunk, ``S_{c+1} = M_c S_c + N_c``, from ``S`` [B, H, K, V].

    Returns the states at the chunk starts [B, H, n, K, V] and the state after the last chunk. One op
    per chunk (and the maps split once, not sliced per chunk, so the backward stays linear in n).
    """
    B, H = S.shape[:2]
    step = torch.baddbmm if terms.low_rank else torch.addcmul  # N + M @ S, or N + M * S for a diagonal M
    S = S.flatten(0, 1)
    starts = []
    for M, N in zip(terms.M.flatten(0, 1).unbind(1), terms.N.flatten(0, 1).unbind(1)):
        starts.append(S)
        S = step(N, M, S)
    return torch.stack(starts, dim=1).unflatten(0, (B, H)), S.unflatten(0, (B, H))


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I - A)^{-1}`` for strictly lower-triangular ``A``: [.., C, C] -> [.., C, C].

    Forward substitution by blocks that double in size: from the inverses T11, T22 of two diagonal
    blocks of ``L = I - A``, ::

        [[L11, 0], [L21, L22]]^{-1} = [[T11, 0], [T22 A21 T11, T22]]      (L21 = -A21)

    so log2(C) rounds of batched matmuls invert every block, starting from the 1 x 1 blocks (= 1).
    Like forward substitution (and unlike a Neumann series) it only multiplies entries of the inverse,
    so it is as stable; unlike a batched triangular solve (a LAPACK call per matrix and right-hand
    side block), it is a dozen batched calls, a little faster on one CPU thread and fewer parallel
    regions for threads that compete for cores. The backward is two matmuls:
    ``dA = tril(T^T dT T^T, -1)``.
    """
    return _UnitLowerInverse.apply(A)


class _UnitLowerInverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A):  # noqa: D102 (documented on unit_lower_inverse)
        C = A.shape[-1]
        size = 1 << max(C - 1, 0).bit_length()  # the next power of two; the padding extends L by I
        A_pad = F.pad(A, (0, size - C, 0, size - C)) if size != C else A
        T = A.new_ones(*A.shape[:-2], size, 1, 1)  # [.., m, s, s]: the inverses of the m diagonal blocks
        s = 1
        while s < size:
            m = size // (2 * s)
            blocks = A_pad.unflatten(-1, (m, 2, s)).unflatten(-4, (m, 2, s))  # [.., m, 2, s, m, 2, s]
            A21 = blocks.diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)  # [.., m, s, s]
            T = T.unflatten(-3, (m, 2))
            T11, T22 = T[..., 0, :, :], T[..., 1, :, :]
            T = torch.cat([torch.cat([T11, torch.zeros_like(T11)], -1), torch.cat([T22 @ (A21 @ T11), T22], -1)], -2)
            s *= 2
        T = T[..., 0, :C, :C]
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, dT):  # noqa: D102
        (T,) = ctx.saved_tensors
        Tt = T.transpose(-1, -2)
        return (Tt @ dT @ Tt).tril(-1)


SUB_BLOCK = 16  # exact pairwise decays only inside sub-blocks of this many tokens (vector decay)


def _scores(x: torch.Tensor, G_x: torch.Tensor, y: torch.Tensor, G: torch.Tensor, *, strict: bool,
            vector: bool) -> torch.Tensor:
    """Decayed scores ``A[t, s] = sum_k x_tk y_sk exp(G_x[t, k] - G[s, k])`` for s <= t (s < t if strict).

    x, y: [.., C, K]; G_x, G: [.., C] (scalar decay) or [.., C, K] (vector decay); -> [.., C, C].
    Every exponent is a non-positive difference, and masked pairs are replaced before the
    exp, so nothing overflows and their gradient is exactly zero.
    """
    C = x.shape[-2]
    if not vector:
        diff = G_x[..., :, None] - G[..., None, :]
        return (x @ y.transpose(-1, -2)) * _masked_exp(diff, _causal(C, strict, x.device))
    sub = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    m = C // sub
    blocks = lambda t: t.unflatten(-2, (m, sub))  # noqa: E731  [.., C, K] -> [.., m, sub, K]
    xb, Gxb, yb, Gb = blocks(x), blocks(G_x), blocks(y), blocks(G)
    # pairs inside one sub-block: exact, a [sub, sub, K] tensor per block
    inside = _PairwiseScores.apply(xb, Gxb, yb, Gb, _causal(sub, strict, x.device))  # [.., m, sub, sub]
    if m == 1:
        return inside[..., 0, :, :]
    # pairs with s in an earlier sub-block: factor through R_i = G just before block i,
    # exp(G_x,t - G_s) = exp(G_x,t - R_i) exp(R_i - G_s), both factors <= 1
    R = torch.cat([torch.zeros_like(G[..., :1, :]), G[..., sub - 1 :: sub, :][..., :-1, :]], dim=-2)  # [.., m, K]
    earlier = torch.arange(C, device=x.device)[None, :] < (torch.arange(m, device=x.device) * sub)[:, None]
    x_r = xb * torch.exp(Gxb - R[..., :, None, :])  # [.., m, sub, K]
    y_r = y[..., None, :, :] * _masked_exp(R[..., :, None, :] - G[..., None, :, :], earlier[..., None])  # [.., m, C, K]
    scores = x_r @ y_r.transpose(-1, -2)  # [.., m, sub, C]
    on_diagonal = torch.eye(m, dtype=x.dtype, device=x.device)[:, None, :, None]  # [m, 1, m, 1]
    scores = scores + (inside[..., :, :, None, :] * on_diagonal).flatten(-2)
    return scores.flatten(-3, -2)


class _PairwiseScores(torch.autograd.Function):
    """``A[.., t, s] = sum_k x_tk y_sk exp(Gx_tk - G_sk)`` for the pairs of ``mask`` [sub, sub], for
    x, Gx, y, G: [.., sub, K] (the exact part of the per-channel scores).

    The [.., sub, sub, K] decay tensor dominates the cost of a per-channel decay on a CPU, so the
    backward recomputes it instead of saving it, and the gate gradients reuse the input gradients:
    ``dGx = x * dx`` and ``dG = -y * dy`` (G enters only through exp(Gx - G)).
    """

    @staticmethod
    def forward(ctx, x, Gx, y, G, mask):  # noqa: D102 (documented on the class)
        ctx.save_for_backward(x, Gx, y, G, mask)
        return torch.einsum("...tk,...sk,...tsk->...ts", x, y, _pair_decay(Gx, G, mask))

    @staticmethod
    def backward(ctx, dA):  # noqa: D102
        x, Gx, y, G, mask = ctx.saved_tensors
        P = dA[..., None] * _pair_decay(Gx, G, mask)  # [.., t, s, K]
        dx = torch.einsum("...tsk,...sk->...tk", P, y)
        dy = torch.einsum("...tsk,...tk->...sk", P, x)
        return dx, x * dx, dy, -y * dy, None


def _pair_decay(Gx: torch.Tensor, G: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(Gx_tk - G_sk) for the pairs of ``mask`` [sub, sub], 0 elsewhere: [.., sub, sub, K]."""
    return _masked_exp(Gx[..., :, None, :] - G[..., None, :, :], mask[..., None])


def _causal(C: int, strict: bool, device: torch.device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _masked_exp(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(diff) where mask, exactly 0 elsewhere (without evaluating exp of the masked values)."""
    return torch.exp(torch.where(mask, diff, torch.full_like(diff, float("-inf"))))


# --------------------------------------------------------------------------------------
# reductions of the other cases to `_chunked`


def _fold_value_columns(inputs: RecurrenceInputs, chunk_size: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Full [K, V] decay: every value column is a vector-decay recurrence with V = 1."""
    B, T, H, K = inputs.q.shape
    V = inputs.v.shape[-1]

    def per_column(x):  # [B, T, H, K] -> [B, T, H * V, K], the row repeated for every value column
        return None if x is None else x[:, :, :, None, :].expand(B, T, H, V, K).reshape(B, T, H * V, K)

    S0 = inputs.initial_state
    o, S = chunk_recurrence(replace(
        inputs,
        q=per_column(inputs.q), k=per_column(inputs.k), v=inputs.v.reshape(B, T, H * V, 1),
        decay_kind="vector",
        log_decay=inputs.log_decay.transpose(-1, -2).reshape(B, T, H * V, K),
        beta=None if inputs.beta is None else inputs.beta[..., None].expand(B, T, H, V).reshape(B, T, H * V),
        bonus=None if inputs.bonus is None else inputs.bonus[:, None, :].expand(H, V, K).reshape(H * V, K),
        a=per_column(inputs.a), b=per_column(inputs.b),
        initial_state=None if S0 is None else S0.transpose(-1, -2).reshape(S0.shape[0], H * V, K, 1),
    ), chunk_size=chunk_size)
    o = o.reshape(B, T, H, V)
    if S is not None:
        S = S.reshape(S.shape[0], H, V, K).transpose(-1, -2)
    return o, S


def _varlen(inputs: RecurrenceInputs, C: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Packed sequences (B = 1): each sequence is laid out from a chunk boundary of one long row, its last
    chunk padded with neutral steps (no decay, no write), and the carry restarts at every sequence's first
    chunk. Every shape follows from T, N and C, never from the lengths' values, so nothing waits for the
    device and ``torch.compile`` traces it without graph breaks.
    """
    T, H, K = inputs.q.shape[1:]
    V = inputs.v.shape[-1]
    acc = compute_dtype(inputs.q)
    at = _ChunkLayout.of(inputs.cu_seqlens, T, C)
    N = at.lengths.shape[0]
    pack = lambda x: None if x is None else _scatter_rows(x[0], at.slot, at.slots)[None]  # noqa: E731
    packed = replace(inputs, q=pack(inputs.q), k=pack(inputs.k), v=pack(inputs.v), log_decay=pack(inputs.log_decay),
                     beta=pack(inputs.beta), a=pack(inputs.a), b=pack(inputs.b), initial_state=None, cu_seqlens=None)
    terms = _chunk_terms(packed, C)
    S0 = inputs.q.new_zeros(N, H, K, V, dtype=acc) if inputs.initial_state is None else inputs.initial_state.to(acc)
    restart = _scatter_rows(S0, at.first_chunk, at.chunks + N)[: at.chunks].movedim(0, 1)[None]  # [1, H, n, K, V]
    # a sequence's first chunk starts from its initial state: the map of the chunk before it becomes
    # S -> restart (M = 0, N = restart)
    before_first = at.first[1:, None, None]
    maps = replace(terms,
                   M=torch.cat([torch.where(before_first, 0.0, terms.M[:, :, :-1]), terms.M[:, :, -1:]], dim=2),
                   N=torch.cat([torch.where(before_first, restart[:, :, 1:], terms.N[:, :, :-1]), terms.N[:, :, -1:]],
                               dim=2))
    starts, _ = _carry(maps, torch.where(at.first[0], restart[:, :, 0], 0.0))
    o = (terms.Q @ starts + terms.O)[0].flatten(1, 2).movedim(0, 1)  # [slots, H, V]
    o = _scatter_rows(o, at.unpack, T + at.slots)[:T]
    if not inputs.output_final_state:
        return o[None].to(inputs.q.dtype), None
    ends = (terms.M @ starts if terms.low_rank else terms.M * starts) + terms.N  # after each chunk
    final = _scatter_rows(ends[0].movedim(1, 0), at.final_of_chunk, N + at.chunks)[:N]
    final = torch.where((at.lengths > 0)[:, None, None, None], final, S0)  # an empty sequence keeps its state
    return o[None].to(inputs.q.dtype), final


@dataclass
class _ChunkLayout:
    """Where packed tokens and sequences go when every sequence starts at a chunk boundary.

    Every move between the two orders is a scatter through an injective map (``_scatter_rows``).
    """

    lengths: torch.Tensor  # [N] tokens per sequence
    chunks: int  # T // C + N: at least the sum of ceil(length / C), whatever the lengths
    slots: int  # chunks * C
    slot: torch.Tensor  # [T] the place of each token in the chunk-aligned row
    unpack: torch.Tensor  # [slots] the token at each place, or T + place for padding
    first: torch.Tensor  # [chunks] bool: the chunk is the first of a sequence
    first_chunk: torch.Tensor  # [N] the first chunk of each sequence (chunks + n for an empty one)
    final_of_chunk: torch.Tensor  # [chunks] the sequence that ends with each chunk, or N + chunk

    @staticmethod
    def of(cu_seqlens: torch.Tensor, T: int, C: int) -> "_ChunkLayout":
        device = cu_seqlens.device
        bounds = cu_seqlens.to(torch.int64)
        lengths = bounds[1:] - bounds[:-1]
        N = lengths.shape[0]
        chunks = T // C + N
        per_sequence = (lengths + C - 1) // C
        end = per_sequence.cumsum(0)  # one past each sequence's last chunk
        begin = end - per_sequence
        nonempty = lengths > 0
        t = torch.arange(T, device=device)
        sequence = sequence_ids(bounds, T)  # [T]
        slot = begin[sequence] * C + (t - bounds[sequence])
        c = torch.arange(chunks, device=device)
        owner = count_at_or_below(end, chunks).clamp(max=N - 1)
        extra = chunks + torch.arange(N, device=device)  # out-of-range places for empty sequences
        return _ChunkLayout(
            lengths=lengths, chunks=chunks, slots=chunks * C, slot=slot,
            unpack=_inverse(slot, chunks * C, offset=T),
            first=(begin[owner] == c) & (c < end[owner]),
            first_chunk=torch.where(nonempty, begin, extra),
            final_of_chunk=_inverse(torch.where(nonempty, end - 1, extra), chunks + N, offset=N)[:chunks],
        )


# WORKAROUND(torch 2.13, inductor CPU): move rows by injective scatters, not gathers (pytorch#191837; dev/upstream/)
def _scatter_rows(x: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """``out[dest[i]] = x[i]`` in ``rows`` rows of zeros, for an injective ``dest``. Its backward is a gather,
    where a gather's would be an accumulating scatter: inductor's CPU backend (2+ threads) writes those
    out of bounds when their source is read through a transpose."""
    return x.new_zeros(rows, *x.shape[1:]).index_put((dest,), x)


def _inverse(index: torch.Tensor, size: int, *, offset: int) -> torch.Tensor:
    """For an injective ``index`` [n] into [0, size): ``inv`` [size] with ``inv[index[i]] = i``, and
    ``inv[j] = offset + j`` where no ``index`` points (so that ``inv`` is injective too when offset >= n)."""
    positions = torch.arange(size, device=index.device)
    return (positions + offset).index_put((index,), torch.arange(index.shape[0], device=index.device))
