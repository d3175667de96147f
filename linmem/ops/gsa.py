"""Gated Slot Attention (Zhang et al. 2024, "Gated Slot Attention for Efficient Linear-Time Sequence
Modeling", arXiv 2409.07146): two gated recurrences with a softmax over M memory slots between them.

Per head, with the slot gate alpha_t in (0, 1)^M and the write strength s_t = 1 - alpha_t::

    K~_t = K~_{t-1} diag(alpha_t) + k_t^T s_t            [K, M]   slot keys (decay over the slots)
    V~_t = diag(alpha_t) V~_{t-1} + s_t^T v_t            [M, V]   slot values
    o_t  = softmax(scale * q_t K~_t) V~_t                          read: attend over the M slots

Both are the unified recurrence (:func:`linmem.ops.linear_recurrence`): the first writes s_t as its
"value" with a decay that acts on the value (slot) axis, which makes each slot a recurrence of its
own with a scalar decay (the slots run as heads); the second reads with the slot weights as its
query and decays its key (slot) axis. Because every
slot forgets exactly what it is written (alpha + s = 1), each slot holds a weighted average of
keys and values, and the slot scores keep the scale of the attention logits q . k.
"""

from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange, repeat

from .recurrence import linear_recurrence, linear_recurrence_step

__all__ = ["gated_slot_attention", "gated_slot_attention_step", "reference_gated_slot_attention"]


def _check_gsa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                      time_axis: bool) -> None:
    rank = 4 if time_axis else 3
    lead = "[B, T, H, " if time_axis else "[B, H, "
    for name, x in (("q", q), ("k", k), ("v", v), ("log_decay", log_decay)):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            raise ValueError(f"gated_slot_attention: `{name}` must be a {rank}-D tensor {lead}...], "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    if q.shape != k.shape:
        raise ValueError(f"gated_slot_attention: `k` must have the shape of `q` {list(q.shape)}, got {list(k.shape)}")
    if v.shape[:-1] != q.shape[:-1] or log_decay.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"gated_slot_attention: `v` and `log_decay` must be {lead}D] with the leading axes of `q` "
                         f"{list(q.shape[:-1])}, got {list(v.shape)} and {list(log_decay.shape)}")


def gated_slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """Gated slot attention (see the module docstring) as two calls of the unified recurrence.

    :func:`reference_gated_slot_attention` is its token loop.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, one floating dtype.
        log_decay: ``[B, T, H, M]`` log slot gates log alpha (<= 0), fp32 recommended; a token whose
            log gate is 0 everywhere leaves both states untouched (s = 0), which is how padding is masked.
        scale: slot-score scale, default ``K ** -0.5``.
        initial_state: ``(slot_keys [N, H, K, M], slot_values [N, H, M, V])`` or None.
        output_final_state: also return the final ``(slot_keys, slot_values)`` (fp32).
        cu_seqlens: ``[N + 1]`` boundaries of N packed sequences (B == 1).
        backend: the backend of :func:`linmem.ops.linear_recurrence`.

    Returns:
        ``(o [B, T, H, V], final_state or None)``.

    Example:
        >>> q, k, v = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(2, 9, 2, 4))
        >>> o, (keys, values) = gated_slot_attention(q, k, v, g, output_final_state=True)
        >>> o.shape, keys.shape, values.shape
        (torch.Size([2, 9, 2, 8]), torch.Size([2, 2, 8, 4]), torch.Size([2, 2, 4, 8]))
    """
    _check_gsa_inputs(q, k, v, log_decay, time_axis=True)
    M = log_decay.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)  # gates and slot scores: fp32 (fp64 for fp64 inputs)
    log_decay = log_decay.to(acc)
    write = -torch.expm1(log_decay)  # s = 1 - alpha  [B, T, H, M]
    keys0, values0 = initial_state if initial_state is not None else (None, None)
    # The slot keys decay along their value (slot) axis: each slot m is a recurrence of its own with a
    # scalar decay and a one-dimensional value s[m], so the M slots become M heads per head.
    slots = lambda x: repeat(x, "b t h d -> b t (h m) d", m=M)  # noqa: E731
    if keys0 is not None:
        keys0 = rearrange(keys0, "n h k m -> n (h m) k")[..., None]
    slot_writes = rearrange(write.to(q.dtype), "b t h m -> b t (h m)")[..., None]
    scores, keys = linear_recurrence(slots(q), slots(k), slot_writes,
                                     log_decay=rearrange(log_decay, "b t h m -> b t (h m)"), scale=scale,
                                     initial_state=keys0, output_final_state=output_final_state,
                                     cu_seqlens=cu_seqlens, backend=backend)
    scores = rearrange(scores, "b t (h m) 1 -> b t h m", m=M)
    if keys is not None:
        keys = rearrange(keys[..., 0], "n (h m) k -> n h k m", m=M)
    weights = torch.softmax(scores.to(acc), dim=-1).to(v.dtype)
    o, values = linear_recurrence(weights, write.to(v.dtype), v, log_decay=log_decay, scale=1.0,
                                  initial_state=values0, output_final_state=output_final_state,
                                  cu_seqlens=cu_seqlens, backend=backend)
    return o, ((keys, values) if output_final_state else None)


