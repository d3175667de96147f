"""Validation of the inputs of the attention ops.

Shape and dtype checks always run. Checks of values (``log_forget <= 0``, ``cu_seqlens``
monotone) run on CPU tensors, and on device tensors only when the debug checks of
:func:`linmem.ops.set_debug_checks` are on, so the hot path never waits for the device.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..recurrence import inputs as _recurrence_inputs


def _values_checkable(t: torch.Tensor) -> bool:
    return _recurrence_inputs._values_checkable(t)  # one debug switch for every op


def _tensor(op: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")


def _float(op: str, name: str, t: torch.Tensor) -> None:
    _tensor(op, name, t)
    if not t.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor, got dtype {t.dtype}")


def _shape(op: str, name: str, t: torch.Tensor, expected: list[int], meaning: str) -> None:
    if list(t.shape) != expected:
        raise ValueError(f"{op}: `{name}` must have shape {meaning} = {expected}, got {list(t.shape)}")


def _same_device(op: str, name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{op}: `{name}` is on {t.device}, but `q` is on {q.device}")


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool) -> None:
    """q: [B, Tq, H, D], k: [B, Tk, Hkv, D], v: [B, Tk, Hkv, Dv], H a multiple of Hkv, Tq == Tk or Tq <= Tk."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _float(op, name, t)
        if t.dim() != 4:
            raise ValueError(
                f"{op}: `{name}` must be 4-D [B, T, heads, head dim], got {t.dim()}-D shape {list(t.shape)}"
            )
        _same_device(op, name, t, q)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: `q`, `k`, `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if same_length:
        _shape(op, "k", k, [B, Tq, Hkv, D], "[B, T, Hkv, D] (B, T, D as q)")
    else:
        _shape(op, "k", k, [B, Tk, Hkv, D], "[B, Tk, Hkv, D] (B, D as q)")
        if Tk < Tq:
            raise ValueError(f"{op}: the queries are the last Tq keys, so `k` needs Tk >= Tq = {Tq}, got Tk = {Tk}")
    _shape(op, "v", v, [B, Tk, Hkv, v.shape[-1]], "[B, Tk, Hkv, Dv] (B, Tk, Hkv as k)")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{op}: the query heads H = {H} must be a multiple of the key/value heads Hkv = {Hkv}")


def check_log_forget(
    op: str, name: str, t: torch.Tensor, expected: list[int], *, device: torch.device, nonpositive: bool
) -> None:
    """A per-token, per-query-head gate of shape ``expected`` = [B, T, H] (with ``nonpositive``: <= 0)."""
    _float(op, name, t)
    if t.device != device:
        raise ValueError(f"{op}: `{name}` is on {t.device}, but `q` is on {device}")
    _shape(op, name, t, expected, "[B, T, H]")
    if not t.numel() or not _values_checkable(t):
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
    _tensor(op, "key_mask", key_mask)
    if key_mask.dtype != torch.bool:
        raise TypeError(f"{op}: `key_mask` must be a bool tensor (False = no key there), got dtype {key_mask.dtype}")
    _same_device(op, "key_mask", key_mask, k)
    _shape(op, "key_mask", key_mask, list(k.shape[:2]), "[B, Tk]")


def check_window(op: str, window: Optional[int]) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"{op}: `window` must be a Python int or None, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"{op}: `window` must be >= 1 (the query itself is in its window), got {window}")


def resolve_scale(op: str, scale: Optional[float], head_dim: int) -> float:
    """The score scale: ``scale`` (a finite number > 0) or ``head_dim ** -0.5``."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: `scale` must be a Python float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{op}: `scale` must be a finite number > 0, got {scale}")
    return float(scale)


def check_backend(op: str, backend: str, valid: tuple[str, ...]) -> None:
    if not isinstance(backend, str) or backend not in valid:
        raise ValueError(f"{op}: unknown `backend` {backend!r}; valid: {', '.join(valid)}")


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
    _tensor(op, "cu_seqlens", cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: `cu_seqlens` must be int32 or int64, got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{op}: `cu_seqlens` must have shape [N + 1] with N >= 1, got {list(cu.shape)}")
    _same_device(op, "cu_seqlens", cu, q)
    B, T = q.shape[:2]
    if B != 1:
        raise ValueError(f"{op}: `cu_seqlens` needs batch size B == 1 (sequences packed along T), got B = {B}")
    if Tk != T:
        raise ValueError(f"{op}: `cu_seqlens` needs as many keys as queries, got Tq = {T}, Tk = {Tk}")
    if _values_checkable(cu):
        c = cu.cpu()
        if int(c[0]) != 0:
            raise ValueError(f"{op}: `cu_seqlens` must start at 0, got {int(c[0])}")
        if bool((c[1:] < c[:-1]).any()):
            raise ValueError(f"{op}: `cu_seqlens` must be non-decreasing, got {c.tolist()}")
        if int(c[-1]) != T:
            raise ValueError(f"{op}: `cu_seqlens` must end at T = {T}, got {int(c[-1])}")
