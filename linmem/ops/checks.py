"""Checks shared by the ops' input validation, each naming the op and the bad argument in its message (and
:func:`as_dtype`, the ops' cast of their gradients).

Checks of types and shapes always run. Checks that read values run on CPU tensors, and on device tensors only
when debug checks are on (``LINMEM_DEBUG=1`` or :func:`set_debug_checks`), and never under ``torch.compile``: the
hot path neither waits for the device nor breaks a graph.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

_DEBUG_CHECKS = os.environ.get("LINMEM_DEBUG", "0") not in ("", "0", "false", "False")


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype: x itself where it is in dtype already, without ``x.to``'s call (microseconds of host time each,
    which an op's backward with several casts of its gradients spends on every call).

    Example:
        >>> x = torch.ones(2)
        >>> as_dtype(x, torch.float32) is x, as_dtype(x, torch.bfloat16).dtype
        (True, torch.bfloat16)
    """
    return x if x.dtype == dtype else x.to(dtype)


def set_debug_checks(enabled: bool) -> None:
    """Turn value checks of device tensors on or off (they synchronise the device; eager mode only).

    Example:
        >>> set_debug_checks(False)
    """
    global _DEBUG_CHECKS
    _DEBUG_CHECKS = bool(enabled)


def values_checkable(t: torch.Tensor) -> bool:
    """Whether the values of t are checked: CPU tensors, or any with debug checks on, in eager mode. Under
    torch.compile a check that reads values would be a data-dependent branch, which a full graph cannot hold.

    Example:
        >>> values_checkable(torch.zeros(3))
        True
    """
    return (t.device.type == "cpu" or _DEBUG_CHECKS) and not torch.compiler.is_compiling()


def check_tensor(op: str, name: str, t: object) -> None:
    """A TypeError unless t is a tensor.

    Example:
        >>> check_tensor("my_op", "x", torch.zeros(2))
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")


def check_float(op: str, name: str, t: object) -> None:
    """A TypeError unless t is a floating-point tensor.

    Example:
        >>> check_float("my_op", "x", torch.zeros(2))
    """
    check_tensor(op, name, t)
    if not t.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor, got dtype {t.dtype}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: list[int], meaning: str) -> None:
    """A ValueError unless t has the shape ``expected``, spelled ``meaning`` (e.g. "[B, T, H]") in the message.

    Example:
        >>> check_shape("my_op", "beta", torch.zeros(2, 5, 4), [2, 5, 4], "[B, T, H]")
    """
    if list(t.shape) != expected:
        raise ValueError(f"{op}: `{name}` must have shape {meaning} = {expected}, got {list(t.shape)}")


def check_device(op: str, name: str, t: torch.Tensor, device: torch.device, like: str = "q") -> None:
    """A ValueError unless t is on ``device``, the device of the argument ``like``.

    Example:
        >>> check_device("my_op", "k", torch.zeros(2), torch.device("cpu"))
    """
    if t.device != device:
        raise ValueError(f"{op}: `{name}` is on {t.device}, but `{like}` is on {device}")


def check_4d(op: str, name: str, t: object, layout: str) -> None:
    """A TypeError unless t is a floating-point tensor, a ValueError unless it is 4-D (``layout`` names the axes).

    Example:
        >>> check_4d("my_op", "q", torch.zeros(2, 5, 4, 8), "[B, T, H, K]")
    """
    check_float(op, name, t)
    if t.dim() != 4:
        raise ValueError(f"{op}: `{name}` must be 4-D {layout}, got {t.dim()}-D shape {list(t.shape)}")


def check_same_dtype(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A TypeError unless q, k and v share one dtype.

    Example:
        >>> check_same_dtype("my_op", *torch.zeros(3, 2).unbind())
    """
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: `q`, `k`, `v` must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_qkv_heads(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """q, k: [B, T, H, K], v: [B, T, H, V], floating point, one dtype, one device -> (B, T, H, K, V).

    Example:
        >>> check_qkv_heads("my_op", torch.zeros(2, 5, 4, 8), torch.zeros(2, 5, 4, 8), torch.zeros(2, 5, 4, 6))
        (2, 5, 4, 8, 6)
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_4d(op, name, t, f"[B, T, H, {'V' if name == 'v' else 'K'}]")
    check_same_dtype(op, q, k, v)
    B, T, H, K = q.shape
    V = v.shape[-1]
    check_shape(op, "k", k, [B, T, H, K], "[B, T, H, K] (same as q)")
    check_shape(op, "v", v, [B, T, H, V], "[B, T, H, V] (B, T, H as q)")
    for name, t in (("k", k), ("v", v)):
        check_device(op, name, t, q.device)
    return B, T, H, K, V


def check_positive(op: str, name: str, value: object, meaning: str = "", *, optional: bool = False) -> float:
    """``value`` as a float: a TypeError unless it is a Python number (not a bool), a ValueError unless it is finite
    and > 0. ``meaning`` follows the name in the message; ``optional`` says None is accepted too.

    Example:
        >>> check_positive("my_op", "eps", 1e-6)
        1e-06
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: `{name}` must be a Python float{' or None' if optional else ''}, got "
                        f"{type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{op}: `{name}`{meaning} must be a finite number > 0, got {value!r}")
    return float(value)


def resolve_scale(op: str, scale: Optional[float], head_dim: int) -> float:
    """The read-out scale: ``scale`` (a Python number, finite and > 0) or ``head_dim ** -0.5`` for None.

    Example:
        >>> resolve_scale("my_op", None, 16)
        0.25
    """
    return head_dim ** -0.5 if scale is None else check_positive(op, "scale", scale, optional=True)


def check_backend(op: str, backend: str, valid: tuple[str, ...]) -> None:
    """A ValueError unless ``backend`` is one of ``valid``, listing them.

    Example:
        >>> check_backend("my_op", "auto", ("auto", "reference"))
    """
    if not isinstance(backend, str) or backend not in valid:
        raise ValueError(f"{op}: unknown `backend` {backend!r}; valid: {', '.join(valid)}")


def check_cu_seqlens(op: str, cu: object, B: int, T: int, device: torch.device, like: str = "q") -> int:
    """``cu_seqlens`` of a packed batch of B == 1 rows of T tokens on ``device`` -> N, the number of sequences.

    Always: an int32 or int64 tensor of shape [N + 1] with N >= 1, on ``device`` (that of ``like``), and B == 1.
    Its values (0 first, non-decreasing, T last) where :func:`values_checkable`.

    Example:
        >>> check_cu_seqlens("my_op", torch.tensor([0, 2, 5]), 1, 5, torch.device("cpu"))
        2
    """
    check_tensor(op, "cu_seqlens", cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: `cu_seqlens` must be int32 or int64, got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{op}: `cu_seqlens` must have shape [N + 1] with N >= 1, got {list(cu.shape)}")
    check_device(op, "cu_seqlens", cu, device, like)
    if B != 1:
        raise ValueError(f"{op}: `cu_seqlens` needs batch size B == 1 (sequences packed along T), got B = {B}")
    if values_checkable(cu):
        c = cu.cpu()
        if int(c[0]) != 0:
            raise ValueError(f"{op}: `cu_seqlens` must start at 0, got {int(c[0])}")
        if bool((c[1:] < c[:-1]).any()):
            raise ValueError(f"{op}: `cu_seqlens` must be non-decreasing, got {c.tolist()}")
        if int(c[-1]) != T:
            raise ValueError(f"{op}: `cu_seqlens` must end at T = {T}, got {int(c[-1])}")
    return cu.shape[0] - 1
