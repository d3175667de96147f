"""Softmax attention for hybrids: causal, sliding window, forgetting gate (DESIGN.md section 4).

``forgetting_attention`` is the training/prefill entry point; ``cached_attention`` is
its decoding form, where the queries are the newest tokens of a KV cache whose keys
carry a padding mask and their cumulative forget values. Both compute, per head,

    o_i = sum_{j visible from i} softmax_j(scale * q_i . k_j + c_i - c_j) v_j

with ``c`` the cumulative sum of the log forget gates (fp32), through
``torch.nn.functional.scaled_dot_product_attention``. A fused kernel is a later addition.
"""

from __future__ import annotations

from typing import Optional

import torch

from .inputs import (
    check_cu_seqlens,
    check_key_mask,
    check_log_forget,
    check_qkv,
    check_window,
    resolve_scale,
)
from .sdpa import attention, forget_cumsum

__all__ = ["forgetting_attention", "cached_attention", "cumulative_forget"]


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_forget: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal softmax attention with an optional forget gate (FoX), window and packed sequences.

    With ``c_i = sum_{l <= i} log_forget_l`` (fp32, restarting at every sequence)::

        o_i = sum_{j <= i, i - window < j} softmax_j(scale * q_i . k_j + c_i - c_j) v_j

    ``log_forget=None`` is plain causal attention; ``window=W`` lets query i see keys
    ``i - W < j <= i``; with ``cu_seqlens`` no query sees a key of another sequence.

    Args:
        q: ``[B, T, H, D]``.
        k: ``[B, T, Hkv, D]``; v: ``[B, T, Hkv, Dv]``, H a multiple of Hkv (GQA:
            query head h reads key/value head ``h // (H / Hkv)``). One dtype for q, k, v.
        log_forget: ``[B, T, H]`` per-token log forget gate (<= 0), fp32 recommended.
        window: sliding-window size (>= 1) or None.
        scale: score scale, default ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of N sequences packed along T (B == 1).

    Returns:
        ``o: [B, T, H, Dv]`` in the dtype of q.

    Example:
        >>> import torch
        >>> from linmem.ops.attention import forgetting_attention
        >>> q, k, v = torch.randn(1, 10, 4, 16), torch.randn(1, 10, 2, 16), torch.randn(1, 10, 2, 8)
        >>> log_f = torch.nn.functional.logsigmoid(torch.randn(1, 10, 4))
        >>> forgetting_attention(q, k, v, log_forget=log_f, window=4).shape
        torch.Size([1, 10, 4, 8])
    """
    op = "forgetting_attention"
    check_qkv(op, q, k, v, same_length=True)
    if log_forget is not None:
        check_log_forget(op, "log_forget", log_forget, [*q.shape[:3]], device=q.device, nonpositive=True)
    check_window(op, window)
    scale = resolve_scale(op, scale, q.shape[-1])
    if cu_seqlens is not None:
        check_cu_seqlens(op, cu_seqlens, q, k.shape[1])
    cum = None if log_forget is None else forget_cumsum(log_forget, cu_seqlens)
    return attention(q, k, v, scale=scale, window=window, cum_forget=cum, cu_seqlens=cu_seqlens)


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: Optional[torch.Tensor] = None,
    cum_forget: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of the newest ``Tq`` tokens over ``Tk`` keys (a KV cache followed by the new keys).

    Query ``i`` is the token of key index ``Tk - Tq + i``; it sees keys ``j <= Tk - Tq + i``
    (and ``j > Tk - Tq + i - window``) that ``key_mask`` marks present. The forget gate
    enters as the bias ``cum_forget[query] - cum_forget[key]``. A query always sees its own
    key, so a padded query gets a finite output (which the caller ignores).

    Args:
        q: ``[B, Tq, H, D]``.
        k: ``[B, Tk, Hkv, D]``; v: ``[B, Tk, Hkv, Dv]``, Tk >= Tq, in time order.
        key_mask: ``[B, Tk]`` bool, False where there is no key (padding, an empty cache slot).
        cum_forget: ``[B, Tk, H]`` cumulative log forget value ``c_j`` of every key (any
            common offset cancels); the queries use the values of the last Tq keys.
        window: sliding-window size in key indices, or None.
        scale: score scale, default ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` packed sequences (B == 1, Tq == Tk) for a masked varlen batch.

    Returns:
        ``o: [B, Tq, H, Dv]`` in the dtype of q.

    Example:
        >>> import torch
        >>> from linmem.ops.attention import cached_attention
        >>> k, v = torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)  # 8 cached keys + 1 new
        >>> present = torch.ones(2, 9, dtype=torch.bool)
        >>> present[1, :3] = False  # row 1 was left-padded
        >>> cached_attention(torch.randn(2, 1, 2, 16), k, v, key_mask=present).shape
        torch.Size([2, 1, 2, 16])
    """
    op = "cached_attention"
    check_qkv(op, q, k, v, same_length=False)
    Tk = k.shape[1]
    if key_mask is not None:
        check_key_mask(op, key_mask, k)
    if cum_forget is not None:
        check_log_forget(op, "cum_forget", cum_forget, [q.shape[0], Tk, q.shape[2]], device=q.device,
                         nonpositive=False)
    check_window(op, window)
    scale = resolve_scale(op, scale, q.shape[-1])
    if cu_seqlens is not None:
        check_cu_seqlens(op, cu_seqlens, q, Tk)
    return attention(q, k, v, scale=scale, window=window, key_mask=key_mask, cum_forget=cum_forget,
                     cu_seqlens=cu_seqlens)


def cumulative_forget(log_forget: torch.Tensor, *, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The cumulative log forget values ``c_t`` that ``cached_attention`` takes as ``cum_forget``.

    Args:
        log_forget: ``[B, T, H]`` log forget gates (<= 0).
        cu_seqlens: ``[N + 1]`` packed sequences (B == 1): the sum restarts at each.

    Returns:
        ``c: [B, T, H]``, fp32 (fp64 for fp64 input), ``c_t = sum_{l <= t} log_forget_l``.

    Example:
        >>> import torch
        >>> from linmem.ops.attention import cumulative_forget
        >>> cumulative_forget(torch.full((1, 4, 1), -0.5), cu_seqlens=torch.tensor([0, 2, 4]))[0, :, 0]
        tensor([-0.5000, -1.0000, -0.5000, -1.0000])
    """
    op = "cumulative_forget"
    if not isinstance(log_forget, torch.Tensor) or log_forget.dim() != 3:
        got = list(log_forget.shape) if isinstance(log_forget, torch.Tensor) else type(log_forget).__name__
        raise ValueError(f"{op}: `log_forget` must be a 3-D tensor [B, T, H], got {got}")
    check_log_forget(op, "log_forget", log_forget, list(log_forget.shape), device=log_forget.device,
                     nonpositive=True)
    if cu_seqlens is not None:
        check_cu_seqlens(op, cu_seqlens, log_forget, log_forget.shape[1])
    return forget_cumsum(log_forget, cu_seqlens)
