"""Sequence parallelism for memory layers: the unified recurrence over sequences split between ranks.

Every rank of a sequence-parallel group holds a contiguous piece of every sequence (with
``cu_seqlens``: a contiguous piece of the packed stream, whose first segment may continue the
previous rank's last one). Per head, every rule of the recurrence is an affine map of the state,
``S_t = A_t S_{t-1} + W_t`` (``A_t = diag(exp g_t)`` for additive rules, ``(I - beta_t k_t^T k_t)
diag(exp g_t)`` for the delta rule, ``diag(exp g_t) + a_t^T b_t`` for DPLR), so over a piece

    S_end = P S_start + S_end^0,        P = A_L ... A_1  ([K, K]; diagonal for additive rules)

where ``S_end^0`` is the piece's final state from a zero start. Each rank computes its piece from
a zero state (LASP-2, generalised to every rule), then one all-gather of ``(S^0, P)`` and the prefix
combination ``C_j = S^0_j + P_j C_{j-1}`` (``C_{-1} = 0``) give rank r its true start ``C_{r-1}``.
The outputs are completed with the read-out of the start, which is linear in it::

    o_t = o_t^0 + scale * q_t P_t S_start            (P_{t-1} with the RWKV-6 bonus)

For additive rules ``q_t P_t = q_t * exp(G_t)`` with ``G_t`` the cumulative log decay. For delta and
DPLR rules the state's columns evolve independently and the transition acts on each, so the
first segment runs once more with zero values (``V = K``) from the identity: that run's state is
``P_t`` itself and its read-out is exactly ``scale * q_t P_t`` (the same kernels, no new ones).
A rank whose last segment starts on it sends ``P = 0``: its end state does not depend on what
came before. Gradients flow through the all-gather (whose backward is a reduce-scatter), so they
equal the one-process run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed import ProcessGroup

from ..ops import linear_recurrence, parallel
from ..ops.recurrence.inputs import compute_dtype, validate
from .collectives import all_gather, group_rank, tie

__all__ = ["sp_linear_recurrence", "sp_halo", "PieceLayout"]


@dataclass(frozen=True)
class PieceLayout:
    """Where this rank's piece sits in its sequences (host integers: reading it never waits for a device).

    Without ``cu_seqlens`` every batch row is one sequence and every rank after the first continues
    all of them.
    """

    prefix_length: int  # tokens of the first local segment's sequence held by earlier ranks (0: it starts here)
    num_segments: int  # local segments (the batch rows without cu_seqlens)
    first_length: int  # tokens of the first local segment (T without cu_seqlens)
    last_start: int  # local index where the last local segment starts (0 without cu_seqlens)
    varlen: bool  # segments are packed along T with cu_seqlens

    @property
    def continues(self) -> bool:
        """Whether the first local segment continues the previous rank's last one."""
        return self.prefix_length > 0

    @property
    def passes_through(self) -> bool:
        """Whether the state arriving at this rank reaches its end (one continued segment per row)."""
        return self.continues and (self.num_segments == 1 or not self.varlen)

    @staticmethod
    def of(
        group: ProcessGroup, T: int, B: int, cu_seqlens: Optional[torch.Tensor], prefix_length: Optional[int],
        op: str,
    ) -> "PieceLayout":
        """The layout from the local ``cu_seqlens`` (read on the host) and ``prefix_length``."""
        if T < 1:
            raise ValueError(f"{op}: every rank needs at least one token of the sequence, got T = {T}")
        if cu_seqlens is None:
            if prefix_length is not None:
                raise ValueError(f"{op}: `prefix_length` describes packed sequences; give it with `cu_seqlens`")
            return PieceLayout(prefix_length=group_rank(group) * T, num_segments=B, first_length=T, last_start=0,
                               varlen=False)
        if prefix_length is None:
            raise ValueError(
                f"{op}: with `cu_seqlens`, `prefix_length` (tokens of this rank's first sequence held by "
                "earlier ranks; 0 when it starts here) is required"
            )
        if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
            raise ValueError(f"{op}: `prefix_length` must be an int >= 0, got {prefix_length!r}")
        if prefix_length > group_rank(group) * T:
            raise ValueError(f"{op}: `prefix_length` = {prefix_length} exceeds the {group_rank(group) * T} tokens "
                             "that earlier ranks hold")
        bounds = cu_seqlens.tolist()
        first = bounds[1] - bounds[0]
        if prefix_length and first == 0:
            raise ValueError(f"{op}: a continued first segment must hold tokens, got cu_seqlens = {bounds}")
        return PieceLayout(prefix_length=prefix_length, num_segments=len(bounds) - 1, first_length=first,
                           last_start=bounds[-2], varlen=True)


