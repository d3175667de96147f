"""The unified linear recurrence, one token at a time: the ground truth.

Per step t, with the state S: [K, V] of one head::

    S' = diag(exp(g_t)) S_{t-1}                   decay
    S' = S' + a_t^T (b_t S_{t-1})                 low-rank term (if a, b)
    S_t = S' + beta_t k_t^T (v_t - k_t S')        delta write (if beta)
    S_t = S' + k_t^T v_t                          additive write (otherwise)
    o_t = scale * q_t S_t

With a bonus u (RWKV-6) the read-out comes first, from the previous state:
``o_t = scale * (q_t S_{t-1} + (q_t . (u * k_t)) v_t)``.

Everything accumulates in fp32 (fp64 for fp64 inputs). This file is the oracle of
every faster backend; keep it short and literal.
"""

from __future__ import annotations

from typing import Optional

import torch

from .inputs import RecurrenceInputs, compute_dtype


def read(q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """q S for every head: q [N, H, K], S [N, H, K, V] -> [N, H, V]."""
    return torch.einsum("nhk,nhkv->nhv", q, S)


def outer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k^T v for every head: k [N, H, K], v [N, H, V] -> [N, H, K, V]."""
    return k[..., :, None] * v[..., None, :]


def recurrence_step(
    S: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    bonus: Optional[torch.Tensor] = None,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the recurrence for N sequences; returns (o [N, H, V], S_t [N, H, K, V]).

    S: [N, H, K, V]; q, k, a, b: [N, H, K]; v: [N, H, V]; beta: [N, H]; bonus: [H, K];
    log_decay: broadcastable to S ([N, H, 1, 1], [N, H, K, 1] or [N, H, K, V]).
    All in the accumulation dtype.
    """
    if bonus is not None:  # RWKV-6: read the previous state, the current token enters with weight u
        o = scale * (read(q, S) + (q * bonus * k).sum(-1, keepdim=True) * v)
    S_prev = S
    if log_decay is not None:
        S = torch.exp(log_decay) * S
    if a is not None:
        S = S + outer(a, read(b, S_prev))
    if beta is not None:
        S = S + beta[..., None, None] * outer(k, v - read(k, S))
    else:
        S = S + outer(k, v)
    if bonus is None:
        o = scale * read(q, S)
    return o, S


def per_step_decay(log_decay: Optional[torch.Tensor], kind: str, B: int, T: int) -> Optional[torch.Tensor]:
    """Reshape log_decay to [B, T, H, K or 1, V or 1] so that step t broadcasts onto S."""
    if kind == "none":
        return None
    if kind == "constant":  # [H]
        return log_decay[None, None, :, None, None].expand(B, T, -1, 1, 1)
    if kind == "scalar":  # [B, T, H]
        return log_decay[..., None, None]
    if kind == "vector":  # [B, T, H, K]
        return log_decay[..., None]
    return log_decay  # full: [B, T, H, K, V]


def _scan(q, k, v, g, beta, bonus, a, b, scale, S):
    """Run the recurrence over T for a batch; every input already in the accumulation dtype."""
    outputs = []
    for t in range(q.shape[1]):
        o, S = recurrence_step(
            S, q[:, t], k[:, t], v[:, t],
            log_decay=None if g is None else g[:, t],
            beta=None if beta is None else beta[:, t],
            bonus=bonus,
            a=None if a is None else a[:, t],
            b=None if b is None else b[:, t],
            scale=scale,
        )
        outputs.append(o)
    o = torch.stack(outputs, dim=1) if outputs else q.new_zeros(q.shape[0], 0, q.shape[2], v.shape[-1])
    return o, S


def reference_recurrence(inputs: RecurrenceInputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-loop backend of :func:`linmem.ops.linear_recurrence` (inputs already validated)."""
    acc, out_dtype = compute_dtype(inputs.q), inputs.q.dtype
    B, T, H, K = inputs.q.shape
    V = inputs.v.shape[-1]
    cast = lambda t: None if t is None else t.to(acc)  # noqa: E731
    q, k, v, beta, bonus, a, b = map(cast, (inputs.q, inputs.k, inputs.v, inputs.beta, inputs.bonus, inputs.a,
                                            inputs.b))
    g = cast(per_step_decay(inputs.log_decay, inputs.decay_kind, B, T))
    scale, initial_state = inputs.scale, inputs.initial_state

    if inputs.cu_seqlens is None:
        S0 = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc)
        o, S = _scan(q, k, v, g, beta, bonus, a, b, scale, S0)
        return o.to(out_dtype), (S if inputs.output_final_state else None)

    # variable length: each sequence runs alone from its own initial state
    bounds = inputs.cu_seqlens.tolist()
    outputs, states = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = lambda t: None if t is None else t[:, start:end]  # noqa: E731
        S0 = q.new_zeros(1, H, K, V) if initial_state is None else initial_state[n : n + 1].to(acc)
        o, S = _scan(part(q), part(k), part(v), part(g), part(beta), bonus, part(a), part(b), scale, S0)
        outputs.append(o)
        states.append(S)
    o = torch.cat(outputs, dim=1)
    return o.to(out_dtype), (torch.cat(states, dim=0) if inputs.output_final_state else None)
