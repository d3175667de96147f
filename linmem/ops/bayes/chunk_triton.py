"""Backend "chunk_triton" of :func:`linmem.ops.bayes_filter`: the exact chunked form (:mod:`.chunk`) as fused
Triton kernels, forward (:mod:`.chunk_fwd`) and backward (:mod:`.chunk_bwd`, the maths in :mod:`.chunk_grad`).

Shapes only, no host synchronisation. ``reset=False``; K, V <= 128; fp16, bf16 and fp32 inputs (fp32
arithmetic); fixed length or ``cu_seqlens``; an initial state, process noise and the variance. Under
``torch.compile`` the kernels run as the custom ops ``linmem::bayes_chunk_fwd`` / ``_bwd`` (:mod:`.ops`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .chunk_bwd import chunk_backward, chunk_cotangents
from .chunk_fwd import ChunkLaunch, chunk_forward
from .inputs import FilterInputs, State


def _gates(inputs: FilterInputs) -> Tensor:
    """(log decay, observation noise, process noise or 0) as one [B, T, H, 3] fp32 tensor."""
    g, r = inputs.log_decay.float(), inputs.obs_noise.float()
    w = torch.zeros_like(g) if inputs.process_noise is None else inputs.process_noise.float()
    return torch.stack([g, r, w], -1)


class ChunkFilterFunction(torch.autograd.Function):
    """The kernels under autograd: (q, k, v, gates, M0, P0) -> (o, var, M_T, P_T)."""

    @staticmethod
    def forward(ctx, q, k, v, gates, M0, P0, cu_seqlens, scale, prior, variance, launch):
        o, var, MT, PT, states, factors = chunk_forward(q, k, v, gates, M0, P0, cu_seqlens, scale, prior, variance,
                                                        True, launch)
        ctx.save_for_backward(q, k, v, gates, states, factors, cu_seqlens)
        ctx.scale, ctx.variance, ctx.launch, ctx.has_init = scale, variance, launch, M0 is not None
        ctx.set_materialize_grads(False)  # an unused output (the final state, say) has no gradient
        ctx.mark_non_differentiable(*([] if variance else [var]))
        return o, var, MT, PT

    @staticmethod
    def backward(ctx, do, dvar, dMT, dPT):
        q, k, v, gates, states, factors, cu_seqlens = ctx.saved_tensors
        do, dvar, dMT, dPT = chunk_cotangents(q, v, cu_seqlens, ctx.variance, do, dvar, dMT, dPT)
        dq, dk, dv, dgates, dM0, dP0 = chunk_backward(q, k, v, gates, states, factors, cu_seqlens, ctx.scale, do, dvar,
                                                      dMT, dPT, ctx.launch)
        init = (dM0, dP0) if ctx.has_init else (None, None)
        return dq, dk, dv, dgates, *init, None, None, None, None, None


def chunk_triton_filter(inputs: FilterInputs, launch: Optional[ChunkLaunch] = None
                        ) -> tuple[Tensor, Optional[Tensor], Optional[State]]:
    """The "chunk_triton" backend (inputs already validated and served: ``bayes_filter``'s refusals): the contract
    of :func:`.reference.reference_filter`, var and state fp32. ``launch``: chunk size and warps (default
    :meth:`ChunkLaunch.default`)."""
    q, k, v = (x.contiguous() for x in (inputs.q, inputs.k, inputs.v))
    launch = launch or ChunkLaunch.default(q.shape[-1], v.shape[-1])
    M0, P0 = (None, None) if inputs.initial_state is None else (x.float().contiguous() for x in inputs.initial_state)
    cu = None if inputs.cu_seqlens is None else inputs.cu_seqlens.contiguous()
    args = (q, k, v, _gates(inputs), M0, P0, cu, inputs.scale, inputs.prior, inputs.return_variance)
    if torch.compiler.is_compiling():
        from .ops import chunk_fwd_op

        o, var, MT, PT, _, _ = chunk_fwd_op(*args, inputs.records_grad, launch.chunk, launch.num_warps)
    elif inputs.records_grad:
        o, var, MT, PT = ChunkFilterFunction.apply(*args, launch)
    else:
        o, var, MT, PT, _, _ = chunk_forward(*args, False, launch)
    return o, (var if inputs.return_variance else None), ((MT, PT) if inputs.output_final_state else None)
