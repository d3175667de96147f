"""Reading a local Hugging Face checkpoint of a Llama-family model: its ``config.json`` and its weights.

Only local folders are read (nothing is downloaded). Weights come from ``model.safetensors``, sharded
``model-*.safetensors`` (with ``model.safetensors.index.json``) or, failing those, ``pytorch_model*.bin``
read with ``weights_only=True``. The family and every option of the architecture are checked here,
before any weight is read: a checkpoint linearize cannot convert is refused with
:class:`UnsupportedCheckpointError`, naming what it cannot convert.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from ..layers.liger import ROPE_SCALINGS

#: the model types (``config.json``'s ``model_type``) linearize converts
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedCheckpointError(ValueError):
    """A checkpoint linearize cannot convert: its family, a shape or an option; the message names it."""


@dataclass
class Architecture:
    """What linearize reads from a pretrained ``config.json`` (one field per option it converts)."""

    family: str  # model_type: llama, mistral, qwen2 or qwen3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]  # None or {"rope_type": "linear" | "llama3", ...} (without rope_theta)
    qkv_bias: bool  # q, k, v projections with biases (Qwen2; Llama / Qwen3 attention_bias)
    o_bias: bool  # output projection with a bias (Llama / Qwen3 attention_bias)
    qk_norm: bool  # Qwen3's q/k RMSNorm
    sliding_window: Optional[int]  # Mistral's window of every attention layer, or None
    tie_word_embeddings: bool
    special_tokens: dict[str, Any]  # bos/eos/pad token ids
    initializer_range: float


def _refuse(folder: Path, message: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(f"{folder}: {message}")


def read_config(folder: Union[str, Path]) -> dict[str, Any]:
    """The ``config.json`` of a local checkpoint folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} not found (linearize reads local folders only)")
    path = folder / "config.json"
    if not path.is_file():
        raise UnsupportedCheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedCheckpointError(f"{path} is not valid JSON: {err}") from err


def _rope(folder: Path, config: dict[str, Any]) -> tuple[float, Optional[dict]]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:  # the older spelling
        params["rope_type"] = params.pop("type")
    kind = params.get("rope_type", "default")
    if kind not in ROPE_SCALINGS:
        raise _refuse(folder, f"RoPE scaling {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(folder, f"partial_rotary_factor = {config['partial_rotary_factor']}: only full RoPE is supported")
    scaling = {key: params[key] for key in ("rope_type", *ROPE_SCALINGS[kind]) if key in params}
    return theta, None if kind == "default" else scaling


def architecture(folder: Union[str, Path]) -> Architecture:
    """The architecture of a local checkpoint, refused (:class:`UnsupportedCheckpointError`) unless
    linearize can convert every part of it.

    Example:
        >>> architecture("checkpoints/Llama-3.2-1B").num_kv_heads  # doctest: +SKIP
        8
    """
    folder = Path(folder)
    config = read_config(folder)
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise _refuse(folder, f"model_type {family!r} is not supported; linearize converts "
                              f"{', '.join(SUPPORTED_FAMILIES)}")
    needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [key for key in needed if not isinstance(config.get(key), int)]
    if missing:
        raise _refuse(folder, f"config.json lacks the integer field(s) {', '.join(missing)}")
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(folder, f"hidden_act {config['hidden_act']!r}: the feed-forward must be SwiGLU (silu)")
    if config.get("mlp_bias", False):
        raise _refuse(folder, "mlp_bias = true: the feed-forward has no biases in linmem")
    if config.get("attention_dropout", 0.0):
        raise _refuse(folder, f"attention_dropout = {config['attention_dropout']}: linmem has no attention dropout")
    sliding = config.get("sliding_window") if family == "mistral" else None
    if family in ("qwen2", "qwen3"):
        sliding_layers = [i for i, kind in enumerate(config.get("layer_types") or []) if kind != "full_attention"]
        if config.get("use_sliding_window", False) or sliding_layers:
            raise _refuse(folder, "per-layer sliding windows (use_sliding_window / layer_types) are not supported")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim * heads != config["hidden_size"] and config.get("head_dim") is None:
        raise _refuse(folder, f"hidden_size {config['hidden_size']} is not divisible by {heads} heads")
    if head_dim % 2:
        raise _refuse(folder, f"head_dim {head_dim} is odd: RoPE needs an even head dim")
    theta, scaling = _rope(folder, config)
    attention_bias = bool(config.get("attention_bias", False))
    return Architecture(
        family=family, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=config["intermediate_size"], rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        qkv_bias=family == "qwen2" or attention_bias, o_bias=family != "qwen2" and attention_bias,
        qk_norm=family == "qwen3", sliding_window=sliding,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        special_tokens={name: config.get(name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")},
        initializer_range=float(config.get("initializer_range", 0.02)),
    )


def weight_files(folder: Union[str, Path]) -> list[Path]:
    """The weight files of a checkpoint folder: safetensors (one file or the index's shards), else .bin."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise UnsupportedCheckpointError(f"{folder}: shard(s) {', '.join(missing)} of {index.name} are missing")
        return [folder / name for name in shards]
    found = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not found:
        raise UnsupportedCheckpointError(f"{folder} holds no weights (model.safetensors or pytorch_model.bin)")
    return found


def read_weights(folder: Union[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of a checkpoint folder, file after file (safetensors, or .bin with weights_only)."""
    for path in weight_files(folder):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
