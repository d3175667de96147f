"""Launchers of the forgetting-attention kernels: tensors in, tensors out, no autograd.

Every launcher takes contiguous ``[B, T, heads, D]`` activations, ``c`` (the cumulative log
forget values, fp32, head-major ``[B, H, T]`` for the flash kernels and ``[B, Tk, H]`` for decoding)
or None, ``key_mask`` (uint8 ``[B, Tk]``) or None, and the packed ``cu_seqlens`` or None. Sizes are
shape arithmetic: no host synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch

from ...recurrence.triton import configs as recurrence_configs
from ...triton_launch import cdiv, next_power_of_2, run_kernel
from . import backward, decode, forward
from .configs import (
    DECODE_MANY_ROWS_TILES,
    DECODE_SPLIT_TILES,
    FP32_TILES,
    INTERPRETER_DECODE_SPLIT_TILES,
    INTERPRETER_SMS,
    INTERPRETER_TILES,
    TILES,
    Tiles,
)

#: warps and stages of the decoding's combine kernel (Triton's defaults)
COMBINE_WARPS, COMBINE_STAGES = 4, 3


def tiles(kernel: str, q: torch.Tensor, v: torch.Tensor, rows: int = 16) -> Tiles:
    """The tiles of ``kernel`` for these inputs (by dtype and the larger head dim on CUDA; decoding also by its
    query rows a KV head, ``rows``)."""
    dim = max(q.shape[-1], v.shape[-1])
    if q.device.type != "cuda":
        return replace(INTERPRETER_TILES[kernel], split=TILES[kernel][dim].split)
    if q.dtype == torch.float32:
        return FP32_TILES[kernel]
    if kernel == "decode" and rows > 16:
        return DECODE_MANY_ROWS_TILES[dim]
    return TILES[kernel][dim]


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (the recurrence's cached count); ``INTERPRETER_SMS`` elsewhere."""
    return recurrence_configs.sm_count(device) if device.type == "cuda" else INTERPRETER_SMS


def _grid(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor], block: int, heads: int) -> tuple[tuple[int, int], int]:
    """(grid, N sequences) of a kernel with one program per block of ``block`` tokens and head: fixed length
    (B * heads, blocks per sequence); varlen (heads, slots), block i of sequence n in slot ``bos // block + n``.
    The blocks are the grid's slower axis, so that the programs start block by block over all heads."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return (B * heads, cdiv(T, block)), B
    N = cu_seqlens.shape[0] - 1
    return (heads, T // block + N), N


def _widths(D: int, DV: int) -> dict:
    """The head dims and the tiles' widths: the next powers of two, whose padded columns the kernels mask."""
    return dict(D=D, DV=DV, BD=next_power_of_2(D), BDV=next_power_of_2(DV))


def _flags(c, key_mask, cu_seqlens, window, tol) -> dict:
    return dict(IS_VARLEN=cu_seqlens is not None, HAS_FORGET=c is not None, HAS_WINDOW=window is not None,
                HAS_KEY_MASK=key_mask is not None, PRUNE=tol is not None)


def _scalars(window: Optional[int], tol: Optional[float]) -> tuple[int, float]:
    return (window if window is not None else 0), (math.log(tol) if tol is not None else 0.0)


