"""Sequence parallelism for the Bayesian memory: the filter over sequences split between ranks, exact, with
collectives only, which every rank issues in the same order whatever its rank, layout or piece.

The unified recurrence's pieces are combined after the fact because every rule is affine in the state a piece
starts from (:mod:`linmem.distributed.sequence`: LASP-2's all-gather). The Kalman filter's covariance update is
not: ``P_t = P^- - u u^T / s`` with ``u = P^- k_t``, ``s = k_t . u + r`` is a rational function of the covariance
the piece starts from, and the mean's gain depends on it. Over a piece the covariance's map is linear-fractional
(a 2K x 2K matrix), so an associative combination exists, but evaluating it takes a K x K solve whose condition
grows with the evidence of the whole piece (the information form's weakness in fp32) and a second kind of pass
over the piece; so here the state a piece starts from is known before the piece runs, one rank after another::

    forward,  round j = 0 .. world - 2:  rank j filters its piece and broadcasts the end state (M, P) of its last
              segment; rank j + 1 starts its first segment from it when that segment continues rank j's last one.
              The last rank filters after round world - 2.
    backward, round j = world - 1 .. 1:  rank j recomputes its piece (under the forward's autocast), runs its
              backward (the gradient of its end state, received in round j + 1, added to its own) and broadcasts the
              gradient of the state it started from. Rank 0 runs its backward after round 1.

Why it cannot deadlock: a call issues, on every rank, one all-gather of its shapes (where values are checked) and
the broadcasts of rounds 0 .. world - 2 in its forward, and the broadcasts of rounds world - 1 .. 1 in its
backward; which rank computes in a round changes nothing in that sequence, and no rank skips a round (a rank whose
first segment starts on it receives the state anyway and sends back a zero gradient). The broadcasts' sizes
depend only on the rows, heads, head dims and dtype, which the all-gather has shown equal on every rank. The
backward's rounds run inside one autograd node whose inputs and outputs are the same on every rank, so it takes the
same place among the other collectives of the backward pass (the attention's and convolutions' all-gathers,
FSDP's reduce-scatters) on every rank, as theirs do; nothing is sent point to point, so no rank waits for a peer
that took another path. ``reset=True`` is the gated delta rule, affine in the state: it goes through
:func:`~linmem.distributed.sequence.sp_linear_recurrence` (one all-gather, the pieces in parallel).

Cost: the pieces are filtered one after another, so the filter's time is that of one process over the whole
sequence (``world`` pieces in sequence) plus ``world - 1`` broadcasts of ``rows * H * K * (K + V)`` floats each
way; the backward recomputes each piece's forward before its backward (the forward keeps only the inputs, as
activation checkpointing would). The activations' memory is divided over the ranks.

Example (on every rank of a sequence-parallel group, each with its piece of T tokens)::

    o, var, (M, P) = sp_bayes_filter(q, k, v, group=sp_group, log_decay=g, obs_noise=r, output_final_state=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..ops import bayes_filter, parallel
from ..ops.bayes.delta import delta_filter
from ..ops.bayes.inputs import FilterInputs, State, compute_dtype, validate
from ..ops.checks import values_checkable
from .collectives import group_rank, group_size
from .sequence import PieceLayout, sp_linear_recurrence

__all__ = ["sp_bayes_filter"]

OP = "sp_bayes_filter"
#: what every rank of a call must agree on, in the order of the all-gathered signature
SIGNATURE = ("rows", "heads", "key dim", "value dim", "state bits", "autograd recording", "packed", "reset")


@dataclass(frozen=True)
class _Relay:
    """One call's relay: the group, this rank's place in it, and the local filter's options."""

    group: ProcessGroup
    rank: int
    world: int
    layout: PieceLayout
    rows: int  # rows of the state that cross a rank boundary: the batch rows, or the packed row's last segment
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype  # the state's: fp32, fp64 for fp64 inputs
    device: torch.device
    options: dict[str, Any]  # the local filter's prior, scale, cu_seqlens, return_variance, backend

    def filter(self, tensors: tuple, start: Optional[State]):
        """The local piece filtered from ``start`` (None: the prior), with its final states."""
        q, k, v, g, r, w = tensors
        with parallel.local_ops():
            return bayes_filter(q, k, v, log_decay=g, obs_noise=r, process_noise=w, initial_state=start,
                                output_final_state=True, **self.options)

    def start(self, M0: Optional[torch.Tensor], P0: Optional[torch.Tensor], carry: Optional[State]) -> Optional[State]:
        """The local filter's initial state: ``carry`` (the previous rank's end state, or None) for the first
        segment(s), the given state or the prior for the others."""
        if carry is None:
            return None if M0 is None else (M0, P0)
        if not self.layout.varlen:  # every row continues
            return carry
        n, H, K, V = self.layout.num_segments - 1, self.heads, self.key_dim, self.value_dim
        if M0 is None:
            eye = torch.eye(K, dtype=self.dtype, device=self.device)
            rest = (torch.zeros(n, H, K, V, dtype=self.dtype, device=self.device),
                    self.options["prior"] * eye.expand(n, H, K, K))
        else:
            rest = (M0[1:].to(self.dtype), P0[1:].to(self.dtype))
        return torch.cat([carry[0], rest[0]]), torch.cat([carry[1], rest[1]])

    def round(self, src: int, state: Optional[State]) -> State:
        """Round ``src``: rank ``src``'s ``state`` (M-like ``[rows, H, K, V]``, P-like ``[rows, H, K, K]``) reaches
        every rank, which returns it. Every rank calls it, with ``state`` on rank ``src`` only."""
        H, K, V, rows = self.heads, self.key_dim, self.value_dim, self.rows
        split = rows * H * K * V
        if self.rank == src:
            payload = torch.cat([state[0].reshape(-1), state[1].reshape(-1)]).to(self.dtype).contiguous()
        else:
            payload = torch.empty(split + rows * H * K * K, dtype=self.dtype, device=self.device)
        dist.broadcast(payload, group=self.group, group_src=src)
        return payload[:split].view(rows, H, K, V), payload[split:].view(rows, H, K, K)

    def gradients(
        self, saved: tuple, carry: Optional[State], needs: tuple[bool, ...], grads: tuple, end_grad: Optional[State],
        autocast: tuple[bool, torch.dtype],
    ) -> tuple[list[Optional[torch.Tensor]], State]:
        """The local piece recomputed under autograd and differentiated: the gradients of (q, k, v, log_decay,
        obs_noise, process_noise, M0, P0) where ``needs`` says, and that of the carried start (zero without one).
        ``grads``: those of (o, var, M, P); ``end_grad``: the next rank's gradient of the last rows' end state;
        ``autocast``: the forward's autocast (enabled, dtype), under which the piece is recomputed as it ran."""
        enabled, dtype = autocast
        with torch.enable_grad(), torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
            leaves = [None if x is None else x.detach().requires_grad_(need) for x, need in zip(saved, needs)]
            carried = None if carry is None else tuple(x.detach().requires_grad_() for x in carry)
            o, var, (M, P) = self.filter(tuple(leaves[:6]), self.start(leaves[6], leaves[7], carried))
        do, dvar, dM, dP = grads
        if end_grad is not None:  # the end state also started the next rank's piece
            dM = torch.zeros_like(M) if dM is None else dM.clone()
            dP = torch.zeros_like(P) if dP is None else dP.clone()
            dM[-self.rows:] += end_grad[0]
            dP[-self.rows:] += end_grad[1]
        pairs = [(out, g) for out, g in zip((o, var, M, P), (do, dvar, dM, dP))
                 if out is not None and g is not None and out.requires_grad]
        wrt = [x for x in (*leaves, *(carried or ())) if x is not None and x.requires_grad]
        found = iter(torch.autograd.grad([out for out, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                     if pairs and wrt else [None] * len(wrt))
        result = [next(found) if x is not None and x.requires_grad else None for x in leaves]
        shapes = ((self.rows, self.heads, self.key_dim, self.value_dim), (self.rows, self.heads, self.key_dim,
                                                                          self.key_dim))
        start_grad = tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes)
        if carried is not None:
            start_grad = tuple(g if g is not None else z for g, z in zip((next(found), next(found)), start_grad))
        return result, start_grad


class _RelayFilter(torch.autograd.Function):
    """(q, k, v, log_decay, obs_noise, process_noise, M0, P0) -> (o, var, M, P) of this rank's piece, every rank's
    piece filtered from the state the previous rank ends with; one node per call on every rank."""

    @staticmethod
    def forward(ctx, relay: _Relay, q, k, v, g, r, w, M0, P0):  # noqa: D102
        tensors = (q, k, v, g, r, w)
        carry = result = None
        for j in range(relay.world - 1):  # round j: rank j filters its piece and passes its end state on
            end = None
            if relay.rank == j:
                result = relay.filter(tensors, relay.start(M0, P0, carry))
                end = tuple(x[-relay.rows:] for x in result[2])
            got = relay.round(j, end)
            if relay.rank == j + 1 and relay.layout.continues:
                carry = got
        if relay.rank == relay.world - 1:
            result = relay.filter(tensors, relay.start(M0, P0, carry))
        o, var, (M, P) = result
        ctx.relay = relay
        device = relay.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(*tensors, M0, P0, *(carry if carry is not None else (None, None)))
        ctx.set_materialize_grads(False)  # outputs nobody used (the variance, the final state) have no gradient
        return o, var, M, P

    @staticmethod
    def backward(ctx, do, dvar, dM, dP):  # noqa: D102
        relay = ctx.relay
        *saved, Mc, Pc = ctx.saved_tensors
        carry = None if Mc is None else (Mc, Pc)
        needs, grads = ctx.needs_input_grad[1:], (do, dvar, dM, dP)
        end_grad = result = None
        for j in range(relay.world - 1, 0, -1):  # round j: rank j's start-state gradient goes back to rank j - 1
            start_grad = None
            if relay.rank == j:
                result, start_grad = relay.gradients(tuple(saved), carry, needs, grads, end_grad, ctx.autocast)
            got = relay.round(j, start_grad)
            if relay.rank == j - 1:
                end_grad = got
        if relay.rank == 0:
            result, _ = relay.gradients(tuple(saved), carry, needs, grads, end_grad, ctx.autocast)
        return (None, *result)


def _agree(relay: _Relay, inputs: FilterInputs) -> None:
    """Refuse, on every rank at once, a call whose ranks disagree on what decides the collectives' order and sizes
    (one all-gather of a few integers)."""
    tensors = (inputs.q, inputs.k, inputs.v, inputs.log_decay, inputs.obs_noise, inputs.process_noise,
               *(inputs.initial_state or ()))
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    mine = torch.tensor([relay.rows, relay.heads, relay.key_dim, relay.value_dim, torch.finfo(relay.dtype).bits,
                         recording, relay.layout.varlen, inputs.reset], dtype=torch.int64, device=relay.device)
    table = mine.new_empty(relay.world * len(SIGNATURE))
    dist.all_gather_into_tensor(table, mine, group=relay.group)
    rows = table.view(relay.world, len(SIGNATURE)).tolist()
    differ = [name for i, name in enumerate(SIGNATURE) if len({row[i] for row in rows}) > 1]
    if differ:
        per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{name} {row[SIGNATURE.index(name)]}" for name in differ)
                             for r, row in enumerate(rows))
        raise ValueError(
            f"{OP}: the ranks of the group disagree on {', '.join(differ)} ({per_rank}); every rank must run the "
            "same layer on a piece of the same shapes and dtype, with autograd recording on all ranks or none: the "
            "filter's collectives are matched by their order and size"
        )


