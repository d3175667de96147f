"""Validation of the inputs of the attention ops.

Shape and dtype checks always run. Checks of values (``log_forget <= 0``, ``cu_seqlens``
monotone) run on CPU tensors, and on device tensors only when the debug checks of
:func:`linmem.ops.set_debug_checks` are on, so the hot path never waits for the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import checks
from ..checks import check_4d, check_device, check_float, check_same_dtype, check_shape, check_tensor, values_checkable


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool) -> None:
    """q: [B, Tq, H, D], k: [B, Tk, Hkv, D], v: [B, Tk, Hkv, Dv], H a multiple of Hkv, Tq == Tk or Tq <= Tk."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_4d(op, name, t, "[B, T, heads, head dim]")
        check_device(op, name, t, q.device)
    check_same_dtype(op, q, k, v)
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if same_length:
        check_shape(op, "k", k, [B, Tq, Hkv, D], "[B, T, Hkv, D] (B, T, D as q)")
    else:
        check_shape(op, "k", k, [B, Tk, Hkv, D], "[B, Tk, Hkv, D] (B, D as q)")
        if Tk < Tq:
            raise ValueError(f"{op}: the queries are the last Tq keys, so `k` needs Tk >= Tq = {Tq}, got Tk = {Tk}")
    check_shape(op, "v", v, [B, Tk, Hkv, v.shape[-1]], "[B, Tk, Hkv, Dv] (B, Tk, Hkv as k)")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{op}: the query heads H = {H} must be a multiple of the key/value heads Hkv = {Hkv}")


def check_log_forget(
    op: str, name: str, t: torch.Tensor, expected: list[int], *, device: torch.device, nonpositive: bool
) -> None:
    """A per-token, per-query-head gate of shape ``expected`` = [B, T, H] (with ``nonpositive``: <= 0)."""
    check_float(op, name, t)
    check_device(op, name, t, device)
    check_shape(op, name, t, expected, "[B, T, H]")
    if not t.numel() or not values_checkable(t):
        return
    values = t.detach()
    if bool(values.isnan().any()):
        raise ValueError(f"{op}: `{name}` must not hold NaN; got {int(values.isnan().sum())} NaN value(s)")
    if nonpositive and bool((values > 0).any()):
        raise ValueError(
            f"{op}: `{name}` must be <= 0 (a forget gate in [0, 1] in log space, -inf forgets everything); got a "
            f"maximum of {float(values.max()):g}"
        )


def check_key_mask(op: str, key_mask: torch.Tensor, k: torch.Tensor) -> None:
    """key_mask: [B, Tk] bool."""
    check_tensor(op, "key_mask", key_mask)
    if key_mask.dtype != torch.bool:
        raise TypeError(f"{op}: `key_mask` must be a bool tensor (False = no key there), got dtype {key_mask.dtype}")
    check_device(op, "key_mask", key_mask, k.device, like="k")
    check_shape(op, "key_mask", key_mask, list(k.shape[:2]), "[B, Tk]")


def check_window(op: str, window: Optional[int]) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"{op}: `window` must be a Python int or None, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"{op}: `window` must be >= 1 (the query itself is in its window), got {window}")


def check_prune_tolerance(op: str, tolerance: Optional[float]) -> None:
    """None, or the softmax mass pruning may drop per query: a float in (0, 1)."""
    if tolerance is None:
        return
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"{op}: `prune_tolerance` must be a Python float or None, got {type(tolerance).__name__}")
    if not 0 < tolerance < 1:
        raise ValueError(f"{op}: `prune_tolerance` must lie in (0, 1), got {tolerance}")


def check_cu_seqlens(op: str, cu: torch.Tensor, q: torch.Tensor, Tk: int) -> None:
    """cu_seqlens: [N + 1] int32/int64 from 0 to T, non-decreasing; q: [B, T, ...] with B == 1, T == Tk."""
    B, T = q.shape[:2]
    checks.check_cu_seqlens(op, cu, B, T, q.device)
    if Tk != T:
        raise ValueError(f"{op}: `cu_seqlens` needs as many keys as queries, got Tq = {T}, Tk = {Tk}")
