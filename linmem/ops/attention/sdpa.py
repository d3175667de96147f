"""Causal and sliding-window attention without a forget gate through PyTorch's scaled_dot_product_attention.

Full causal attention is one ``is_causal`` call (the flash kernel where PyTorch has one).
A window ``W < T`` is one batched call over blocks of W queries: block b (queries
``[bW, bW + W)``) reads the keys ``[bW - W, bW + W)`` under one shared ``[W, 2W]`` band
mask, so the work and memory are O(T W), not O(T^2); the first block, which has no keys
before it, is plain causal. Packed sequences (``cu_seqlens``) are served one sequence at a time
(eagerly: under ``torch.compile`` the host-side split would break the graph), so no call builds
the [T, T] block-diagonal mask that the reference would (O(T^2) memory, which made packed training
rows on a CPU several times slower than unpacked ones).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange


def refusal(*, forget: bool, key_mask: bool, cu_seqlens: bool, Tq: int, Tk: int) -> Optional[str]:
    """None if :func:`sdpa_attention` serves the call, else why not."""
    if forget:
        return "a forget gate needs its bias inside the kernel (SDPA would keep a [B, H, T, T] mask)"
    if cu_seqlens and torch.compiler.is_compiling():
        return "packed sequences are split on the host, which would break the compiled graph"
    if key_mask or Tq != Tk:
        return "a KV cache (key mask, fewer queries than keys) needs a materialised mask"
    return None


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, H, T, D] heads-first causal attention (GQA through ``enable_gqa``)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """[B, H, T, D] heads-first sliding-window attention, T > window, in blocks of ``window`` queries."""
    B, H, T, _ = q.shape
    W = window
    nblk = -(-T // W)
    pad = nblk * W - T  # padded keys come after every real query: causally hidden
    qp, kp, vp = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    first = _causal(qp[:, :, :W], kp[:, :, :W], vp[:, :, :W], scale)  # no keys before the first block
    # block b >= 1: queries [bW, bW + W) over keys [bW - W, bW + W); batch axis (block, batch), heads kept
    q_blocks = rearrange(qp[:, :, W:], "b h (n w) d -> (n b) h w d", w=W)
    k_blocks, v_blocks = (rearrange(x.unfold(2, 2 * W, W), "b h n d w -> (n b) h w d") for x in (kp, vp))
    r = torch.arange(W, device=q.device)[:, None]  # query row in its block: key index r + W in the band
    c = torch.arange(2 * W, device=q.device)[None, :]
    band = (c <= r + W) & (c > r)  # [W, 2W]: j <= i and j > i - W
    rest = F.scaled_dot_product_attention(q_blocks, k_blocks, v_blocks, attn_mask=band, scale=scale,
                                          enable_gqa=H != k.shape[1])
    rest = rearrange(rest, "(n b) h w d -> b h (n w) d", b=B)
    return torch.cat([first, rest], dim=2)[:, :, :T]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: Optional[int],
                   cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: [B, T, H, D], k: [B, T, Hkv, D], v: [B, T, Hkv, Dv] -> o: [B, T, H, Dv], causal, optional window;
    ``cu_seqlens`` [N + 1] (B == 1): N packed sequences, each attending within itself (read on the host)."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        pieces = [sdpa_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=scale, window=window)
                  for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return torch.cat(pieces, dim=1) if pieces else sdpa_attention(q, k, v, scale=scale, window=window)
    qh, kh, vh = (rearrange(x, "b t h d -> b h t d") for x in (q, k, v))
    T = q.shape[1]
    if window is None or window >= T:
        o = _causal(qh, kh, vh, scale)
    else:
        o = _banded(qh, kh, vh, scale, window)
    return rearrange(o, "b h t d -> b t h d")
