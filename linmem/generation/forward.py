"""The causal LM's forward when it generates: chunked prefill, the static cache's decoding step, and the
cache ``generate()`` builds.

:func:`generation_forward` is the first thing :meth:`~linmem.models.LinmemForCausalLM.forward` does: it
serves the calls of generation (a prompt against a cache, one token against a static cache) and leaves
every other call (training, a loss, hidden states, packed sequences) to the ordinary forward, which calls it only
when there is no loss to compute.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..models.cache import PREFILL_CHUNK, LinmemCache, StaticLinmemCache
from ..models.outputs import CACHE_NAME, LinmemCausalLMOutput
from .step import GraphDecoder, decode_step, graph_refusal

logger = logging.getLogger("linmem.generation")


def generation_forward(
    model: nn.Module,
    *,
    input_ids: Optional[torch.Tensor],
    inputs_embeds: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    cache: Optional[LinmemCache],
    use_cache: Optional[bool],
    cu_seqlens: Optional[torch.Tensor],
    output_hidden_states: bool,
    output_router_logits: Optional[bool],
    logits_to_keep: int,
):
    """The output of a generation call of ``model`` (a ``LinmemForCausalLM``), or None for the ordinary forward.

    Served here, without autograd:

    * one token per row against a :class:`StaticLinmemCache` (``input_ids [B, 1]``): the decoding step,
      replayed from a CUDA graph on CUDA (:class:`~linmem.generation.step.GraphDecoder`) and run eagerly
      elsewhere or where the model cannot be captured (the reason is logged at debug level). The token counts
      as real, as ``generate()`` feeds it; the rows' positions are ``position_ids`` (``[B, 1]``, what
      ``generate()`` passes) or, without them, the cache's.
    * a prompt longer than the cache's ``prefill_chunk`` of which only the last ``logits_to_keep`` > 0
      logits are wanted: :func:`chunked_prefill` (a dynamic cache is made when none is given).

    Arguments are those of :meth:`~linmem.models.LinmemForCausalLM.forward` (which computes a loss itself).
    """
    if (torch.is_grad_enabled() or model.training or cu_seqlens is not None or output_hidden_states
            or output_router_logits or use_cache is False):
        return None
    given = input_ids if input_ids is not None else inputs_embeds
    if given is None or given.dim() < 2:
        return None  # the ordinary forward names the problem
    T = given.shape[1]
    if isinstance(cache, StaticLinmemCache):
        cache.check_room(T)
        if T == 1 and input_ids is not None:
            return _output(model, static_step(model, input_ids, cache, position_ids), cache)
    if logits_to_keep:
        chunk = cache.prefill_chunk if cache is not None else PREFILL_CHUNK
        if T > chunk:
            if cache is None:
                cache = LinmemCache(model.config.num_hidden_layers)
            return chunked_prefill(model, input_ids=input_ids, inputs_embeds=inputs_embeds,
                                   attention_mask=attention_mask, cache=cache, logits_to_keep=logits_to_keep,
                                   position_ids=position_ids)
    return None


def static_step(model: nn.Module, input_ids: torch.Tensor, cache: StaticLinmemCache,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``input_ids [B, 1]`` (at ``position_ids [B, 1]``, default: the cache's) -> ``logits [B, 1, vocab]`` against
    a static cache: from a CUDA graph when the model can be captured (the cache keeps its :class:`GraphDecoder`),
    else eagerly."""
    if input_ids.shape[0] != cache.batch_size:
        raise ValueError(f"the static cache serves batch size {cache.batch_size}, got `input_ids` of shape "
                         f"{list(input_ids.shape)}")
    if cache.decoder is None:
        reason = graph_refusal(model, cache)
        if reason is None:
            cache.decoder = GraphDecoder(model, cache)
        else:
            logger.debug("static cache: decoding eagerly (%s)", reason)
            cache.decoder = False
    if cache.decoder:
        return cache.decoder.step(cache, input_ids, position_ids)
    logits = decode_step(model, input_ids, cache, position_ids)
    cache.advance_host(1)
    return logits


