"""The decoding caches of a linmem model: one LayerState per layer.

Memory layers keep their fixed-size recurrent state (plus convolution / shift history), attention
layers their KV cache (a ring buffer for sliding windows), so a pure memory model decodes in constant
memory. Both caches subclass transformers' ``Cache`` so that ``generate()`` carries them from step to
step:

* :class:`LinmemCache` (dynamic): what the model makes by itself; attention buffers grow with the
  tokens seen.
* :class:`StaticLinmemCache` (``generate(..., cache_implementation="static")``): every buffer is
  allocated once, for ``max_cache_len`` tokens, and written in place; positions, per-row lengths and
  write slots live in device tensors, so a decoding step neither synchronises with the host nor
  allocates, and on CUDA it is replayed from a CUDA graph (:mod:`linmem.generation`).
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache

from ..layers import LayerState
from ..layers.attention import REBASE_EVERY, rebase_forget

#: a longer prompt runs through the model this many tokens at a time (when only its last logits are wanted). The
#: first chunk's attention is plain causal attention (flash kernels or SDPA, O(T) memory at any head dim); a later
#: chunk reads the cached keys through ``cached_attention``, whose kernels serve head dims 32 to 256 and whose
#: reference, for other head dims, holds [B, H, chunk, keys] scores: hence chunks this long
PREFILL_CHUNK = 32768


class LinmemCache(Cache):
    """Per-layer decoding state of :class:`~linmem.models.LinmemForCausalLM`.

    Example:
        >>> cache = LinmemCache(num_layers=4)
        >>> cache.get_seq_length()
        0
    """

    is_compileable = False

    def __init__(self, num_layers: int, *, prefill_chunk: int = PREFILL_CHUNK) -> None:
        super().__init__(layers=[self._new_state() for _ in range(num_layers)])
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"{type(self).__name__}: `prefill_chunk` must be an integer >= 1, got {prefill_chunk!r}")
        self.seen_tokens = 0  # tokens per row processed so far (padding included)
        self.prefill_chunk = prefill_chunk  # a longer prompt whose last logits alone are wanted runs in chunks

    def _new_state(self) -> LayerState:
        return LayerState()

    def __getitem__(self, layer_idx: int) -> LayerState:
        return self.layers[layer_idx]

    def advance(self, tokens: int, token_mask: Optional[torch.Tensor] = None) -> None:
        """Count a call of ``tokens`` tokens per row (``token_mask [B, T]``: False at padding) once every layer ran."""
        self.seen_tokens += tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes held by every tensor of the cache."""
        return sum(state.nbytes() for state in self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for state in self.layers:
            state.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for state in self.layers:
            state.repeat_batch(repeats)

    def reset(self) -> None:
        self.layers = [self._new_state() for _ in self.layers]
        self.seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a recurrent state cannot be cropped back to an earlier length; re-run the prefix instead")

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        return False

    def __repr__(self) -> str:
        name, layers = type(self).__name__, len(self.layers)
        return f"{name}(seen_tokens={self.seen_tokens}, layers={layers}, bytes={self.nbytes()})"


class StaticLinmemCache(LinmemCache):
    """A decoding cache of fixed size: buffers allocated once (on the first call), then written in place.

    Everything a decoding step changes lives on the device: ``position [1]`` (tokens written per
    row, padding included: the KV write slot), ``lengths [B]`` (real tokens per row: the rotary
    position of the next token, so left-padded prompts decode as if alone). A one-token step through
    :meth:`~linmem.models.LinmemForCausalLM.forward` is therefore the same work at every step: on CUDA
    it is captured once and replayed from a CUDA graph (:class:`linmem.generation.GraphDecoder`); on
    CPU it runs eagerly. Attention layers read their whole buffers at every step (empty slots masked),
    as transformers' static cache does. Prompts longer than ``prefill_chunk`` are run in chunks.

    ``generate(..., cache_implementation="static")`` builds one sized for the prompt and
    ``max_new_tokens``. A model built on the meta device has no cache to hold.

    Args:
        num_layers: layers of the model.
        batch_size: rows B (a cache serves this batch size only).
        max_cache_len: tokens per row it holds at most (prompt, padding included, plus generated).
        device: where the buffers live.
        prefill_chunk: a longer prompt runs through the model this many tokens at a time.

    Example:
        >>> cache = StaticLinmemCache(2, batch_size=3, max_cache_len=64, device="cpu")
        >>> cache.get_max_length(), cache.lengths.tolist()
        (64, [0, 0, 0])
    """

    def __init__(self, num_layers: int, *, batch_size: int, max_cache_len: int, device: torch.device | str,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        for name, value in (("batch_size", batch_size), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StaticLinmemCache: `{name}` must be an integer >= 1, got {value!r}")
        device = torch.device(device)
        self.capacity = max_cache_len
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.decoder = None  # set by the first decoding step: its CUDA-graph runner (GraphDecoder), or False: eager
        super().__init__(num_layers, prefill_chunk=prefill_chunk)

    def _new_state(self) -> LayerState:
        return LayerState(capacity=self.capacity, position=self.position)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def advance(self, tokens: int, token_mask: Optional[torch.Tensor] = None) -> None:
        self.advance_device(tokens, token_mask)
        self.advance_host(tokens)

    def advance_device(self, tokens: int, token_mask: Optional[torch.Tensor] = None) -> None:
        """The device half of :meth:`advance` (what a captured step replays): position and lengths."""
        self.position.add_(tokens)
        self.lengths.add_(tokens if token_mask is None else token_mask.sum(-1))

    def advance_host(self, tokens: int) -> None:
        """The host half of :meth:`advance` (what a replayed step leaves to the host): the token counts of
        the cache and of every layer, and FoX's re-basing every :data:`REBASE_EVERY` tokens."""
        before = self.seen_tokens
        self.seen_tokens += tokens
        for state in self.layers:
            state.seen_tokens = self.seen_tokens
            if self.seen_tokens // REBASE_EVERY > before // REBASE_EVERY:
                rebase_forget(state)

    def check_room(self, tokens: int) -> None:
        """Refuse a call that would take the cache past ``max_cache_len`` tokens per row."""
        if self.seen_tokens + tokens > self.capacity:
            raise ValueError(f"StaticLinmemCache holds {self.capacity} tokens per row and has {self.seen_tokens}; "
                             f"{tokens} more do not fit: build it with a larger `max_cache_len`")

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def nbytes(self) -> int:
        return super().nbytes() + sum(t.numel() * t.element_size() for t in (self.position, self.lengths))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.lengths.copy_(self.lengths.index_select(0, beam_idx.to(self.lengths.device)))

    def reset(self) -> None:
        """Empty the cache in place: its buffers (and any captured decoding graphs) stay valid."""
        for state in self.layers:
            state.zero_()
        self.position.zero_()
        self.lengths.zero_()
        self.seen_tokens = 0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (their storage never moves after the first call)."""
        return [self.position, self.lengths] + [t for state in self.layers for t in state.tensors.values()]