def attention_forward(q, k, v, c, key_mask, cu_seqlens, bound, scale: float, window: Optional[int],
                      tol: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> o: [B, Tq, H, Dv] (q's dtype), lse: [B, H, Tq] fp32 (log2 units). ``bound``: [H] fp32 with ``tol``."""
    B, Tq, H, D = q.shape
    Tk, Hkv, DV = k.shape[1], k.shape[2], v.shape[-1]
    cfg = tiles("forward", q, v)
    o = q.new_empty(B, Tq, H, DV)
    lse = q.new_empty(B, H, Tq, dtype=torch.float32)
    grid, N = _grid(q, cu_seqlens, cfg.block_m, H)
    win, log_tol = _scalars(window, tol)
    run_kernel(forward.forward_kernel, grid, (q, k, v, c, key_mask, o, lse, bound, cu_seqlens, scale, log_tol, win, N,
                                              Tq, Tk, H),
               {"G": H // Hkv, **_widths(D, DV), "BM": cfg.block_m, "BN": cfg.block_n,
                **_flags(c, key_mask, cu_seqlens, window, tol)}, cfg.warps, cfg.stages)
    return o, lse


def attention_backward(q, k, v, c, key_mask, cu_seqlens, bound, o, lse, do, scale: float, window: Optional[int],
                       tol: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """-> dq, dk, dv (the inputs' dtypes) and dc: [B, H, T] fp32 (None without c). Needs Tq == Tk."""
    args = (q, k, v, c, key_mask, cu_seqlens, bound)
    dq, delta, u = backward_dq(*args, o, lse, do, scale, window, tol)
    dk, dv, dc = backward_dkdv(*args, lse, delta, u, do, scale, window, tol)
    return dq, dk, dv, dc


def backward_dq(q, k, v, c, key_mask, cu_seqlens, bound, o, lse, do, scale: float, window: Optional[int],
                tol: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first pass of the backward -> dq, the corrected delta and u ([B, H, T] fp32, for :func:`backward_dkdv`)."""
    B, T, H, D = q.shape
    Hkv, DV = k.shape[2], v.shape[-1]
    win, log_tol = _scalars(window, tol)
    dq = torch.empty_like(q)
    delta, u = torch.empty_like(lse), torch.empty_like(lse)
    cfg = tiles("dq", q, v)
    grid, N = _grid(q, cu_seqlens, cfg.block_m, H)
    run_kernel(backward.dq_kernel, grid, (q, k, v, c, key_mask, o, do, lse, delta, u, dq, bound, cu_seqlens, scale,
                                          log_tol, win, N, T, H),
               {"G": H // Hkv, **_widths(D, DV), "BM": cfg.block_m, "BN": cfg.block_n,
                "QT": tiles("dkdv", q, v).block_m, **_flags(c, key_mask, cu_seqlens, window, tol)},
               cfg.warps, cfg.stages)
    return dq, delta, u


def backward_dkdv(q, k, v, c, key_mask, cu_seqlens, bound, lse, delta, u, do, scale: float, window: Optional[int],
                  tol: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The second pass of the backward -> dk, dv and dc ([B, H, T] fp32, None without c): one launch, or with the
    tiles' ``split`` one for dk and dc and one for dv."""
    B, T, H, D = q.shape
    Hkv, DV = k.shape[2], v.shape[-1]
    win, log_tol = _scalars(window, tol)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dc = torch.empty_like(c) if c is not None else None
    cfg = tiles("dkdv", q, v)
    grid, N = _grid(q, cu_seqlens, cfg.block_n, Hkv)
    args = (q, k, v, c, key_mask, do, lse, delta, u, dk, dv, dc, bound, cu_seqlens, scale, log_tol, win, N, T, H)
    constexprs = {"G": H // Hkv, **_widths(D, DV), "BM": cfg.block_m, "BN": cfg.block_n,
                  **_flags(c, key_mask, cu_seqlens, window, tol)}
    for part in ((True, False), (False, True)) if cfg.split else ((True, True),):
        run_kernel(backward.dkdv_kernel, grid, args, {**constexprs, "WITH_DK": part[0], "WITH_DV": part[1]},
                   cfg.warps, cfg.stages)
    return dk, dv, dc


def decode_splits(q: torch.Tensor, keys: int, block_n: int) -> int:
    """How many parallel splits a decoding call cuts its ``keys`` into: as many as two programs per SM take,
    rounded down (an even number for one program per (batch row, KV head) on a full GPU), each reading at least
    ``DECODE_SPLIT_TILES`` tiles of ``block_n`` keys, at most ``decode.MAX_SPLITS``. Timed by
    ``dev/gpu/tools/decode_sweep.py`` (H200, batch 8, 16 KV heads, 32K keys, 3-stage tiles of 128 keys): cut in 2
    or 4 the cache is read at 4.2 TB/s (D = 64) and 4.4 (D = 128), in 1 at 3.7 and 4.5; below 2K keys a split's
    partials and the combine launch cost more than they save."""
    B, Hkv = q.shape[0], q.shape[2]
    wanted = 2 * sm_count(q.device) // (B * Hkv)
    fewest = block_n * (DECODE_SPLIT_TILES if q.device.type == "cuda" else INTERPRETER_DECODE_SPLIT_TILES)
    return max(1, min(wanted, keys // fewest, decode.MAX_SPLITS))


def attention_decode(q, k, v, c, key_mask, scale: float, window: Optional[int], splits: Optional[int] = None
                     ) -> torch.Tensor:
    """q: [B, Tq, H, D] against k: [B, Tk, Hkv, D], v: [B, Tk, Hkv, Dv] -> o: [B, Tq, H, Dv].

    ``splits``: how many parts the keys are cut into (default :func:`decode_splits`)."""
    B, Tq, H, D = q.shape
    Tk, Hkv, DV = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    BR = max(16, next_power_of_2(G * Tq))
    cfg = tiles("decode", q, v, BR)
    keys = Tk if window is None else min(Tk, Tq - 1 + window)
    splits = splits if splits is not None else decode_splits(q, keys, cfg.block_n)
    chunk = cdiv(cdiv(keys, splits), cfg.block_n) * cfg.block_n
    splits = cdiv(keys, chunk)
    o = q.new_empty(B, Tq, H, DV)
    flags = dict(HAS_FORGET=c is not None, HAS_WINDOW=window is not None, HAS_KEY_MASK=key_mask is not None)
    win = window if window is not None else 0
    if splits == 1:
        run_kernel(decode.decode_kernel, (1, B * Hkv),
                   (q, k, v, c, key_mask, o, None, None, None, scale, win, chunk, Tq, Tk, H),
                   {"G": G, **_widths(D, DV), "BR": BR, "BN": cfg.block_n, **flags, "SPLIT": False},
                   cfg.warps, cfg.stages)
        return o
    pm = q.new_empty(splits, B * Hkv, BR, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = q.new_empty(splits, B * Hkv, BR, DV, dtype=torch.float32)
    run_kernel(decode.decode_kernel, (splits, B * Hkv),
               (q, k, v, c, key_mask, o, pm, pl, pacc, scale, win, chunk, Tq, Tk, H),
               {"G": G, **_widths(D, DV), "BR": BR, "BN": cfg.block_n, **flags, "SPLIT": True}, cfg.warps, cfg.stages)
    run_kernel(decode.combine_kernel, (B * Hkv, G * Tq), (pm, pl, pacc, o, splits, Tq, H),
               {"G": G, "DV": DV, "BDV": next_power_of_2(DV), "BR": BR, "BS": decode.MAX_SPLITS},
               COMBINE_WARPS, COMBINE_STAGES)
    return o
