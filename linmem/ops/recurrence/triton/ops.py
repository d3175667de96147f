"""The Triton backend as PyTorch custom ops (``torch.library``), so models compile without graph breaks.

``linmem::recurrence_chunk_fwd`` / ``linmem::recurrence_chunk_bwd`` wrap the chunk kernels
(the forward also returns what the backward needs, as extra outputs), joined by
``register_autograd``; ``linmem::recurrence_step`` is the in-place decode kernel.

Outside ``torch.compile`` the same launchers run without the custom ops' dispatch: the chunk
kernels through a plain ``torch.autograd.Function`` (:class:`ChunkRecurrence`), the decode kernel
directly. The dispatch costs host time that small shapes do not hide behind the GPU (about a third of a
forward+backward's host time at 8 x 2048 on an H200 host); the kernels, and so the results, are the same.
"""

from typing import Optional

import torch
from torch import Tensor

from ..inputs import RecurrenceInputs
from . import configs, pipeline, recurrent
from .switches import Decay

#: at most this many tokens without autograd run through the fused recurrent kernel
RECURRENT_MAX_T = 16


def _or_empty(x: Optional[Tensor], like: Tensor) -> Tensor:
    return x if x is not None else like.new_empty(0)


def _or_none(x: Tensor) -> Optional[Tensor]:
    return x if x.numel() else None


def _saved_or_empty(saved: tuple, like: Tensor) -> tuple:
    """The forward's saved tensors ``(G, hs, A, d, Tt, Wt, Qg, Kg)`` with absent ones (not computed, or recomputed
    by the backward: ``pipeline.kept``) empty (a custom op returns tensors only)."""
    return tuple(_or_empty(x, like) for x in saved)


@torch.library.custom_op("linmem::recurrence_chunk_fwd", mutates_args=())
def chunk_fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor],
                 bonus: Optional[Tensor], h0: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
                 decay: int, output_final: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (o, final state, and for the backward: G, hs, A, d, Tt, Wt, Qg, Kg); absent ones are empty."""
    o, hN, saved = pipeline.chunk_forward(q, k, v, g, beta, bonus, h0, cu_seqlens, scale, decay, output_final)
    return (o, _or_empty(hN, q), *_saved_or_empty(saved, q))


@chunk_fwd_op.register_fake
def _(q, k, v, g, beta, bonus, h0, cu_seqlens, scale, decay, output_final):
    s = configs.shapes_of(q, v, cu_seqlens)
    hN = q.new_empty(s.N, s.H, s.K, s.V, dtype=torch.float32) if output_final else q.new_empty(0)
    saved = pipeline.kept(pipeline.saved_buffers(q, v, g, beta is not None, cu_seqlens))
    return (torch.empty_like(v), hN, *_saved_or_empty(saved, q))


@torch.library.custom_op("linmem::recurrence_chunk_bwd", mutates_args=())
def chunk_bwd_op(q: Tensor, k: Tensor, v: Tensor, beta: Optional[Tensor], bonus: Optional[Tensor],
                 h0: Optional[Tensor], cu_seqlens: Optional[Tensor], G: Tensor, hs: Tensor, A: Tensor, d: Tensor,
                 Tt: Tensor, Wt: Tensor, Qg: Tensor, Kg: Tensor, do: Tensor, dhN: Optional[Tensor], scale: float,
                 decay: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dg, dbeta, dbonus, d initial state); absent ones are empty. The log decay g is not an input:
    the backward reads its cumulative sums G (empty without a decay), of its shape."""
    saved = (_or_none(G), _or_none(hs), A, _or_none(d), _or_none(Tt), _or_none(Wt), _or_none(Qg), _or_none(Kg))
    grads = pipeline.chunk_backward(q, k, v, beta, bonus, h0, cu_seqlens, saved, do, dhN, scale, decay)
    return tuple(_or_empty(x, q) for x in grads)


@chunk_bwd_op.register_fake
def _(q, k, v, beta, bonus, h0, cu_seqlens, G, hs, A, d, Tt, Wt, Qg, Kg, do, dhN, scale, decay):
    f32 = torch.float32
    empty = q.new_empty(0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(G.shape, dtype=f32) if decay != Decay.NONE else empty,
            q.new_empty(beta.shape, dtype=f32) if beta is not None else empty,
            q.new_empty(bonus.shape, dtype=f32) if bonus is not None else empty,
            q.new_empty(h0.shape, dtype=f32) if h0 is not None else empty)


def _setup_context(ctx, inputs, output):
    q, k, v, _, beta, bonus, h0, cu_seqlens, scale, decay, _ = inputs  # g not kept: the backward reads G
    saved = output[2:]
    ctx.save_for_backward(q, k, v, beta, bonus, h0, cu_seqlens, *saved)
    ctx.scale, ctx.decay = scale, decay
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # an unused output (the final state, say) has no gradient


def _gradients(ctx, do, dhN, chunk_bwd) -> tuple:
    """The inputs' gradients from the saved tensors (absent ones None or empty, as ``chunk_bwd`` takes
    them) and the outputs' gradients, through ``chunk_bwd`` (the custom op or the launcher). The log decay g was
    not saved; its gradient dg is fp32, as g is."""
    q, k, v, beta, bonus, h0, cu_seqlens, *saved = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if dhN is not None and dhN.numel() == 0:  # the final state was not returned
        dhN = None
    dq, dk, dv, dg, dbeta, du, dh0 = chunk_bwd(q, k, v, beta, bonus, h0, cu_seqlens, *saved, do, dhN, ctx.scale,
                                               ctx.decay)
    # (a no-op ``.to`` costs microseconds of host time: the fp32 gradients of fp32 inputs skip it)
    cast = lambda grad, x: None if x is None else grad if grad.dtype == x.dtype else grad.to(x.dtype)  # noqa: E731
    dg = dg if ctx.decay != Decay.NONE else None
    return dq, dk, dv, dg, cast(dbeta, beta), cast(du, bonus), cast(dh0, h0), None, None, None, None


