"""Linearize a pretrained Llama-family checkpoint into a Liger model (a :class:`LinmemForCausalLM` folder).

Every layer's softmax attention becomes Liger Attention (:mod:`linmem.layers.liger`) over the same
projections; with ``keep_attention=N`` every N-th layer stays full softmax attention (Liger-H). The
model reuses every pretrained tensor and adds none (the gate is pooled from the key projection);
only the ablations ``gate="projection"`` and ``feature_map="learnable"`` add parameters, which start
from ``seed``. Everything is checked before the output folder is created: an unsupported checkpoint,
shape or option is refused with a named error and nothing is written.

Example:
    >>> result = linearize("checkpoints/llama", "checkpoints/liger-gla", LinearizeOptions(memory="gla"))  # doctest: +SKIP
    >>> from transformers import AutoModelForCausalLM; import linmem  # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained("checkpoints/liger-gla")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from ..layers.base import check_choice, check_float, check_int
from ..layers.liger import LIGER_FEATURE_MAPS, LIGER_GATES, LIGER_MEMORIES
from ..models import LinmemConfig, LinmemForCausalLM
from .checkpoint import Architecture, UnsupportedCheckpointError, architecture, read_weights
from .mapping import map_weights

logger = logging.getLogger("linmem.linearize")

#: tokenizer and generation files copied from the source folder when present
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
#: what linearize records about a conversion in the output folder
RECORD = "linearize.json"


@dataclass
class LinearizeOptions:
    """How a checkpoint becomes a Liger model."""

    memory: str = "gla"  # the gated recurrence of Liger Attention: one of LIGER_MEMORIES
    window: int = 64  # keys the sliding-window branch of Liger Attention sees
    keep_attention: int = 0  # every N-th layer (N, 2N, ...) stays full attention (Liger-H); 0: none
    memory_weight: float = 0.5  # weight of the memory read-out (the window's: 1 - it)
    gate: str = "pooled_key"  # pooled_key, or projection (a new random gate map: Table 6 ablation)
    feature_map: str = "softmax"  # softmax, or learnable (Table 6 ablation)
    slots: Optional[int] = None  # memory="gsa": slots per head (default the head dim)
    seed: int = 0  # initialisation of the parameters an ablation adds

    def validate(self) -> None:
        owner = "linearize"
        check_choice(owner, "memory", self.memory, LIGER_MEMORIES)
        check_int(owner, "window", self.window, minimum=1)
        check_int(owner, "keep_attention", self.keep_attention, minimum=0)
        check_float(owner, "memory_weight", self.memory_weight, minimum=0.0, inclusive=True)
        if self.memory_weight > 1:
            raise ValueError(f"{owner}: `memory_weight` must lie in [0, 1], got {self.memory_weight}")
        check_choice(owner, "gate", self.gate, LIGER_GATES)
        check_choice(owner, "feature_map", self.feature_map, LIGER_FEATURE_MAPS)
        check_int(owner, "slots", self.slots, minimum=1, optional=True)
        check_int(owner, "seed", self.seed, minimum=0)


@dataclass
class LinearizeResult:
    """What a conversion wrote."""

    out: Path
    family: str  # the source's model_type
    layer_pattern: str  # L: Liger Attention, N: full attention
    pretrained_parameters: int  # tensors' elements in the source (a tied embedding once)
    parameters: int  # of the converted model
    new_parameters: list[str] = field(default_factory=list)  # names of the parameters an ablation added


def layer_pattern(num_layers: int, keep_attention: int) -> str:
    """``L`` (Liger Attention) per layer, ``N`` (full attention) for every ``keep_attention``-th layer.

    Example:
        >>> layer_pattern(8, 4)
        'LLLNLLLN'
    """
    return "".join("N" if keep_attention and (i + 1) % keep_attention == 0 else "L" for i in range(num_layers))


def liger_config(arch: Architecture, options: LinearizeOptions) -> LinmemConfig:
    """The LinmemConfig of the converted model: the pretrained architecture with Liger Attention."""
    return LinmemConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, num_heads=arch.num_heads,
        layer_pattern=layer_pattern(arch.num_layers, options.keep_attention),
        memory="liger", attention="llama_attention", intermediate_size=arch.intermediate_size,
        rms_norm_eps=arch.rms_norm_eps, tie_word_embeddings=arch.tie_word_embeddings,
        initializer_range=arch.initializer_range, **arch.special_tokens,
        mixer=dict(num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, rope_theta=arch.rope_theta,
                   qk_norm=arch.qk_norm, window=arch.sliding_window),
        llama_attention=dict(qkv_bias=arch.qkv_bias, o_bias=arch.o_bias, rope_scaling_params=arch.rope_scaling),
        liger=dict(memory=options.memory, window=options.window, memory_weight=options.memory_weight,
                   gate=options.gate, feature_map=options.feature_map, num_slots=options.slots),
    )


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder; give a new one")


def build_model(source: Path, config: LinmemConfig, seed: int) -> tuple[LinmemForCausalLM, int, list[str]]:
    """The converted model holding the pretrained tensors: (model, pretrained elements, added parameter names).

    Built on the meta device and filled with the checkpoint's tensors as they are (dtype kept); the
    parameters an ablation adds are initialised from ``seed``. A tensor the model has no place for, a
    shape that differs or a parameter the checkpoint lacks is refused, naming it.
    """
    state = map_weights(read_weights(source))
    pretrained = sum(t.numel() for n, t in state.items() if not (config.tie_word_embeddings and n == "lm_head.weight"))
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    with torch.device("meta"):
        model = LinmemForCausalLM(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    extra = sorted(set(state) - set(expected))
    if extra:
        raise UnsupportedCheckpointError(f"{source}: tensor {extra[0]!r} has no place in the converted model")
    for name, tensor in state.items():
        if tensor is None or tuple(tensor.shape) != expected[name]:
            got = None if tensor is None else list(tensor.shape)
            raise UnsupportedCheckpointError(f"{source}: {name} has shape {got}, the model expects "
                                             f"{list(expected[name])}")
    added = sorted(set(expected) - set(state))
    ablation = [n for n in added if ".mixer.gate_proj." in n or ".mixer.feature_map." in n]
    if added != ablation:
        raise UnsupportedCheckpointError(f"{source}: the checkpoint lacks {sorted(set(added) - set(ablation))[0]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    dtype = state["model.embed_tokens.weight"].dtype
    torch.manual_seed(seed)
    for module_name in sorted({n.rsplit(".", 1)[0] for n in ablation}):
        module = model.get_submodule(module_name)
        module.to_empty(device="cpu")
        module.reset_parameters()
        module.to(dtype)
    return model, pretrained, ablation


def linearize(source: Union[str, Path], out: Union[str, Path], options: Optional[LinearizeOptions] = None
              ) -> LinearizeResult:
    """Convert the local checkpoint ``source`` into a Liger model written to ``out`` (new or empty).

    ``out`` then holds a LinmemForCausalLM (``AutoModelForCausalLM.from_pretrained(out)`` after
    ``import linmem``), the source's tokenizer and generation files, and ``linearize.json`` (the
    options and parameter counts). Raises :class:`UnsupportedCheckpointError` (an unsupported family,
    shape or option) or ``ValueError`` (an option out of range, an ``out`` folder in use) before writing.
    """
    source, out = Path(source), Path(out)
    options = options or LinearizeOptions()
    options.validate()
    _check_out(out)
    arch = architecture(source)
    try:
        config = liger_config(arch, options)
    except ValueError as err:
        raise UnsupportedCheckpointError(f"{source}: {err}") from err
    model, pretrained, added = build_model(source, config, options.seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    result = LinearizeResult(out=out, family=arch.family, layer_pattern=config.layer_pattern,
                             pretrained_parameters=pretrained, parameters=model.num_all_parameters(),
                             new_parameters=added)
    record = {"source": str(source.resolve()), "options": asdict(options),
              **{k: v for k, v in asdict(result).items() if k != "out"}}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    logger.info("linearized %s (%s) into %s: pattern %s, %d parameters (%d pretrained)", source, arch.family, out,
                config.layer_pattern, result.parameters, pretrained)
    return result
