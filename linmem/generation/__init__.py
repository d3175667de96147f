"""Fast generation: a static cache, CUDA-graph decoding, chunked prefill.

``model.generate(ids, cache_implementation="static")`` decodes against a
:class:`~linmem.models.cache.StaticLinmemCache`: every buffer is allocated once and written in place,
and a decoding step (:func:`decode_step`) reads whatever changes between steps from device tensors,
so on CUDA it is captured once and replayed from a CUDA graph (:class:`GraphDecoder`). A prompt
longer than the cache's ``prefill_chunk`` runs in chunks (:func:`chunked_prefill`) whatever the
cache. :func:`generation_forward` routes the model's forward to these; see ``docs/generation.md``.
"""

from .forward import chunked_prefill, generation_forward, prepare_generation_cache, static_step
from .step import GraphDecoder, decode_step, graph_refusal

__all__ = ["GraphDecoder", "chunked_prefill", "decode_step", "generation_forward", "graph_refusal",
           "prepare_generation_cache", "static_step"]