def sp_bayes_filter(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup,
    log_decay: torch.Tensor,
    obs_noise: torch.Tensor,
    process_noise: Optional[torch.Tensor] = None,
    prior: float = 1.0,
    reset: bool = False,
    scale: Optional[float] = None,
    initial_state: Optional[State] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    return_variance: bool = False,
    backend: str = "auto",
    prefix_length: Optional[int] = None,
    layout: Optional[PieceLayout] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[State]]:
    """:func:`linmem.ops.bayes_filter` of sequences split along time over the ranks of ``group``.

    Every rank calls it with its own contiguous piece (all pieces of one length ``T``); the result on each rank is
    its piece of what one process computes on the whole sequences: outputs, variances, final states and every
    gradient. The pieces are filtered one after another (see the module docstring for the order and the cost).

    Args:
        q, k, v, log_decay, obs_noise, process_noise, prior, reset, scale, return_variance, backend: as in
            ``bayes_filter``, this rank's piece: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, the gates ``[B, T, H]``.
        group: the sequence-parallel process group; pieces follow the ranks' order in it.
        initial_state: ``(M [N, H, K, V], P [N, H, K, K])`` for the N local sequences; a row is used only for a
            sequence that starts on this rank (rank 0 without ``cu_seqlens``).
        output_final_state: also return ``(M, P)``, the true state at the end of each local segment (the
            sequences' final states where they end on this rank).
        cu_seqlens: ``[N + 1]`` local boundaries of the packed segments (B == 1).
        prefix_length: with ``cu_seqlens``, the tokens of this rank's first sequence that earlier ranks hold (0
            when it starts here). Without ``cu_seqlens`` every rank after the first continues every row.
        layout: the :class:`PieceLayout` when the caller already has it (saves reading ``cu_seqlens``).

    Returns:
        ``(o [B, T, H, V], var [B, T, H] or None, (M, P) or None)`` as ``bayes_filter``.

    Where values are checked (CPU tensors, or debug checks on), ranks that disagree on the rows, heads, head dims,
    dtype, packing, ``reset`` or on whether autograd records the call are refused by name on every rank.

    Example (on every rank of a sequence-parallel group, each with its piece of T tokens):
        >>> o, var, (M, P) = sp_bayes_filter(q, k, v, group=sp_group, log_decay=g,  # doctest: +SKIP
        ...                                  obs_noise=r, output_final_state=True)
    """
    if group is None:
        raise TypeError(f"{OP}: `group` must be a process group (the sequence-parallel ranks), got None")
    inputs = validate(q, k, v, log_decay=log_decay, obs_noise=obs_noise, process_noise=process_noise, prior=prior,
                      reset=reset, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens, return_variance=return_variance)
    B, T, H, K = q.shape
    if layout is None:
        layout = PieceLayout.of(group, T, B, cu_seqlens, prefix_length, OP)
    relay = _Relay(
        group=group, rank=group_rank(group), world=group_size(group), layout=layout,
        rows=1 if layout.varlen else B, heads=H, key_dim=K, value_dim=v.shape[-1], dtype=compute_dtype(q),
        device=q.device, options=dict(prior=inputs.prior, scale=inputs.scale, cu_seqlens=cu_seqlens,
                                      return_variance=return_variance, backend=backend),
    )
    if values_checkable(q):
        _agree(relay, inputs)
    if inputs.reset:  # the gated delta rule: affine in the state, LASP-2 combines the pieces
        return delta_filter(inputs, recurrence=partial(sp_linear_recurrence, group=group, layout=layout))
    M0, P0 = inputs.initial_state if inputs.initial_state is not None else (None, None)
    o, var, M, P = _RelayFilter.apply(relay, q, k, v, log_decay, obs_noise, process_noise, M0, P0)
    return o, var, ((M, P) if output_final_state else None)