def chunked_prefill(
    model: nn.Module,
    *,
    input_ids: Optional[torch.Tensor],
    inputs_embeds: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    cache: LinmemCache,
    logits_to_keep: int,
    position_ids: Optional[torch.Tensor] = None,
):
    """Run a prompt through ``model`` ``cache.prefill_chunk`` tokens at a time; logits of its last positions.

    Equal to one pass of the whole prompt (every layer continues from the cache), but no call holds
    more than one chunk's activations, and the vocabulary projection sees only the last
    ``logits_to_keep`` positions.

    Args:
        model: a ``LinmemForCausalLM`` in eval mode.
        input_ids: ``[B, T]`` (or ``inputs_embeds [B, T, D]``).
        attention_mask: ``[B, past + T]`` 1 = token, 0 = padding, or None.
        cache: the cache the prompt continues (``past`` tokens already in it).
        logits_to_keep: how many of the last positions get logits (>= 1).
        position_ids: ``[B or 1, T]`` the prompt's positions, or None (from the mask and the cache).

    Returns:
        The model's output: ``logits [B, min(logits_to_keep, T), vocab]`` and the cache.

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> model = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=32, num_heads=2, layer_pattern="LN"))
        >>> cache = LinmemCache(2, prefill_chunk=4)
        >>> with torch.no_grad():
        ...     out = chunked_prefill(model.eval(), input_ids=torch.randint(0, 32, (2, 10)), inputs_embeds=None,
        ...                           attention_mask=None, cache=cache, logits_to_keep=1)
        >>> out.logits.shape, cache.get_seq_length()
        (torch.Size([2, 1, 32]), 10)
    """
    given = input_ids if input_ids is not None else inputs_embeds
    T, chunk = given.shape[1], cache.prefill_chunk
    end_of_mask = attention_mask.shape[1] if attention_mask is not None else None
    kept = []  # hidden states of the last logits_to_keep positions
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        part = {"input_ids": input_ids[:, start:end]} if input_ids is not None else \
            {"inputs_embeds": inputs_embeds[:, start:end]}
        mask = attention_mask[:, :end_of_mask - (T - end)] if attention_mask is not None else None
        positions = position_ids[:, start:end] if position_ids is not None else None
        out = model.model(**part, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                          return_dict=True)
        if end > T - logits_to_keep:
            kept.append(out.last_hidden_state[:, max(T - logits_to_keep - start, 0):])
    return _output(model, model.lm_head(torch.cat(kept, 1)), cache)


def _output(model: nn.Module, logits: torch.Tensor, cache: LinmemCache):
    return LinmemCausalLMOutput(logits=logits, **{CACHE_NAME: cache})


def prepare_generation_cache(model: nn.Module, generation_config, model_kwargs: dict, batch_size: int,
                             max_cache_length: int) -> None:
    """Put ``generate()``'s cache into ``model_kwargs`` (transformers' ``_prepare_cache_for_generation``).

    A cache the caller passed is kept. ``cache_implementation="static"`` builds a
    :class:`StaticLinmemCache` of ``max_cache_length`` tokens for every returned sequence (beams and
    ``num_return_sequences`` included); None or ``"dynamic"`` leaves the model to make its
    :class:`LinmemCache`; any other value is refused.
    """
    implementation = generation_config.cache_implementation
    given = model_kwargs.get(CACHE_NAME)
    if given is not None:
        if implementation is not None:
            raise ValueError("give either `cache_implementation` or a cache object to generate(), not both")
        given._is_user_defined = True  # transformers' mark of a cache that outlives generate()
        return
    if generation_config.use_cache is False or implementation in (None, "dynamic"):
        return
    if implementation != "static":
        raise ValueError(f"linmem models support cache_implementation 'static' or 'dynamic', got {implementation!r}")
    rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
    model_kwargs[CACHE_NAME] = StaticLinmemCache(model.config.num_hidden_layers, batch_size=rows,
                                                 max_cache_len=max_cache_length, device=model.device)
