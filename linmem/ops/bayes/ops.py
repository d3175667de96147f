"""The Bayesian filter's Triton kernels as PyTorch custom ops (``torch.library``), so that a model using
the filter compiles as one graph.

``linmem::bayes_filter_fwd`` runs the forward kernel and also returns what the backward needs
(``u, s, e, q^T P q``, empty when no gradient is recorded); ``linmem::bayes_filter_bwd`` runs the three
backward passes; ``register_autograd`` joins them. ``linmem::bayes_filter_step`` is the decoding step,
updating the state ``(M, P)`` in place. ``linmem::bayes_chunk_fwd`` and ``linmem::bayes_chunk_bwd`` are the
chunked kernels' pair (backend "chunk_triton"; the forward also returns the chunk starts and inverse factors it
saves for the backward). Every op has a fake implementation (shapes and dtypes only) for tracing. Absent optional
outputs are empty tensors, since a custom op returns tensors only.

Outside ``torch.compile`` the same launchers run without the custom ops' dispatch
(:class:`~linmem.ops.bayes.launch.BayesFilterFunction`, :func:`~linmem.ops.bayes.launch.filter_forward`,
:class:`~linmem.ops.bayes.chunk_triton.ChunkFilterFunction`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .chunk_bwd import chunk_backward, chunk_cotangents
from .chunk_fwd import ChunkLaunch, chunk_forward, saved_sizes
from .launch import Launch, Saved, filter_backward, filter_forward

F32 = torch.float32


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0, dtype=F32)


def _num_sequences(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op("linmem::bayes_filter_fwd", mutates_args=())
def filter_fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, r: Tensor, w: Optional[Tensor], M0: Optional[Tensor],
                  P0: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, prior: float, variance: bool,
                  save: bool, block_v: int, num_warps: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (o, var, M_T, P_T, and with ``save`` u, s, e, q^T P q for the backward); absent ones are empty."""
    o, var, MT, PT, saved = filter_forward(q, k, v, g, r, w, M0, P0, cu_seqlens, scale, prior, variance, save,
                                           Launch(block_v, num_warps))
    if saved is None:
        return o, var, MT, PT, _empty(q), _empty(q), _empty(q), _empty(q)
    qpq = saved.QPQ if variance else _empty(q)  # without the variance the launcher lends `var` (empty) here
    return o, var, MT, PT, saved.U, saved.S, saved.E, qpq


@filter_fwd_op.register_fake
def _(q, k, v, g, r, w, M0, P0, cu_seqlens, scale, prior, variance, save, block_v, num_warps):
    B, T, H, K = q.shape
    V, N = v.shape[-1], _num_sequences(q, cu_seqlens)
    per_token = lambda *shape: q.new_empty(B, T, H, *shape, dtype=F32)  # noqa: E731
    var = per_token() if variance else _empty(q)
    saved = (per_token(K), per_token(), per_token(V), per_token() if variance else _empty(q)) if save else \
        tuple(_empty(q) for _ in range(4))
    return (torch.empty_like(v), var, q.new_empty(N, H, K, V, dtype=F32), q.new_empty(N, H, K, K, dtype=F32),
            *saved)


