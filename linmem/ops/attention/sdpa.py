"""Causal softmax attention with a forget-gate bias, on top of PyTorch's scaled_dot_product_attention.

The queries are the last ``Tq`` of ``Tk`` keys: query ``i`` sits at key index
``Tk - Tq + i``. What a query may see is one boolean ``[*, Tq, Tk]`` mask (causal,
window, same sequence, key present); the forget gate enters as the additive bias
``c_i - c_j`` of the cumulative log forget values, so autograd differentiates it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange, repeat


def sequence_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] index of the packed sequence every token belongs to (empty sequences skipped)."""
    steps = torch.arange(T, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.long), steps, right=True)


def forget_cumsum(log_forget: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """c_t = sum of log_forget over the token's own sequence up to t: [B, T, H] -> [B, T, H] (fp32 or fp64)."""
    acc = torch.float64 if log_forget.dtype == torch.float64 else torch.float32
    c = log_forget.to(acc).cumsum(dim=1)
    if cu_seqlens is None:
        return c
    before = c - log_forget.to(acc)  # sums up to t - 1
    starts = cu_seqlens.to(torch.long)[sequence_ids(cu_seqlens, c.shape[1])]  # [T] first token of t's sequence
    return c - before[:, starts]


def visible(
    Tq: int,
    Tk: int,
    *,
    window: Optional[int],
    key_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    device: torch.device,
) -> Optional[torch.Tensor]:
    """Which keys each query sees: None (plain causal, Tq == Tk) or bool [1 or B, 1, Tq, Tk].

    A query always sees its own key, even when ``key_mask`` hides it (a padded query):
    no softmax row is empty, so padded rows stay finite.
    """
    if window is None and key_mask is None and cu_seqlens is None and Tq == Tk:
        return None
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
        allowed = allowed & (key_mask[:, None, None, :] | (j == i))
    return allowed


def forget_bias(cum_forget: torch.Tensor, Tq: int, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """The additive score bias c_i - c_j, -inf where a key is not visible: [B, H, Tq, Tk]."""
    Tk = cum_forget.shape[1]
    c_query = rearrange(cum_forget[:, Tk - Tq:], "b i h -> b h i 1")
    c_key = rearrange(cum_forget, "b j h -> b h 1 j")
    if allowed is None:
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=cum_forget.device).tril()
    return (c_query - c_key).masked_fill(~allowed, float("-inf"))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: Optional[int] = None,
    key_mask: Optional[torch.Tensor] = None,
    cum_forget: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q: [B, Tq, H, D], k: [B, Tk, Hkv, D], v: [B, Tk, Hkv, Dv] -> o: [B, Tq, H, Dv] (inputs validated)."""
    Tq, H = q.shape[1], q.shape[2]
    Tk, Hkv = k.shape[1], k.shape[2]
    allowed = visible(Tq, Tk, window=window, key_mask=key_mask, cu_seqlens=cu_seqlens, device=q.device)
    if cum_forget is not None:
        mask = forget_bias(cum_forget, Tq, allowed).to(q.dtype)
    else:
        mask = allowed
    qh = rearrange(q, "b t h d -> b h t d")
    kh, vh = (repeat(x, "b t h d -> b (h g) t d", g=H // Hkv) for x in (k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale)
    return rearrange(o, "b h t d -> b t h d")