def sp_linear_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup,
    prefix_length: Optional[int] = None,
    log_decay: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    bonus: Optional[torch.Tensor] = None,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
    layout: Optional[PieceLayout] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`linmem.ops.linear_recurrence` of sequences split along time over the ranks of ``group``.

    Every rank calls it with its own contiguous piece (all pieces of one length ``T``); the result
    on each rank is its piece of what one process computes on the whole sequences.

    Args:
        q, k, v, log_decay, beta, bonus, a, b, scale, backend: as in ``linear_recurrence``, this
            rank's piece: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, per-token gates ``[B, T, ...]``.
        group: the sequence-parallel process group; pieces follow the ranks' order in it.
        prefix_length: with ``cu_seqlens``, the tokens of this rank's first sequence that earlier ranks
            hold (0 when it starts here). Without ``cu_seqlens`` every rank after the first continues.
        initial_state: ``[N, H, K, V]`` (N local sequences); a row is used only for a sequence that
            starts on this rank (rank 0 without ``cu_seqlens``).
        output_final_state: also return ``[N, H, K, V]``, the true state at the end of each local
            segment (the sequences' final states where they end on this rank).
        cu_seqlens: ``[N + 1]`` local boundaries of the packed segments (B == 1).
        layout: the :class:`PieceLayout` when the caller already has it (saves reading ``cu_seqlens``).

    Returns:
        ``(o [B, T, H, V], final_state or None)`` as ``linear_recurrence``.

    Example (on every rank of a sequence-parallel group, each with its piece of T tokens):
        >>> o, S = sp_linear_recurrence(q, k, v, group=sp_group, log_decay=g,  # doctest: +SKIP
        ...                             output_final_state=True)
    """
    op = "sp_linear_recurrence"
    if group is None:
        raise TypeError(f"{op}: `group` must be a process group (the sequence-parallel ranks), got None")
    inputs = validate(q, k, v, log_decay=log_decay, beta=beta, bonus=bonus, a=a, b=b, scale=scale,
                      initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    B, T = q.shape[:2]
    if layout is None:
        layout = PieceLayout.of(group, T, B, cu_seqlens, prefix_length, op)
    if inputs.decay_kind == "full":
        return _fold_value_columns(inputs, group, layout, backend)
    return _sp_recurrence(inputs, group, layout, backend)


def _local(q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence on this rank's tokens only, with its final states."""
    with parallel.local_ops():
        return linear_recurrence(q, k, v, output_final_state=True, **kwargs)


def _sp_recurrence(inputs, group: ProcessGroup, layout: PieceLayout, backend: str):
    q, k, v = inputs.q, inputs.k, inputs.v
    B, T, H, K = q.shape
    acc = compute_dtype(q)
    additive = inputs.rule == "additive"
    gates = dict(log_decay=inputs.log_decay, beta=inputs.beta, bonus=inputs.bonus, a=inputs.a, b=inputs.b)
    common = dict(scale=inputs.scale, backend=backend)
    L0 = layout.first_length
    first_rows = B if not layout.varlen else 1  # rows of the first segment(s): all rows without cu_seqlens

    # the starts used locally: the given ones where a sequence starts here, zero for a continued segment
    init = inputs.initial_state
    if init is not None and layout.continues:
        init = torch.cat([torch.zeros_like(init[:1]), init[1:]]) if layout.varlen else None

    o0, S_loc = _local(q, k, v, **gates, **common, initial_state=init, cu_seqlens=inputs.cu_seqlens)
    read_first = P_first = None  # scale * q_t P_t over the first segment(s), and their whole transition
    if layout.continues and additive:  # closed form from the cumulative log decays
        read_first, P_first = _additive_transition(inputs, layout)
    elif layout.continues:  # delta / DPLR: the first segment(s) once more, zero values from the identity
        first = lambda x: x if x is None or x.dim() < 3 else x[:, :L0]  # noqa: E731  (bonus, constant decay stay)
        eye = torch.eye(K, dtype=acc, device=q.device).expand(first_rows, H, K, K)
        read_first, P_first = _local(q[:, :L0], k[:, :L0], v.new_zeros(B, L0, H, K),
                                     **{n: first(x) for n, x in gates.items()}, **common, initial_state=eye)

    # what this rank passes on: its last segment's end state from zero, and that segment's transition
    # (zero when the segment starts here: the incoming state does not reach the end)
    last = S_loc[-first_rows:] if layout.varlen else S_loc  # [rows, H, K, V]
    if layout.passes_through:
        transition = P_first
    else:
        transition = torch.zeros(_transition_shape(inputs, first_rows), dtype=acc, device=q.device)
    gathered = all_gather(torch.cat([last.reshape(-1).to(acc), transition.reshape(-1)]), group)
    start = _prefix_state(gathered, group_rank(group), last.shape, transition.shape)

    if not layout.continues:  # nothing arrives; the gather still takes part in the backward
        o, S = tie(o0, gathered), S_loc
    else:  # complete the first segment(s) with the true start
        correction = torch.einsum("bthk,bhkv->bthv", read_first.to(acc), start)
        o_first = (o0[:, :L0].to(acc) + correction).to(q.dtype)
        o = torch.cat([o_first, o0[:, L0:]], dim=1) if layout.varlen else o_first
        S_first = S_loc[:first_rows] + _apply(P_first, start)
        S = torch.cat([S_first, S_loc[first_rows:]]) if layout.varlen else S_first
    return o, (S if inputs.output_final_state else None)


def _transition_shape(inputs, rows: int) -> tuple[int, ...]:
    H, K = inputs.q.shape[2], inputs.q.shape[3]
    return (rows, H, K) if inputs.rule == "additive" else (rows, H, K, K)


def _additive_transition(inputs, layout: PieceLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """For additive rules over the first segment(s): ``scale * q_t P_t`` ``[B, L0, H, K]`` (``P_{t-1}`` with
    the bonus) and the diagonal of the total transition ``[rows, H, K]``, from cumulative log decays."""
    q = inputs.q
    B, _, H, K = q.shape
    L0 = layout.first_length
    acc = compute_dtype(q)
    rows = B if not layout.varlen else 1
    g, kind = inputs.log_decay, inputs.decay_kind
    if kind == "none":
        G = q.new_zeros(B, L0, H, 1, dtype=acc)
    elif kind == "constant":  # [H]: the t-th token has decayed t + 1 times
        steps = torch.arange(1, L0 + 1, device=q.device, dtype=acc)
        G = (steps[:, None] * g.to(acc)[None, :])[None, :, :, None].expand(B, L0, H, 1)
    elif kind == "scalar":
        G = g[:, :L0].to(acc).cumsum(1)[..., None]
    else:  # vector
        G = g[:, :L0].to(acc).cumsum(1)
    total = torch.exp(G[:, -1]).expand(rows, H, K)  # [rows, H, K]
    if inputs.bonus is not None:  # the read-out precedes the step's decay
        G = torch.cat([torch.zeros_like(G[:, :1]), G[:, :-1]], dim=1)
    read = inputs.scale * q[:, :L0].to(acc) * torch.exp(G)
    return read, total


def _apply(P: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """P S for a diagonal ``P: [N, H, K]`` or a matrix ``P: [N, H, K, K]``; S: [N, H, K, V]."""
    return P[..., None] * S if P.dim() == 3 else P @ S


def _prefix_state(gathered: torch.Tensor, rank: int, state_shape, transition_shape) -> torch.Tensor:
    """The state at the start of rank ``rank``'s piece: ``C_{r-1}`` of ``C_j = S_j + P_j C_{j-1}``."""
    n_state = int(torch.Size(state_shape).numel())
    S_all = gathered[:, :n_state].reshape(-1, *state_shape)
    P_all = gathered[:, n_state:].reshape(-1, *transition_shape)
    carry = torch.zeros(state_shape, dtype=gathered.dtype, device=gathered.device)
    for j in range(rank):
        carry = S_all[j] + _apply(P_all[j], carry)
    return carry


def _fold_value_columns(inputs, group: ProcessGroup, layout: PieceLayout, backend: str):
    """A full ``[K, V]`` decay acts column by column: each value column is a vector-decay recurrence
    with V = 1, so fold the columns into heads and run that."""
    q, k, v = inputs.q, inputs.k, inputs.v
    B, T, H, K = q.shape
    V = v.shape[-1]

    def per_column(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:  # [B, T, H, K] -> [B, T, H * V, K]
        return None if x is None else x[:, :, :, None, :].expand(B, T, H, V, K).reshape(B, T, H * V, K)

    S0 = inputs.initial_state
    folded = validate(
        per_column(q), per_column(k), v.reshape(B, T, H * V, 1),
        log_decay=inputs.log_decay.transpose(-1, -2).reshape(B, T, H * V, K),
        beta=None if inputs.beta is None else inputs.beta[..., None].expand(B, T, H, V).reshape(B, T, H * V),
        bonus=None if inputs.bonus is None else inputs.bonus[:, None, :].expand(H, V, K).reshape(H * V, K),
        a=per_column(inputs.a), b=per_column(inputs.b), scale=inputs.scale,
        initial_state=None if S0 is None else S0.transpose(-1, -2).reshape(S0.shape[0], H * V, K, 1),
        output_final_state=inputs.output_final_state, cu_seqlens=inputs.cu_seqlens,
    )
    o, S = _sp_recurrence(folded, group, layout, backend)
    o = o.reshape(B, T, H, V)
    if S is not None:
        S = S.reshape(S.shape[0], H, V, K).transpose(-1, -2)
    return o, S


def sp_halo(
    x: torch.Tensor,
    group: ProcessGroup,
    size: int,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    prefix_length: Optional[int] = None,
    layout: Optional[PieceLayout] = None,
) -> torch.Tensor:
    """The ``size`` tokens that precede this rank's piece in its first sequence, for short
    convolutions (``size = conv_size - 1``) and token shifts (``size = 1``).

    Args:
        x: ``[B, T, ...]`` this rank's piece (``size <= T``).
        group: the sequence-parallel process group.
        size: how many previous tokens.
        cu_seqlens, prefix_length, layout: the local packing, as in :func:`sp_linear_recurrence`.

    Returns:
        ``[B, size, ...]``: the previous rank's last ``size`` tokens, zero where they belong to another
        sequence (and on the rank that holds the sequences' starts). Differentiable: the gradient of
        the halo goes back to the rank that owns those tokens.

    Example (every rank of a 2-rank group; rank 1 receives rank 0's last two tokens):
        >>> sp_halo(x, sp_group, 2).shape  # doctest: +SKIP
        torch.Size([B, 2, C])
    """
    op = "sp_halo"
    if group is None:
        raise TypeError(f"{op}: `group` must be a process group (the sequence-parallel ranks), got None")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"{op}: `size` must be an int >= 0, got {size!r}")
    B, T = x.shape[:2]
    if size == 0:
        return x[:, :0]
    if size > T:
        raise ValueError(f"{op}: the halo of {size} tokens must come from the previous rank alone, so it needs "
                         f"size <= the local length T = {T}")
    if layout is None:
        layout = PieceLayout.of(group, T, B, cu_seqlens, prefix_length, op)
    tail = x[:, T - size:]
    if layout.varlen and layout.last_start > T - size:  # tokens before the last segment belong elsewhere
        keep = torch.arange(T - size, T, device=x.device) >= layout.last_start
        tail = tail * keep.view(1, size, *([1] * (x.dim() - 2))).to(x.dtype)
    gathered = all_gather(tail, group)  # [world, B, size, ...]
    rank = group_rank(group)
    if rank == 0 or not layout.continues:
        return tie(torch.zeros_like(tail), gathered)
    return gathered[rank - 1]

