"""Softmax attention for hybrids: causal, sliding window, forgetting gate (FoX).

``forgetting_attention`` is the training/prefill entry point; ``cached_attention`` is
its decoding form, where the queries are the newest tokens of a KV cache whose keys
carry a padding mask and their cumulative forget values. Both compute, per head,

    o_i = sum_{j visible from i} softmax_j(scale * q_i . k_j + c_i - c_j) v_j

with ``c`` the cumulative sum of the log forget gates (fp32). Backends:

* ``"reference"`` (:mod:`.reference`): the scores materialised in fp32/fp64, the oracle;
* ``"sdpa"`` (:mod:`.sdpa`): no forget gate, PyTorch's scaled_dot_product_attention
  (flash for full causal attention, O(T W) blocks for a window);
* ``"triton"`` (:mod:`.triton`): flash kernels with the forget bias added per tile in fp32,
  O(T) memory, and a split-KV decoding kernel.

``"auto"`` takes the kernels on CUDA and SDPA or the reference elsewhere; a backend that
cannot serve a call hands it to the next one (triton, sdpa, reference) and logs why at
debug level.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .. import parallel
from ..checks import check_backend, resolve_scale
from .inputs import check_cu_seqlens, check_key_mask, check_log_forget, check_prune_tolerance, check_qkv, check_window
from .reference import forget_cumsum, reference_attention
from .sdpa import refusal as sdpa_refusal
from .sdpa import sdpa_attention

try:
    from . import triton as _triton
except ImportError as error:  # no triton: the reference and SDPA serve everything
    _triton = None
    logging.getLogger("linmem.ops").debug("forgetting_attention: no triton backend (%s)", error)

__all__ = ["forgetting_attention", "cached_attention", "cumulative_forget", "BACKENDS"]

logger = logging.getLogger("linmem.ops")

#: the values of ``backend=``
BACKENDS = ("auto", "reference", "sdpa", "triton")
#: cached_attention takes the decoding kernel up to this many query rows per KV head (query heads x new tokens)
DECODE_ROWS = 64


def _records_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _triton_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    if _triton is None:
        return "triton is not installed"
    return _triton.refusal(q, k, v)


def _candidates(backend: str, q: torch.Tensor) -> list[str]:
    """The faster backends to try in order before the reference."""
    if backend == "auto":
        return ["triton", "sdpa"] if q.device.type == "cuda" else ["sdpa"]
    return {"triton": ["triton", "sdpa"], "sdpa": ["sdpa"], "reference": []}[backend]


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_forget: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
    prune_tolerance: Optional[float] = None,
) -> torch.Tensor:
    """Causal softmax attention with an optional forget gate (FoX), window and packed sequences.

    With ``c_i = sum_{l <= i} log_forget_l`` (fp32, restarting at every sequence)::

        o_i = sum_{j <= i, i - window < j} softmax_j(scale * q_i . k_j + c_i - c_j) v_j

    ``log_forget=None`` is plain causal attention; ``window=W`` lets query i see keys
    ``i - W < j <= i``; with ``cu_seqlens`` no query sees a key of another sequence.

    Adaptive computation pruning (``prune_tolerance=eps``, Lin et al. 2025): the pairs whose
    forget bias ``c_i - c_j`` lies below ``delta_h = log(eps) - U_h - log(n)`` are dropped, where
    ``U_h = 2 scale max_i |q_i| max_j |k_j|`` (head h, over the batch) bounds how far two scores of
    a row lie apart and ``n = min(window, sequence length)``. Each dropped pair then weighs less
    than ``eps / n`` of its row's own key, so the dropped weights of a row sum to less than
    ``eps`` and every output element moves by less than ``eps * (max_j v_j - min_j v_j)`` over
    its value channel, at most ``2 eps max|v|``. The gradients are those of the pruned
    function. The kernel skips the key tiles that lie wholly below ``delta``. Without a forget
    gate nothing is pruned.

    Args:
        q: ``[B, T, H, D]``.
        k: ``[B, T, Hkv, D]``; v: ``[B, T, Hkv, Dv]``, H a multiple of Hkv (GQA:
            query head h reads key/value head ``h // (H / Hkv)``). One dtype for q, k, v.
        log_forget: ``[B, T, H]`` per-token log forget gate in ``[-inf, 0]`` (``-inf`` forgets everything
            before the token; NaN is refused), fp32 recommended.
        window: sliding-window size (>= 1) or None.
        scale: score scale (finite, > 0), default ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of N sequences packed along T (B == 1).
        backend: ``"auto"``, ``"reference"``, ``"sdpa"`` or ``"triton"`` (see the module).
        prune_tolerance: the softmax mass per query that pruning may drop, in (0, 1), or None (off).

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
    check_backend(op, backend, BACKENDS)
    check_prune_tolerance(op, prune_tolerance)
    if (handler := parallel.sequence_handler()) is not None:  # the sequences are split over ranks
        return handler.attention(q, k, v, log_forget=log_forget, window=window, scale=scale, cu_seqlens=cu_seqlens)
    c = None if log_forget is None else forget_cumsum(log_forget, cu_seqlens)
    for name in _candidates(backend, q):
        if name == "triton":
            reason = _triton_refusal(q, k, v)
            if reason is None:
                return _triton.flash_attention(q, k, v, c, None, cu_seqlens, scale, window, prune_tolerance)
        elif name == "sdpa":
            reason = sdpa_refusal(forget=c is not None, key_mask=False, cu_seqlens=cu_seqlens is not None,
                                  Tq=q.shape[1], Tk=k.shape[1])
            if reason is None:
                return sdpa_attention(q, k, v, scale=scale, window=window, cu_seqlens=cu_seqlens)
        if not torch.compiler.is_compiling():  # a logger call would break the compiled graph
            logger.debug("%s: backend %r cannot serve this call (%s); trying the next", op, name, reason)
    return reference_attention(q, k, v, scale=scale, cum_forget=c, window=window, cu_seqlens=cu_seqlens,
                               prune_tolerance=prune_tolerance)


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
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of the newest ``Tq`` tokens over ``Tk`` keys (a KV cache followed by the new keys).

    Query ``i`` is the token of key index ``Tk - Tq + i``; it sees keys ``j <= Tk - Tq + i``
    (and ``j > Tk - Tq + i - window``) that ``key_mask`` marks present. The forget gate
    enters as the bias ``cum_forget[query] - cum_forget[key]``. A query that sees no key
    (a padded one) gets zeros, and zero gradients.

    ``cum_forget[query]`` is the same for all keys of a query, so the softmax cancels it:
    only the keys' values matter, and any offset common to a batch row of ``cum_forget``
    cancels too. So a decoding step may pass a ring buffer in slot order: one new token
    against a ring of the last W tokens (its own key already written into its slot, empty
    slots False in ``key_mask``) is the whole ring with ``window=None``, in any order.

    On CUDA, without autograd and with at most ``DECODE_ROWS`` query rows per KV head
    (``H / Hkv * Tq``), a split-KV decoding kernel reads the cache once per step; larger calls
    take the flash kernels (their backward needs ``Tq == Tk``).

    Args:
        q: ``[B, Tq, H, D]``.
        k: ``[B, Tk, Hkv, D]``; v: ``[B, Tk, Hkv, Dv]``, Tk >= Tq, in time order.
        key_mask: ``[B, Tk]`` bool, False where there is no key (padding, an empty cache slot).
        cum_forget: ``[B, Tk, H]`` cumulative log forget value ``c_j`` of every key (any
            common offset cancels); the queries use the values of the last Tq keys.
        window: sliding-window size in key indices, or None.
        scale: score scale (finite, > 0), default ``D ** -0.5``.
        cu_seqlens: ``[N + 1]`` packed sequences (B == 1, Tq == Tk) for a masked varlen batch.
        backend: ``"auto"``, ``"reference"``, ``"sdpa"`` or ``"triton"``.

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
    Tq, Tk = q.shape[1], k.shape[1]
    if key_mask is not None:
        check_key_mask(op, key_mask, k)
    if cum_forget is not None:
        check_log_forget(op, "cum_forget", cum_forget, [q.shape[0], Tk, q.shape[2]], device=q.device,
                         nonpositive=False)
    check_window(op, window)
    scale = resolve_scale(op, scale, q.shape[-1])
    if cu_seqlens is not None:
        check_cu_seqlens(op, cu_seqlens, q, Tk)
    check_backend(op, backend, BACKENDS)
    grad = _records_grad(q, k, v, cum_forget)
    for name in _candidates(backend, q):
        if name == "triton":
            reason = _triton_refusal(q, k, v)
            rows = q.shape[2] // k.shape[2] * Tq
            if reason is None and not grad and cu_seqlens is None and rows <= DECODE_ROWS:
                return _triton.decode_attention(q, k, v, cum_forget, key_mask, scale, window)
            if reason is None and grad and Tq != Tk:
                reason = "the flash backward needs as many queries as keys"
            if reason is None:
                return _triton.flash_attention(q, k, v, cum_forget, key_mask, cu_seqlens, scale, window, None)
        elif name == "sdpa":
            reason = sdpa_refusal(forget=cum_forget is not None, key_mask=key_mask is not None,
                                  cu_seqlens=cu_seqlens is not None, Tq=Tq, Tk=Tk)
            if reason is None:
                return sdpa_attention(q, k, v, scale=scale, window=window, cu_seqlens=cu_seqlens)
        if not torch.compiler.is_compiling():  # a logger call would break the compiled graph
            logger.debug("%s: backend %r cannot serve this call (%s); trying the next", op, name, reason)
    return reference_attention(q, k, v, scale=scale, cum_forget=cum_forget, window=window, key_mask=key_mask,
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
