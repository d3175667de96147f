"""The one-token decoding step against a static cache, and its CUDA-graph runner.

A step is the model's forward for one token per row with everything that changes between steps read
from device tensors: the token from a fixed input buffer, the rotary positions from another (the cache's
per-row ``lengths``, or the ``position_ids`` that ``generate()`` passes), the attention write slots from the
cache's ``position``. It never synchronises with the
host and, once the cache's buffers exist, allocates nothing that outlives it, so CUDA can capture it
once and replay it. The host's share (the token counts, FoX's re-basing) runs after each step in
:meth:`~linmem.models.cache.StaticLinmemCache.advance_host`.
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from torch import nn

from ..layers.mom import MixtureOfMemories
from ..layers.moe import MoEFeedForward
from ..models.cache import StaticLinmemCache

logger = logging.getLogger("linmem.generation")


def decode_step(model: nn.Module, input_ids: torch.Tensor, cache: StaticLinmemCache,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row through ``model`` (a :class:`~linmem.models.LinmemForCausalLM`) against ``cache``.

    Args:
        model: the causal LM.
        input_ids: ``[B, 1]`` the newest token of every row (a real token, as ``generate()`` feeds).
        cache: the static cache, after its prefill.
        position_ids: ``[B, 1]`` (or ``[1, 1]``) the token's positions; default: the real tokens before it in
            its row (``cache.lengths``), what ``generate()`` passes as well.

    Returns:
        ``logits [B, 1, vocab]``. The cache's device counters have advanced by one token; the caller
        advances the host's (``cache.advance_host(1)``).

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> model = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=32, num_heads=2, layer_pattern="LN"))
        >>> cache = StaticLinmemCache(2, batch_size=1, max_cache_len=8, device="cpu")
        >>> with torch.no_grad():
        ...     _ = model.eval()(torch.tensor([[1, 2, 3]]), cache=cache)
        ...     decode_step(model, torch.tensor([[4]]), cache).shape
        torch.Size([1, 1, 32])
    """
    body = model.model
    hidden = body.embed_tokens(input_ids)
    positions = cache.lengths[:, None] if position_ids is None else position_ids  # [B, 1] the rotary positions
    residual = None  # the stream is residual + hidden, as in the model's forward
    for layer, state in zip(body.layers, cache.layers):
        hidden, residual = layer(hidden, residual, cu_seqlens=None, cache=state, token_mask=None,
                                 position_ids=positions)
        layer.pop_router_stats()
    logits = model.lm_head(body.norm.add_and_norm(hidden, residual)[0])
    cache.advance_device(1)
    return logits


def graph_refusal(model: nn.Module, cache: StaticLinmemCache) -> Optional[str]:
    """None when the decoding step of ``model`` can be captured in a CUDA graph against ``cache``, else why not."""
    routed = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (MixtureOfMemories, MoEFeedForward))})
    if routed:
        return f"{', '.join(routed)} route tokens with data-dependent shapes, which synchronise with the host"
    if cache.position.device.type != "cuda":
        return f"the cache is on {cache.position.device.type}, CUDA graphs need a CUDA device"
    return None


class GraphDecoder:
    """Decoding steps of ``model`` against one static cache, replayed from a CUDA graph.

    Every step is the same work on the same tensors, so one graph serves them all: the first step runs
    eagerly (its kernels compile and warm up), the second captures the step, and it and every later
    one replay it. The logits returned are a copy, so they outlive the next step. The cache keeps its
    decoder (``cache.decoder``); the decoder holds no reference to the cache, only to its tensors
    through the graph, so both go when the cache goes.

    Example (CUDA only):
        >>> cache.decoder = GraphDecoder(model, cache)  # doctest: +SKIP
        >>> logits = cache.decoder.step(cache, next_tokens[:, None])  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, cache: StaticLinmemCache) -> None:
        reason = graph_refusal(model, cache)
        if reason is not None:
            raise ValueError(f"GraphDecoder: cannot capture this model's decoding step: {reason}")
        self.model = model
        self.owner = weakref.ref(cache)
        self.input_ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=cache.position.device)
        self.positions = torch.zeros_like(self.input_ids)  # the step's rotary positions, copied in before each step
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None  # the graph's output
        self.warm = False  # a step ran eagerly

    def step(self, cache: StaticLinmemCache, input_ids: torch.Tensor,
             position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``input_ids [B, 1]`` (at ``position_ids [B, 1]``, default: ``cache.lengths``) -> ``logits [B, 1, vocab]``,
        advancing ``cache`` (the decoder's own) by one token."""
        if self.owner() is not cache:
            raise ValueError("GraphDecoder.step: this decoder was built for another cache")
        cache.check_room(1)
        self.input_ids.copy_(input_ids)
        self.positions.copy_(cache.lengths[:, None] if position_ids is None else position_ids)
        if not self.warm:
            logits = decode_step(self.model, self.input_ids, cache, self.positions)
            self.warm = True
        else:
            if self.graph is None:
                self._capture(cache)
            self.graph.replay()
            logits = self.logits.clone()
        cache.advance_host(1)
        return logits

    def _capture(self, cache: StaticLinmemCache) -> None:
        """Record the step. Capturing runs no kernel: the host-side token counts the layers move while it
        is recorded are put back."""
        counts = [state.seen_tokens for state in cache.layers]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = decode_step(self.model, self.input_ids, cache, self.positions)
        for state, count in zip(cache.layers, counts):
            state.seen_tokens = count
        self.graph = graph
        logger.debug("GraphDecoder: captured the decoding step (batch %d, %d cached tokens at most)",
                     cache.batch_size, cache.capacity)
