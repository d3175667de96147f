"""The decoding cache of a linmem model: one LayerState per layer.

Memory layers keep their fixed-size recurrent state (plus convolution / shift
history), attention layers their KV cache (a ring buffer for sliding windows), so a
pure memory model decodes in constant memory. It subclasses transformers' ``Cache``
so that ``generate()`` carries it from step to step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..layers import LayerState


class LinmemCache(Cache):
    """Per-layer decoding state of :class:`~linmem.models.LinmemForCausalLM`.

    Example:
        >>> cache = LinmemCache(num_layers=4)
        >>> cache.get_seq_length()
        0
    """

    is_compileable = False

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[LayerState() for _ in range(num_layers)])
        self.seen_tokens = 0  # tokens per row processed so far (padding included)

    def __getitem__(self, layer_idx: int) -> LayerState:
        return self.layers[layer_idx]

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
        self.layers = [LayerState() for _ in self.layers]
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
        return f"LinmemCache(seen_tokens={self.seen_tokens}, layers={len(self.layers)}, bytes={self.nbytes()})"
