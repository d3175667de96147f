"""What linmem models return: their output dataclasses and the name of the decoding cache in them.

A leaf below :mod:`linmem.models.modeling` and :mod:`linmem.generation`, which both build these outputs.
The decoding cache is passed and returned under the name the installed transformers gives it
(:data:`CACHE_NAME`: ``cache`` from 5.x, ``past_key_values`` before).

Example:
    >>> output_cache(LinmemCausalLMOutput(**{CACHE_NAME: None})) is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..ops.routing import RouterStats
from .cache import LinmemCache

#: the name of the decoding cache in the model's inputs and outputs, as the installed transformers calls it
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class LinmemModelOutput(BaseModelOutputWithPast):
    """BaseModelOutputWithPast plus the reports of the routed layers, in layer order."""

    router_stats: Optional[tuple[RouterStats, ...]] = None


@dataclass
class LinmemCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus what the routers (MoM mixers, MoE feed-forwards) report."""

    aux_loss: Optional[torch.FloatTensor] = None  # weighted balancing + z losses (already inside `loss`)
    router_logits: Optional[tuple[torch.FloatTensor, ...]] = None  # per routed layer [B * T, E]
    router_stats: Optional[tuple[RouterStats, ...]] = None  # per routed layer: losses and load


def output_cache(output: BaseModelOutputWithPast) -> Optional[LinmemCache]:
    """The decoding cache of a model output, whatever transformers calls it."""
    return getattr(output, CACHE_NAME)
