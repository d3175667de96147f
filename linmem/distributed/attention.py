"""Sequence parallelism for the softmax-attention layers of hybrids: gathered keys, local queries.

Each rank keeps its piece of the queries and attends over the keys and values its first sequence
has up to its last token: the keys of earlier ranks (all of them for full causal attention, only
the last ``window - 1`` for a sliding window) followed by its own. Query ``i`` of the piece then
sits at key index ``P + i`` (``P`` the earlier keys), which is exactly the layout of
:func:`linmem.ops.attention.cached_attention`. For the forgetting gate (FoX) the score bias is
``c_i - c_j`` with ``c`` the cumulative log forget gate of the sequence; only differences enter, so
``c`` is summed from the first gathered key on (any common offset cancels). Gradients of the
gathered keys, values and gates flow back to their ranks through the all-gather's reduce-scatter.
RoPE is applied before, with global positions (the batch sharding gives them).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch.distributed import ProcessGroup

from ..ops import parallel
from ..ops.attention import cached_attention, forgetting_attention
from ..ops.attention.inputs import check_qkv, check_window
from .collectives import all_gather, group_rank, tie
from .sequence import PieceLayout

__all__ = ["sp_attention"]


def sp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup,
    log_forget: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    prefix_length: Optional[int] = None,
    layout: Optional[PieceLayout] = None,
) -> torch.Tensor:
    """:func:`linmem.ops.attention.forgetting_attention` of sequences split along time over ``group``.

    Args:
        q: ``[B, T, H, D]`` this rank's piece of the queries (every rank holds T tokens).
        k: ``[B, T, Hkv, D]``; v: ``[B, T, Hkv, Dv]``; log_forget: ``[B, T, H]`` or None; window, scale:
            as in ``forgetting_attention``.
        group: the sequence-parallel process group; pieces follow the ranks' order in it.
        cu_seqlens: ``[N + 1]`` local boundaries of packed segments (B == 1).
        prefix_length: with ``cu_seqlens``, the tokens of this rank's first sequence on earlier ranks
            (0 when it starts here); without, every rank after the first continues all rows.
        layout: the :class:`~linmem.distributed.sequence.PieceLayout` when the caller has it.

    Returns:
        ``o: [B, T, H, Dv]``, this rank's piece of the one-process output.

    Example (on every rank of a sequence-parallel group):
        >>> o = sp_attention(q, k, v, group=sp_group, window=256)  # doctest: +SKIP
    """
    op = "sp_attention"
    if group is None:
        raise TypeError(f"{op}: `group` must be a process group (the sequence-parallel ranks), got None")
    check_qkv(op, q, k, v, same_length=True)
    check_window(op, window)
    B, T = q.shape[:2]
    if layout is None:
        layout = PieceLayout.of(group, T, B, cu_seqlens, prefix_length, op)
    rank = group_rank(group)

    # the earlier keys this rank needs: a window needs only the previous rank's tail when it fits there
    need = layout.prefix_length if window is None else min(window - 1, layout.prefix_length)
    reach = window - 1 if window is not None and window - 1 <= T else T  # tokens every rank contributes
    D = k.shape[-1]
    gathered = gathered_forget = None
    if reach:
        gathered = all_gather(torch.cat([k, v], dim=-1)[:, T - reach:], group)  # [world, B, reach, Hkv, D + Dv]
        gathered_forget = None if log_forget is None else all_gather(log_forget[:, T - reach:], group)
    if need == 0:  # nothing earlier to see; the gathers still take part in the backward
        with parallel.local_ops():
            o = forgetting_attention(q, k, v, log_forget=log_forget, window=window, scale=scale,
                                     cu_seqlens=cu_seqlens)
        return tie(o, gathered, gathered_forget)

    def before(x: torch.Tensor) -> torch.Tensor:  # [world, B, reach, ...] -> the `need` tokens before this rank
        stream = rearrange(x[:rank], "r b t ... -> b (r t) ...")
        return stream[:, stream.shape[1] - need:]

    L0 = layout.first_length
    prefix = before(gathered)
    k0 = torch.cat([prefix[..., :D], k[:, :L0]], dim=1)
    v0 = torch.cat([prefix[..., D:], v[:, :L0]], dim=1)
    cum = None
    if log_forget is not None:  # c_j from the first gathered key on; only differences matter
        gates = torch.cat([before(gathered_forget), log_forget[:, :L0]], dim=1)
        cum = gates.to(torch.float64 if gates.dtype == torch.float64 else torch.float32).cumsum(1)
    with parallel.local_ops():
        if cum is None and window is None:
            o = causal_attention_lower_right(q[:, :L0], k0, v0, scale=scale)
        else:
            o = cached_attention(q[:, :L0], k0, v0, cum_forget=cum, window=window, scale=scale)
        if layout.varlen and L0 < T:  # the segments that start on this rank
            rest = forgetting_attention(
                q[:, L0:], k[:, L0:], v[:, L0:], log_forget=None if log_forget is None else log_forget[:, L0:],
                window=window, scale=scale, cu_seqlens=cu_seqlens[1:] - L0)
            o = torch.cat([o, rest], dim=1)
    return o


def causal_attention_lower_right(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None
) -> torch.Tensor:
    """Causal softmax attention of the last ``Tq`` of ``Tk`` keys without a materialised mask.

    q: ``[B, Tq, H, D]``, k: ``[B, Tk, Hkv, D]``, v: ``[B, Tk, Hkv, Dv]`` -> ``[B, Tq, H, Dv]``; query i sees
    keys ``j <= Tk - Tq + i`` (what ``cached_attention`` computes without ``key_mask``, window or
    forget gate), through PyTorch's lower-right causal bias so that the flash kernels serve it.
    """
    from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: only when used

    H, Hkv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh = rearrange(q, "b t h d -> b h t d")
    kh, vh = (repeat(x, "b t h d -> b (h g) t d", g=H // Hkv) for x in (k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(q.shape[1], k.shape[1]), scale=scale)
    return rearrange(o, "b h t d -> b t h d")