@torch.library.custom_op("linmem::bayes_filter_bwd", mutates_args=())
def filter_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, r: Tensor, w: Optional[Tensor], M0: Optional[Tensor],
                  P0: Optional[Tensor], cu_seqlens: Optional[Tensor], U: Tensor, S: Tensor, E: Tensor, QPQ: Tensor,
                  PT: Tensor, do: Tensor, dvar: Optional[Tensor], dMT: Optional[Tensor], dPT: Optional[Tensor],
                  scale: float, prior: float, block_v: int, num_warps: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dg, dr, dw (empty without w), dM0, dP0)."""
    saved = Saved(U, S, E, QPQ if dvar is not None else _empty(q))
    dq, dk, dv, dg, dr, dw, dM0, dP0 = filter_backward(q, k, v, g, r, w, M0, P0, cu_seqlens, scale, prior, saved, PT,
                                                       do, dvar, dMT, dPT, Launch(block_v, num_warps))
    return dq, dk, dv, dg, dr, (dw if dw is not None else _empty(q)), dM0, dP0


@filter_bwd_op.register_fake
def _(q, k, v, g, r, w, M0, P0, cu_seqlens, U, S, E, QPQ, PT, do, dvar, dMT, dPT, scale, prior, block_v, num_warps):
    B, T, H, K = q.shape
    V, N = v.shape[-1], _num_sequences(q, cu_seqlens)
    gate = lambda: q.new_empty(B, T, H, dtype=F32)  # noqa: E731
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), gate(), gate(),
            gate() if w is not None else _empty(q), q.new_empty(N, H, K, V, dtype=F32),
            q.new_empty(N, H, K, K, dtype=F32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, r, w, M0, P0, cu_seqlens, scale, prior, variance, _, block_v, num_warps = inputs
    o, var, MT, PT, U, S, E, QPQ = output
    ctx.save_for_backward(q, k, v, g, r, w, M0, P0, cu_seqlens, PT, U, S, E, QPQ)
    ctx.scale, ctx.prior, ctx.variance, ctx.launch = scale, prior, variance, (block_v, num_warps)
    ctx.mark_non_differentiable(U, S, E, QPQ, *([] if variance else [var]))
    ctx.set_materialize_grads(False)  # an unused output (the final state, say) has no gradient


def _backward(ctx, do, dvar, dMT, dPT, *_):
    q, k, v, g, r, w, M0, P0, cu_seqlens, PT, U, S, E, QPQ = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.contiguous()
    if ctx.variance:
        dvar = torch.zeros_like(S) if dvar is None else dvar.contiguous()
    else:
        dvar = None
    dq, dk, dv, dg, dr, dw, dM0, dP0 = filter_bwd_op(
        q, k, v, g, r, w, M0, P0, cu_seqlens, U, S, E, QPQ, PT, do, dvar,
        None if dMT is None else dMT.contiguous(), None if dPT is None else dPT.contiguous(), ctx.scale, ctx.prior,
        *ctx.launch,
    )
    return (dq, dk, dv, dg, dr, dw if w is not None else None, dM0 if M0 is not None else None,
            dP0 if P0 is not None else None, None, None, None, None, None, None, None)


filter_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("linmem::bayes_filter_step", mutates_args=("M", "P"))
def step_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, r: Tensor, w: Optional[Tensor], M: Tensor, P: Tensor,
            scale: float, prior: float, variance: bool, block_v: int, num_warps: int) -> tuple[Tensor, Tensor]:
    """Tokens ``[N, 1, H, *]`` against the state ``M [N, H, K, V]``, ``P [N, H, K, K]`` (fp32, updated in place)
    -> (o [N, 1, H, V], var [N, 1, H] or empty)."""
    o, var, _, _, _ = filter_forward(q, k, v, g, r, w, M, P, None, scale, prior, variance, False,
                                     Launch(block_v, num_warps), MT=M, PT=P)
    return o, var


@step_op.register_fake
def _(q, k, v, g, r, w, M, P, scale, prior, variance, block_v, num_warps):
    return torch.empty_like(v), (q.new_empty(q.shape[:3], dtype=F32) if variance else _empty(q))


@torch.library.custom_op("linmem::bayes_chunk_fwd", mutates_args=())
def chunk_fwd_op(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, M0: Optional[Tensor], P0: Optional[Tensor],
                 cu_seqlens: Optional[Tensor], scale: float, prior: float, variance: bool, save: bool, chunk: int,
                 num_warps: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunked forward (backend "chunk_triton") -> (o, var, M_T, P_T, and with ``save`` the saved chunk starts and
    the inverse factors for the backward); absent ones are empty."""
    return chunk_forward(q, k, v, gates, M0, P0, cu_seqlens, scale, prior, variance, save,
                         ChunkLaunch(chunk, num_warps))


@chunk_fwd_op.register_fake
def _(q, k, v, gates, M0, P0, cu_seqlens, scale, prior, variance, save, chunk, num_warps):
    B, T, H, K = q.shape
    V, N = v.shape[-1], _num_sequences(q, cu_seqlens)
    var = q.new_empty(B, T, H, dtype=F32) if variance else _empty(q)
    saved = [q.new_empty(size, dtype=F32) if save else _empty(q)
             for size in saved_sizes(B, T, H, K, V, N, chunk, cu_seqlens is not None)]
    return (torch.empty_like(v), var, q.new_empty(N, H, K, V, dtype=F32), q.new_empty(N, H, K, K, dtype=F32),
            *saved)


@torch.library.custom_op("linmem::bayes_chunk_bwd", mutates_args=())
def chunk_bwd_op(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, states: Tensor, factors: Tensor,
                 cu_seqlens: Optional[Tensor], scale: float, do: Tensor, dvar: Optional[Tensor], dMT: Tensor,
                 dPT: Tensor, chunk: int, num_warps: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dgates, dM0, dP0) of the chunked forward."""
    return chunk_backward(q, k, v, gates, states, factors, cu_seqlens, scale, do, dvar, dMT, dPT,
                          ChunkLaunch(chunk, num_warps))


@chunk_bwd_op.register_fake
def _(q, k, v, gates, states, factors, cu_seqlens, scale, do, dvar, dMT, dPT, chunk, num_warps):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(gates),
            torch.empty_like(dMT), torch.empty_like(dPT))


def _chunk_setup_context(ctx, inputs, output):
    q, k, v, gates, M0, P0, cu_seqlens, scale, prior, variance, _, chunk, num_warps = inputs
    o, var, MT, PT, states, factors = output
    ctx.save_for_backward(q, k, v, gates, states, factors, cu_seqlens)
    ctx.scale, ctx.variance, ctx.launch, ctx.has_init = scale, variance, (chunk, num_warps), M0 is not None
    ctx.mark_non_differentiable(states, factors, *([] if variance else [var]))
    ctx.set_materialize_grads(False)  # an unused output (the final state, say) has no gradient


def _chunk_backward(ctx, do, dvar, dMT, dPT, *_):
    q, k, v, gates, states, factors, cu_seqlens = ctx.saved_tensors
    do, dvar, dMT, dPT = chunk_cotangents(q, v, cu_seqlens, ctx.variance, do, dvar, dMT, dPT)
    dq, dk, dv, dgates, dM0, dP0 = chunk_bwd_op(q, k, v, gates, states, factors, cu_seqlens, ctx.scale, do, dvar,
                                                dMT, dPT, *ctx.launch)
    init = (dM0, dP0) if ctx.has_init else (None, None)
    return (dq, dk, dv, dgates, *init, None, None, None, None, None, None, None)


chunk_fwd_op.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)
