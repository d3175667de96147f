"""The one interface every mixer shares, its per-layer decoding state, and the registry.

A mixer maps ``hidden: [B, T, D] -> [B, T, D]``::

    mixer(hidden, cu_seqlens=None, cache=None, token_mask=None, position_ids=None)

* ``cu_seqlens: [N + 1]`` packs N sequences along T (B == 1); no state crosses a boundary.
* ``cache: LayerState`` holds what the layer carries between calls (recurrent state,
  convolution/shift history, KV cache). A mixer reads it and writes it back; with
  ``cache=None`` nothing is kept.
* ``token_mask: [B, T]`` bool, False at padding (left or right); padded tokens must
  leave the layer's state untouched (the model zeroes their hidden states).
* ``position_ids: [B, T]`` positions for rotary embeddings (restarting per sequence).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
from torch import nn


class LayerState:
    """Named tensors one layer carries from call to call, batch-first, plus a token count."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.seen_tokens = 0  # tokens processed so far (per batch row, padding included)

    def get(self, name: str) -> Optional[torch.Tensor]:
        return self.tensors.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        self.tensors[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (and reorder) batch rows, as beam search does."""
        self.tensors = {n: t.index_select(0, index.to(t.device)) for n, t in self.tensors.items()}

    def repeat_batch(self, repeats: int) -> None:
        self.tensors = {n: t.repeat_interleave(repeats, dim=0) for n, t in self.tensors.items()}

    def __repr__(self) -> str:
        shapes = {n: tuple(t.shape) for n, t in self.tensors.items()}
        return f"LayerState(seen_tokens={self.seen_tokens}, {shapes})"


@dataclass
class MixerArgs:
    """Hyper-parameters a mixer may read; each mixer uses the fields of its family."""

    hidden_size: int  # model width D
    num_heads: int  # heads H
    head_dim: Optional[int] = None  # key dim K per head; default D / H
    expand_v: float = 1.0  # value dim V = K * expand_v
    num_kv_heads: Optional[int] = None  # attention: KV heads for GQA; default H
    use_short_conv: Optional[bool] = None  # short causal conv on q, k, v; None = the paper's default
    conv_size: int = 4  # kernel of the short convolution
    feature_map: Optional[str] = None  # linear attention feature map; None = the mixer's default
    gate_low_rank: int = 16  # GLA / RWKV low-rank gate projection rank
    window: Optional[int] = None  # sliding-window size (swa; fox when set)
    rope_theta: float = 10000.0  # rotary base (softmax, swa)
    qk_norm: bool = False  # attention: per-head RMS norm on q, k (FoX Pro)
    output_gate: bool = False  # attention: sigmoid output gate (FoX Pro)
    output_norm: bool = False  # attention: per-head output RMSNorm (FoX Pro)
    kv_shift: bool = False  # attention: data-dependent KV shift (FoX Pro)
    norm_eps: float = 1e-6  # RMSNorm epsilon
    backend: str = "auto"  # linear_recurrence backend
    layer_idx: int = 0  # position in the stack
    num_layers: int = 1  # depth of the stack

    @property
    def key_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def value_dim(self) -> int:
        return int(self.key_dim * self.expand_v)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class Mixer(nn.Module, ABC):
    """Base of every token mixer; see the module docstring for the call contract."""

    #: "memory" (constant-size state) or "attention" (KV cache)
    kind: str = "memory"

    def __init__(self, args: MixerArgs) -> None:
        super().__init__()
        self.args = args

    @abstractmethod
    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[LayerState] = None,
        token_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """hidden: [B, T, D] -> [B, T, D]."""


MIXERS: dict[str, type[Mixer]] = {}


def register_mixer(name: str) -> Callable[[type[Mixer]], type[Mixer]]:
    """Class decorator: make a mixer buildable by name."""

    def add(cls: type[Mixer]) -> type[Mixer]:
        if name in MIXERS:
            raise ValueError(f"mixer {name!r} is registered twice ({MIXERS[name].__name__}, {cls.__name__})")
        cls.name = name
        MIXERS[name] = cls
        return cls

    return add


def build_mixer(name: str, args: MixerArgs) -> Mixer:
    """Build a registered mixer; unknown names are refused with the list of valid ones."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; valid: {', '.join(sorted(MIXERS))}")
    return MIXERS[name](args)


def mixer_names(kind: Optional[str] = None) -> list[str]:
    """Registered mixer names, optionally only those of one kind ("memory" or "attention")."""
    return sorted(n for n, cls in MIXERS.items() if kind is None or cls.kind == kind)


def check_cache_and_varlen(cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]) -> None:
    if cache is not None and cu_seqlens is not None:
        raise ValueError(
            "a decoding cache cannot be combined with `cu_seqlens`; decode a padded batch with `token_mask`"
        )
