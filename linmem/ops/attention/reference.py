"""Forgetting attention written out as in the FoX paper: the oracle of every faster backend.

Per head, with the cumulative log forget values ``c_t = sum_{l <= t} log f_l`` (fp32)::

    S_ij = scale * q_i . k_j + c_i - c_j        (the forget bias c_i - c_j = sum_{j < l <= i} log f_l <= 0)
    P_i  = softmax_j(S_ij) over the keys j that query i sees
    o_i  = sum_j P_ij v_j

The scores, the bias and the softmax are materialised ``[B, H, Tq, Tk]`` in fp32 (fp64 for
fp64 inputs): O(T^2) memory, meant for checking and for small CPU runs. The queries are the
last ``Tq`` of ``Tk`` keys (``Tq == Tk`` in training). Autograd gives every gradient.

Adaptive computation pruning (Lin et al. 2025, arXiv 2504.06949) drops the pairs whose bias
is so negative that, whatever q and k are, their softmax weights add up to less than a
tolerance (:func:`prune_threshold`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from einops import rearrange, repeat

from ..recurrence.inputs import LOG_DECAY_FLOOR
from ..varlen import sequence_ids


def forget_cumsum(log_forget: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """c_t = sum of log_forget over the token's own sequence up to t: [B, T, H] -> [B, T, H] (fp32 or fp64).

    Autograd turns the gradient of c into the reverse cumulative sum per sequence, the
    gradient of log_forget.

    Each gate is first clamped to at least ``LOG_DECAY_FLOOR`` (-110): a ``-inf`` gate (forget
    everything) would make a difference of two sums NaN, and a huge finite one overflow them. A pair
    across a floored gate keeps a bias below -110, so it weighs at most ``exp(-110 + s_j - s_i)`` of
    the query's own key (s the scaled scores): nothing in fp32 unless two scores of a row lie more
    than about 20 apart. The gradient of a floored gate is 0, as at a gate of 0."""
    acc = torch.float64 if log_forget.dtype == torch.float64 else torch.float32
    # the sums run along the innermost axis, head-major: a scan across the middle axis of [B, T, H] has few
    # threads (B * H), each walking T (0.4 ms at 8 x 2048 x 16 heads on an H200, as long as the attention kernel);
    # the result is a [B, T, H] view of [B, H, T] memory, the layout the attention kernels read
    log_forget = log_forget.to(acc).clamp(min=LOG_DECAY_FLOOR).transpose(1, 2).contiguous()  # [B, H, T]
    c = log_forget.cumsum(dim=-1)
    if cu_seqlens is not None:
        before = c - log_forget  # sums up to t - 1
        starts = cu_seqlens.to(torch.long)[sequence_ids(cu_seqlens, c.shape[-1])]  # [T] first token of t's sequence
        c = c - before[..., starts]
    return c.transpose(1, 2)


def visible(
    Tq: int,
    Tk: int,
    *,
    window: Optional[int],
    key_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """Which keys each query sees: bool [1 or B, 1, Tq, Tk].

    Query i sits at key index ``Tk - Tq + i`` and sees the keys j at or before it, after
    ``i - window``, in its own sequence and present in ``key_mask``.
    """
    i = torch.arange(Tk - Tq, Tk, device=device)[:, None]  # key index of each query
    j = torch.arange(Tk, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    if cu_seqlens is not None:
        seq = sequence_ids(cu_seqlens, Tk)
        allowed = allowed & (seq[:, None] == seq[None, :])
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed


def logit_bound(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """U_h = 2 scale max_i |q_i| max_j |k_j| per query head: [H] fp32, a bound on how far two
    scores ``scale * q_i . k_j`` of one row of head h can lie apart.

    q: [B, T, H, D], k: [B, T, Hkv, D] (over the whole batch: one bound for every sequence).
    """
    H, Hkv = q.shape[2], k.shape[2]
    q_norm = torch.linalg.vector_norm(q.detach().float(), dim=-1).amax(dim=(0, 1))  # [H]
    k_norm = torch.linalg.vector_norm(k.detach().float(), dim=-1).amax(dim=(0, 1))  # [Hkv]
    return 2.0 * scale * q_norm * k_norm.repeat_interleave(H // Hkv)


def prune_threshold(bound: torch.Tensor, tolerance: float, keys: torch.Tensor) -> torch.Tensor:
    """delta = log(tolerance) - U_h - log(n): [H] bounds, [Tq] key counts n -> [H, Tq].

    A pair (i, j) with ``c_i - c_j < delta`` has ``exp(S_ij - S_ii) < tolerance / n``; with
    at most n keys per row, all such pairs of a row hold less than ``tolerance`` of its
    softmax mass (the own key, bias 0, is never dropped).
    """
    return math.log(tolerance) - bound[:, None] - torch.log(keys.to(bound.dtype))[None, :]


def keys_per_query(Tk: int, window: Optional[int], cu_seqlens: Optional[torch.Tensor], device: torch.device
                   ) -> torch.Tensor:
    """[Tk] the n of :func:`prune_threshold` for every query: min(window, length of its sequence)."""
    if cu_seqlens is None:
        lengths = torch.full((Tk,), Tk, device=device)
    else:
        lengths = torch.diff(cu_seqlens.to(torch.long))[sequence_ids(cu_seqlens, Tk)]
    return lengths.clamp(max=window) if window is not None else lengths


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    cum_forget: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    key_mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    prune_tolerance: Optional[float] = None,
) -> torch.Tensor:
    """q: [B, Tq, H, D], k: [B, Tk, Hkv, D], v: [B, Tk, Hkv, Dv], cum_forget: [B, Tk, H] -> o: [B, Tq, H, Dv].

    Inputs are validated by the caller; pruning needs ``Tq == Tk`` and ``cum_forget``.
    """
    Tq, H, Tk, Hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = (repeat(x.to(acc), "b t h d -> b t (h g) d", g=H // Hkv) for x in (k, v))  # GQA: head h reads h // g
    scores = torch.einsum("bihd,bjhd->bhij", q.to(acc), k) * scale  # [B, H, Tq, Tk]
    allowed = visible(Tq, Tk, window=window, key_mask=key_mask, cu_seqlens=cu_seqlens, device=q.device)
    if cum_forget is not None:
        c = rearrange(cum_forget.to(acc), "b t h -> b h t")
        bias = c[..., Tk - Tq:, None] - c[..., None, :]  # [B, H, Tq, Tk] c_i - c_j
        scores = scores + bias
        if prune_tolerance is not None:
            n = keys_per_query(Tk, window, cu_seqlens, q.device)
            delta = prune_threshold(logit_bound(q, k, scale).to(acc), prune_tolerance, n)  # [H, Tq]
            allowed = allowed & (bias.detach() >= delta[None, :, :, None])
    empty = ~allowed.any(dim=-1, keepdim=True)  # a query that sees no key (padding) gets o = 0
    weights = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0).softmax(dim=-1)
    o = torch.einsum("bhij,bjhd->bihd", weights.masked_fill(~allowed, 0.0), v)
    return o.to(q.dtype)