def gated_slot_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    *,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding step of :func:`gated_slot_attention`: q, k ``[B, H, K]``, v ``[B, H, V]``, log_decay
    ``[B, H, M]``, state ``(slot_keys [B, H, K, M], slot_values [B, H, M, V])`` -> ``(o [B, H, V], state)``.

    Example:
        >>> state = (torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 4, 8))
        >>> o, state = gated_slot_attention_step(torch.randn(1, 2, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8),
        ...                                      torch.full((1, 2, 4), -0.1), state)
        >>> o.shape
        torch.Size([1, 2, 8])
    """
    _check_gsa_inputs(q, k, v, log_decay, time_axis=False)
    acc = torch.promote_types(q.dtype, torch.float32)
    log_decay = log_decay.to(acc)
    write = -torch.expm1(log_decay)
    keys, values = state
    slot_decay = log_decay[:, :, None, :].expand(*q.shape, log_decay.shape[-1])  # [B, H, K, M]
    scores, keys = linear_recurrence_step(q, k, write.to(q.dtype), keys, log_decay=slot_decay, scale=scale)
    weights = torch.softmax(scores.to(acc), dim=-1).to(v.dtype)
    o, values = linear_recurrence_step(weights, write.to(v.dtype), v, values, log_decay=log_decay, scale=1.0)
    return o, (keys, values)


def reference_gated_slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    *,
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The token loop of the module docstring's equations from zero states, in the inputs' dtype: the oracle of
    :func:`gated_slot_attention`. Shapes as there (no packing) -> ``(o [B, T, H, V], (slot_keys [B, H, K, M],
    slot_values [B, H, M, V]))``.

    Example:
        >>> q, k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 6)
        >>> o, (keys, values) = reference_gated_slot_attention(q, k, v, torch.full((1, 5, 2, 4), -0.1))
        >>> o.shape, keys.shape, values.shape
        (torch.Size([1, 5, 2, 6]), torch.Size([1, 2, 8, 4]), torch.Size([1, 2, 4, 6]))
    """
    _check_gsa_inputs(q, k, v, log_decay, time_axis=True)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], log_decay.shape[-1])
    values = q.new_zeros(q.shape[0], q.shape[2], log_decay.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[1]):
        a = log_decay[:, t].exp()
        keys = keys * a[:, :, None, :] + k[:, t, :, :, None] * (1 - a)[:, :, None, :]
        values = values * a[:, :, :, None] + (1 - a)[:, :, :, None] * v[:, t, :, None, :]
        p = torch.softmax(scale * torch.einsum("bhk,bhkm->bhm", q[:, t], keys), -1)
        out.append(torch.einsum("bhm,bhmv->bhv", p, values))
    return torch.stack(out, 1), (keys, values)