def _backward(ctx, do, dhN, *_):
    return _gradients(ctx, do, dhN, chunk_bwd_op)


chunk_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _launch_backward(q, k, v, beta, bonus, h0, cu_seqlens, G, hs, A, d, Tt, Wt, Qg, Kg, do, dhN, scale, decay):
    return pipeline.chunk_backward(q, k, v, beta, bonus, h0, cu_seqlens, (G, hs, A, d, Tt, Wt, Qg, Kg), do, dhN,
                                   scale, decay)


class ChunkRecurrence(torch.autograd.Function):
    """The chunk kernels under autograd without the custom ops (eager mode): same launchers, same saved
    tensors (absent ones None; the log decay g not kept, as there), same gradients."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, bonus, h0, cu_seqlens, scale, decay, output_final):
        o, hN, saved = pipeline.chunk_forward(q, k, v, g, beta, bonus, h0, cu_seqlens, scale, decay, output_final)
        ctx.save_for_backward(q, k, v, beta, bonus, h0, cu_seqlens, *saved)
        ctx.scale, ctx.decay = scale, decay
        ctx.set_materialize_grads(False)  # an unused output (the final state, say) has no gradient
        return o, hN

    @staticmethod
    def backward(ctx, do, dhN):
        return _gradients(ctx, do, dhN, _launch_backward)


@torch.library.custom_op("linmem::recurrence_step", mutates_args=("state",))
def step_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor], bonus: Optional[Tensor],
            state: Tensor, scale: float, decay: int) -> Tensor:
    """Tokens [N, T, H, *] against ``state`` [N, H, K, V] fp32, updated in place; -> o [N, T, H, V]."""
    return recurrent.recurrent_step(q, k, v, g, beta, bonus, state, scale, decay)


@step_op.register_fake
def _(q, k, v, g, beta, bonus, state, scale, decay):
    return torch.empty_like(v)


def _recurrent_step(q, k, v, g, beta, bonus, state, scale: float, decay: int) -> Tensor:
    """The decode kernel: the custom op under torch.compile, the launcher itself in eager mode."""
    step = step_op if torch.compiler.is_compiling() else recurrent.recurrent_step
    return step(q, k, v, g, beta, bonus, state, scale, decay)


def _per_token_decay(inputs: RecurrenceInputs) -> tuple[Optional[Tensor], int]:
    """log_decay as fp32 [B, T, H] or [B, T, H, K] (a constant [H] is expanded) and its kernel code."""
    g = inputs.log_decay
    if inputs.decay_kind == "none":
        return None, Decay.NONE
    if inputs.decay_kind == "constant":
        B, T, H, _ = inputs.q.shape
        g = g[None, None, :].expand(B, T, H)
    return g.float().contiguous(), Decay.of(inputs.decay_kind)


def _step_decay(inputs: RecurrenceInputs) -> tuple[Optional[Tensor], int]:
    """The recurrent kernel's gate and its code: a constant [H] as given (``Decay.CONSTANT``), else as
    :func:`_per_token_decay`."""
    if inputs.decay_kind == "constant":
        return inputs.log_decay.float().contiguous(), Decay.CONSTANT
    return _per_token_decay(inputs)


def _contiguous(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.contiguous()


def triton_recurrence(inputs: RecurrenceInputs) -> tuple[Tensor, Optional[Tensor]]:
    """The "triton" backend of ``linear_recurrence`` for inputs its refusal accepted."""
    q, k, v, beta, bonus = map(_contiguous, (inputs.q, inputs.k, inputs.v, inputs.beta, inputs.bonus))
    h0 = None if inputs.initial_state is None else inputs.initial_state.float().contiguous()
    T = q.shape[1]
    if inputs.cu_seqlens is None and T <= RECURRENT_MAX_T and not inputs.records_grad:
        B, _, H, K = q.shape
        state = h0.clone() if h0 is not None else q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
        g, decay = _step_decay(inputs)
        o = _recurrent_step(q, k, v, g, beta, bonus, state, inputs.scale, decay)
        return o, (state if inputs.output_final_state else None)
    g, decay = _per_token_decay(inputs)
    args = (q, k, v, g, beta, bonus, h0, _contiguous(inputs.cu_seqlens), inputs.scale, decay, inputs.output_final_state)
    o, hN = chunk_fwd_op(*args)[:2] if torch.compiler.is_compiling() else ChunkRecurrence.apply(*args)
    return o, (hN if inputs.output_final_state else None)


def triton_step(inputs: RecurrenceInputs, state: Tensor) -> Tensor:
    """One decoding step (inputs with a time axis of 1) against ``state``, updated in place: -> o [B, H, V]."""
    g, decay = _step_decay(inputs)
    q, k, v, beta, bonus = map(_contiguous, (inputs.q, inputs.k, inputs.v, inputs.beta, inputs.bonus))
    return _recurrent_step(q, k, v, g, beta, bonus, state, inputs.scale, decay)[:, 0]
