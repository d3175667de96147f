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

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
from torch import nn


class LayerState:
    """Named tensors one layer carries from call to call, batch-first, plus a token count.

    A dynamic state (the default) takes each tensor ``set`` gives it (a view into a larger tensor is
    copied, so that it does not keep the larger one alive). A static state (``capacity`` given)
    keeps the tensor it was first given under a name and copies every later value into it: after
    the first call its tensors never move, which CUDA graphs need; attention layers size their KV
    buffers by ``capacity`` and write where the device tensor ``position`` says. So a mixer reads
    what it needs of a tensor it got before it ``set``s that name again.

    Example:
        >>> state = LayerState(capacity=16, position=torch.zeros(1, dtype=torch.long))
        >>> state.set("h", torch.zeros(2, 3))
        >>> buffer = state.get("h")
        >>> state.set("h", torch.ones(2, 3))
        >>> state.get("h") is buffer, float(buffer.sum())
        (True, 6.0)
    """

    def __init__(self, *, capacity: Optional[int] = None, position: Optional[torch.Tensor] = None) -> None:
        if (capacity is None) != (position is None):
            raise ValueError("LayerState: give `capacity` and `position` together (a static state) or neither")
        if capacity is not None:
            check_int("LayerState", "capacity", capacity, minimum=1)
        self.tensors: dict[str, torch.Tensor] = {}
        self.seen_tokens = 0  # tokens processed so far (per batch row, padding included)
        self.capacity = capacity  # static: the most tokens the KV buffers hold; None: they grow
        self.position = position  # static: [1] long on the device, tokens written so far (read inside graphs)

    @property
    def static(self) -> bool:
        """Whether the tensors stay where they were first put (see the class docstring)."""
        return self.capacity is not None

    def get(self, name: str) -> Optional[torch.Tensor]:
        return self.tensors.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        current = self.tensors.get(name)
        if self.static and current is not None:
            if value is not current:
                if value.shape != current.shape:
                    raise ValueError(f"LayerState: static entry {name!r} has shape {list(current.shape)}, "
                                     f"got a value of shape {list(value.shape)}")
                current.copy_(value)
            return
        owns = value.untyped_storage().nbytes() == value.numel() * value.element_size()
        self.tensors[name] = value if owns else value.clone()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def zero_(self) -> None:
        """Forget everything in place (a static state keeps its tensors)."""
        for t in self.tensors.values():
            t.zero_()
        self.seen_tokens = 0

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (and reorder) batch rows, as beam search does; a static state reorders in place."""
        if self.static:
            for t in self.tensors.values():
                t.copy_(t.index_select(0, index.to(t.device)))
            return
        self.tensors = {n: t.index_select(0, index.to(t.device)) for n, t in self.tensors.items()}

    def repeat_batch(self, repeats: int) -> None:
        if self.static and self.tensors:
            raise ValueError("LayerState: a static state has a fixed batch size; build its cache for the "
                             "expanded batch instead of repeating it")
        self.tensors = {n: t.repeat_interleave(repeats, dim=0) for n, t in self.tensors.items()}

    def __repr__(self) -> str:
        shapes = {n: tuple(t.shape) for n, t in self.tensors.items()}
        kind = f"capacity={self.capacity}, " if self.static else ""
        return f"LayerState({kind}seen_tokens={self.seen_tokens}, {shapes})"


#: the forget gates of the ``fox`` mixer (``MixerArgs.forget_gate``)
FORGET_GATES = ("data_dependent", "data_independent", "fixed")


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
    window: Optional[int] = None  # attention: keys a query sees (required by swa; softmax and fox when set)
    rope_theta: float = 10000.0  # rotary base (softmax, swa)
    rope: Optional[bool] = None  # attention: rotate q, k by position; None = the mixer's default (on, fox: off)
    qk_norm: bool = False  # attention: per-head RMS norm on q, k ("Pro")
    output_gate: bool = False  # attention: sigmoid output gate ("Pro")
    output_norm: bool = False  # attention: per-head output RMSNorm ("Pro")
    kv_shift: bool = False  # attention: data-dependent KV shift ("Pro")
    forget_gate: str = "data_dependent"  # fox: data_dependent, data_independent (learnt per head) or fixed
    prune_tolerance: Optional[float] = None  # fox: softmax mass per query pruning may drop, in (0, 1); None = off
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

    def validate(self, owner: str = "MixerArgs") -> None:
        """Refuse a field of the wrong type or outside its range, naming the field and the range."""
        for name in ("hidden_size", "num_heads", "conv_size", "gate_low_rank", "num_layers"):
            check_int(owner, name, getattr(self, name), minimum=1)
        for name in ("head_dim", "num_kv_heads", "window"):
            check_int(owner, name, getattr(self, name), minimum=1, optional=True)
        check_int(owner, "layer_idx", self.layer_idx, minimum=0)
        if self.layer_idx >= self.num_layers:
            raise ValueError(f"{owner}: `layer_idx` must lie in [0, num_layers = {self.num_layers}), "
                             f"got {self.layer_idx}")
        check_bool(owner, "use_short_conv", self.use_short_conv, optional=True)
        check_bool(owner, "rope", self.rope, optional=True)
        check_float(owner, "prune_tolerance", self.prune_tolerance, minimum=0.0, optional=True)
        if self.prune_tolerance is not None and self.prune_tolerance >= 1:
            raise ValueError(f"{owner}: `prune_tolerance` must lie in (0, 1) or be None, got {self.prune_tolerance}")
        for name in ("qk_norm", "output_gate", "output_norm", "kv_shift"):
            check_bool(owner, name, getattr(self, name))
        check_float(owner, "expand_v", self.expand_v, minimum=0.0)
        check_float(owner, "rope_theta", self.rope_theta, minimum=0.0)
        check_float(owner, "norm_eps", self.norm_eps, minimum=0.0)
        check_choice(owner, "forget_gate", self.forget_gate, FORGET_GATES)
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"{owner}: `hidden_size` = {self.hidden_size} is not divisible by `num_heads` = "
                             f"{self.num_heads}; set `head_dim`")
        value_dim = self.key_dim * self.expand_v
        if value_dim < 1 or value_dim != int(value_dim):
            raise ValueError(f"{owner}: head_dim * `expand_v` = {self.key_dim} * {self.expand_v} must be a whole "
                             f"number >= 1, got {value_dim}")
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"{owner}: `num_heads` = {self.num_heads} must be a multiple of `num_kv_heads` = {kv}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    """Refuse anything but an integer >= ``minimum`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        rule = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{owner}: `{name}` must be {rule}, got {value!r}")


def check_float(owner: str, name: str, value: object, *, minimum: float, inclusive: bool = False,
                optional: bool = False) -> None:
    """Refuse anything but a finite number > ``minimum`` (>= with ``inclusive``; or None when ``optional``)."""
    if optional and value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
        rule = f"a finite number {'>=' if inclusive else '>'} {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{owner}: `{name}` must be {rule}, got {value!r}")


def check_bool(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    """Refuse anything but True or False (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: `{name}` must be True or False{' or None' if optional else ''}, got {value!r}")


def check_choice(owner: str, name: str, value: object, choices: Sequence[str]) -> None:
    """Refuse a value outside ``choices``, listing them."""
    if value not in choices:
        raise ValueError(f"{owner}: unknown `{name}` {value!r}; valid: {', '.join(choices)}")


class Mixer(nn.Module, ABC):
    """Base of every token mixer; see the module docstring for the call contract.

    A mixer class owns its metadata: its :class:`MixerArgs` class (:attr:`args_class`), how a model's
    settings become those arguments (:meth:`args_from`) and which values it accepts
    (:meth:`validate_args`), so the model never special-cases a mixer by name.
    """

    #: "memory" (constant-size state) or "attention" (KV cache)
    kind: str = "memory"
    #: the arguments this mixer takes
    args_class: ClassVar[type[MixerArgs]] = MixerArgs
    #: the registered name (set by :func:`register_mixer`)
    name: ClassVar[str] = ""
    #: the heads this module computes: all of them, or under tensor parallelism this rank's consecutive share
    #: (set by :mod:`linmem.distributed.tensor`). The forward takes its head count from its tensors' shapes;
    #: per-head constants that no parameter holds (fixed decays) are taken at these heads.
    heads: slice = slice(None)

    def __init__(self, args: MixerArgs) -> None:
        super().__init__()
        self.validate_args(args)
        self.args = args

    @classmethod
    def args_from(cls, values: Mapping[str, Any]) -> MixerArgs:
        """This mixer's arguments from a model's settings: every field of :attr:`args_class` in ``values``."""
        names = {f.name for f in fields(cls.args_class)}
        return cls.args_class(**{n: v for n, v in values.items() if n in names})

    @classmethod
    def validate_args(cls, args: MixerArgs) -> None:
        """Refuse arguments this mixer cannot serve (ValueError naming the field and the valid range)."""
        args.validate(cls.name or cls.__name__)

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


def mixer_class(name: str) -> type[Mixer]:
    """The class of a registered mixer; unknown names are refused with the list of valid ones."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; valid: {', '.join(sorted(MIXERS))}")
    return MIXERS[name]


def build_mixer(name: str, args: MixerArgs) -> Mixer:
    """Build a registered mixer; unknown names are refused with the list of valid ones."""
    return mixer_class(name)(args)


def mixer_names(kind: Optional[str] = None) -> list[str]:
    """Registered mixer names, optionally only those of one kind ("memory" or "attention")."""
    return sorted(n for n, cls in MIXERS.items() if kind is None or cls.kind == kind)


def check_cache_and_varlen(cache: Optional[LayerState], cu_seqlens: Optional[torch.Tensor]) -> None:
    if cache is not None and cu_seqlens is not None:
        raise ValueError(
            "a decoding cache cannot be combined with `cu_seqlens`; decode a padded batch with `token_mask`"
        )
