"""The weight mapping from a Llama-family checkpoint to :class:`~linmem.models.LinmemForCausalLM`.

Every pretrained tensor has one place; nothing is changed but the feed-forward's gate and up
projections, which linmem keeps as one matrix (``gate_up = [gate; up]``, rows stacked)::

    model.embed_tokens.weight                         -> model.embed_tokens.weight
    model.layers.i.input_layernorm.weight             -> model.layers.i.mixer_norm.weight
    model.layers.i.self_attn.{q,k,v,o}_proj.{weight,bias}
                                                      -> model.layers.i.mixer.{q,k,v,o}_proj.{weight,bias}
    model.layers.i.self_attn.{q,k}_norm.weight        -> model.layers.i.mixer.{q,k}_norm.weight   (Qwen3)
    model.layers.i.post_attention_layernorm.weight    -> model.layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up}_proj.weight          -> model.layers.i.mlp.gate_up.weight
    model.layers.i.mlp.down_proj.weight               -> model.layers.i.mlp.down.weight
    model.norm.weight, lm_head.weight                 -> the same names

Rotary ``inv_freq`` buffers some older checkpoints store are dropped (the layers compute them).
A tensor with no place is refused with :class:`UnsupportedCheckpointError` naming it.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from .checkpoint import UnsupportedCheckpointError

#: pretrained name -> linmem name, for every tensor copied as it is
RENAMES = (
    (re.compile(r"model\.layers\.(\d+)\.input_layernorm\.weight"), r"model.layers.\1.mixer_norm.weight"),
    (re.compile(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight"), r"model.layers.\1.mlp_norm.weight"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkvo]_proj\.(?:weight|bias))"), r"model.layers.\1.mixer.\2"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.([qk]_norm\.weight)"), r"model.layers.\1.mixer.\2"),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.down_proj\.weight"), r"model.layers.\1.mlp.down.weight"),
    (re.compile(r"(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight)"), r"\1"),
)
#: the feed-forward projections stacked into gate_up (in this order)
GATE_UP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight")
#: tensors some checkpoints store that the model computes
DROPPED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def linmem_name(name: str) -> str:
    """The linmem name of a pretrained tensor copied as it is (not gate/up: see :func:`map_weights`).

    Example:
        >>> linmem_name("model.layers.3.self_attn.k_proj.bias")
        'model.layers.3.mixer.k_proj.bias'
    """
    for pattern, target in RENAMES:
        if pattern.fullmatch(name):
            return pattern.sub(target, name)
    raise UnsupportedCheckpointError(f"tensor {name!r} has no place in a linmem model")


def map_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pretrained (name, tensor) pairs -> the linmem state dict (tensors shared, gate/up stacked).

    Example:
        >>> w = {"model.layers.0.mlp.gate_proj.weight": torch.ones(2, 3), "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 3)}
        >>> map_weights(w.items())["model.layers.0.mlp.gate_up.weight"].shape
        torch.Size([4, 3])
    """
    state: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if DROPPED.fullmatch(name):
            continue
        stacked = GATE_UP.fullmatch(name)
        if stacked:
            halves.setdefault(stacked.group(1), {})[stacked.group(2)] = tensor
            continue
        state[linmem_name(name)] = tensor
    for layer, parts in halves.items():
        if set(parts) != {"gate", "up"}:
            lacking = ({"gate", "up"} - set(parts)).pop()
            raise UnsupportedCheckpointError(f"layer {layer} has no mlp.{lacking}_proj.weight")
        state[f"model.layers.{layer}.mlp.gate_up.weight"] = torch.cat([parts["gate"], parts["up"]], dim=0)
    return state
