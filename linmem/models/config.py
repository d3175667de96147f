"""LinmemConfig: one configuration for every architecture.

The stack is a layer pattern, one letter per layer: ``L`` a memory layer (the mixer
named by ``memory``), ``N`` an attention layer (``attention``). ``"LLLN" * 3`` is a
12-layer hybrid with one softmax attention layer in four. ``memory="mom"`` makes every
memory layer a mixture of memories, ``mlp="moe"`` every feed-forward a mixture of experts;
the routers' balancing losses join the training loss.

The config's own fields are the model's (sizes, layer pattern, norms, initialisation, the keywords of
transformers). The options of the mixers come in sections, one per arguments class, each a dict whose keys
are that class's fields (:data:`SECTIONS`, :func:`section_fields`):

* ``mixer``: :class:`~linmem.layers.MixerArgs`, read by every mixer (``head_dim``, ``window``, ``use_short_conv``, ...);
* ``llama_attention``: the pretrained attention layout (``qkv_bias``, ``o_bias``, ``rope_scaling_params``),
  read by ``llama_attention`` and ``liger``;
* ``liger``, ``gsa``, ``mom``: the own fields of Liger Attention, Gated Slot Attention and the mixture of
  memories (a field the class spells ``liger_window`` beside MixerArgs's ``window`` is ``window`` in its section);
* ``moe``: :class:`~linmem.layers.moe.MoEArgs` of ``mlp="moe"``, and the weights of its losses;
* ``titans``: :class:`~linmem.layers.titans.TitansArgs`, Titans' momentum switch.

A section keeps the defaults of the keys it is not given. Adding a field to one of these classes adds it to
its section. Every field is validated on construction: a wrong type or value, an unknown field or section key
(with the closest name), is a ``ValueError`` that names it (``mom.top_k``). A ``config.json`` written before the
sections (flat fields: ``mom_top_k``, ``num_experts``, ``window``, ...) loads into them (:data:`FLAT_FIELDS`).
The keywords every transformers config takes (``use_cache``, ``output_hidden_states``, ``return_dict``,
``tie_word_embeddings``, the token ids, ``dtype``, ...) are kept, and the models read them as transformers' do;
``output_attentions`` is kept too, but the models refuse to run with it True (they have no attention weights to
return).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from transformers import GenerationConfig, PretrainedConfig

from ..layers import MixerArgs, mixer_class, mixer_names
from ..layers.base import check_bool, check_choice, check_float, check_int
from ..layers.gsa import GSAArgs
from ..layers.titans import TitansArgs
from ..layers.liger import LigerArgs, PretrainedAttentionArgs
from ..layers.moe import MoEArgs
from ..layers.mom import MoMArgs
from ..ops.recurrence import available_backends

logger = logging.getLogger("linmem.models")

LAYER_LETTERS = {"L": "memory", "N": "attention"}
MLP_KINDS = ("swiglu", "moe")
OWNER = "LinmemConfig"
#: keywords PretrainedConfig consumes in its own initialisation without keeping them as fields
_PRETRAINED_KEYWORDS = frozenset({
    "torch_dtype", "num_labels", "name_or_path", "_name_or_path", "_commit_hash", "output_attentions",
    "attn_implementation", "experts_implementation", "per_layer_config", "rope_scaling",
    "_attn_implementation_internal", "_experts_implementation_internal", "tie_last_hidden_states",
})


@lru_cache(maxsize=1)
def pretrained_config_keys() -> frozenset[str]:
    """The keywords transformers itself passes to a config (``architectures``, ``dtype``,
    ``transformers_version``, generation settings, ...): those PretrainedConfig declares, writes to
    ``config.json`` or consumes, and the generation settings it accepts for compatibility."""
    keys = set(_PRETRAINED_KEYWORDS) | set(PretrainedConfig().to_dict()) | set(GenerationConfig().to_dict())
    if dataclasses.is_dataclass(PretrainedConfig):
        keys |= {f.name for f in dataclasses.fields(PretrainedConfig)}
    keys |= {n for n, p in inspect.signature(PretrainedConfig.__init__).parameters.items()
             if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    return frozenset(keys - {"self"})


#: the sections of mixer options: name -> the arguments class that declares (and validates) its keys
SECTIONS: dict[str, type] = {
    "mixer": MixerArgs, "llama_attention": PretrainedAttentionArgs, "liger": LigerArgs, "gsa": GSAArgs,
    "mom": MoMArgs, "moe": MoEArgs, "titans": TitansArgs,
}
#: arguments the model sets itself (from its own fields and each layer's place), so no section has them
MODEL_SET_ARGS = frozenset({"hidden_size", "num_heads", "norm_eps", "backend", "layer_idx", "num_layers", "init_std"})
_MIXER_OPTIONS = ("head_dim", "expand_v", "num_kv_heads", "use_short_conv", "conv_size", "feature_map", "gate_low_rank",
                  "window", "rope_theta", "qk_norm", "output_gate", "output_norm", "kv_shift", "forget_gate")
#: the flat fields of a config.json written before the sections -> where each is now (section, key)
FLAT_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    **{name: (("mixer", name),) for name in _MIXER_OPTIONS},
    **{name: (("llama_attention", name),) for name in ("qkv_bias", "o_bias", "rope_scaling_params")},
    **{f"liger_{key}": (("liger", key),) for key in ("memory", "memory_weight", "window", "gate", "feature_map")},
    "num_slots": (("gsa", "num_slots"), ("liger", "num_slots")),
    "mom_memory": (("mom", "memory"),), "num_memories": (("mom", "num_memories"),), "mom_top_k": (("mom", "top_k"),),
    "shared_memory": (("mom", "shared_memory"),), "mom_aux_loss_coef": (("mom", "aux_loss_coef"),),
    "num_experts": (("moe", "num_experts"),), "num_experts_per_tok": (("moe", "num_experts_per_tok"),),
    "moe_intermediate_size": (("moe", "intermediate_size"),), "num_shared_experts": (("moe", "num_shared_experts"),),
    "moe_router": (("moe", "router"),), "moe_capacity_factor": (("moe", "capacity_factor"),),
    "router_aux_loss_coef": (("moe", "aux_loss_coef"),), "router_z_loss_coef": (("moe", "z_loss_coef"),),
}


@lru_cache(maxsize=None)
def section_fields(name: str) -> dict[str, str]:
    """The keys of section ``name`` -> the field of its arguments class each sets: the fields the class declares
    beyond its parents, less those the model sets (:data:`MODEL_SET_ARGS`); a field spelled ``<name>_<key>``
    (LigerArgs's ``liger_window``, beside MixerArgs's ``window``) is ``key`` in the section.

    Example:
        >>> section_fields("liger")["window"], section_fields("mom")["top_k"]
        ('liger_window', 'top_k')
    """
    if name not in SECTIONS:
        raise ValueError(f"{OWNER}: unknown section {name!r}; valid: {', '.join(SECTIONS)}")
    cls = SECTIONS[name]
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    own = [f.name for f in dataclasses.fields(cls) if f.name not in inherited | MODEL_SET_ARGS]
    return {(field[len(name) + 1:] if field.startswith(f"{name}_") else field): field for field in own}


def section_defaults(name: str) -> dict[str, Any]:
    """Every key of section ``name`` with its default (None where the class has none: ``moe.intermediate_size``,
    whose None is the MLP width).

    Example:
        >>> section_defaults("gsa")
        {'num_slots': None}
    """
    defaults = {f.name: f.default for f in dataclasses.fields(SECTIONS[name])}
    return {key: (None if defaults[field] is dataclasses.MISSING else defaults[field])
            for key, field in section_fields(name).items()}


def section_values(name: str, given: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """Section ``name`` as a config keeps it: the keys ``given`` sets, the defaults for the rest. A key the
    section lacks is refused, naming the closest one.

    Example:
        >>> section_values("mom", {"top_k": 1})["top_k"]
        1
        >>> section_values("mom", {"top_kk": 1})
        Traceback (most recent call last):
        ...
        ValueError: LinmemConfig: unknown key 'mom.top_kk'; did you mean 'mom.top_k'?
    """
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise ValueError(f"{OWNER}: `{name}` must be a dict of {name} options (or None), got {given!r}")
    keys = list(section_fields(name))
    for key in given:
        if key not in keys:
            close = difflib.get_close_matches(str(key), keys, n=1)
            hint = f"; did you mean '{name}.{close[0]}'?" if close else f"; valid: {', '.join(keys)}"
            raise ValueError(f"{OWNER}: unknown key '{name}.{key}'{hint}")
    return {**section_defaults(name), **given}


def merge_fields(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` on top, a section key by key (``moe={"num_experts": 4}`` keeps the other keys of
    ``base``'s ``moe``).

    Example:
        >>> merge_fields({"mlp": "moe", "moe": {"num_experts": 8, "router": "sigmoid"}}, {"moe": {"num_experts": 4}})
        {'mlp': 'moe', 'moe': {'num_experts': 4, 'router': 'sigmoid'}}
    """
    merged = {**base, **overrides}
    for name in SECTIONS:
        if isinstance(base.get(name), Mapping) and isinstance(overrides.get(name), Mapping):
            merged[name] = {**base[name], **overrides[name]}
    return merged


def nest_flat_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` written before the sections (a config.json, a run's ``model.options``), each flat mixer option
    (:data:`FLAT_FIELDS`) moved into its section; anything else is kept as it is.

    Example:
        >>> nest_flat_fields({"memory": "mom", "mom_top_k": 1, "num_experts": 4, "window": 64})
        {'memory': 'mom', 'mom': {'top_k': 1}, 'moe': {'num_experts': 4}, 'mixer': {'window': 64}}
    """
    nested = {name: value for name, value in fields.items() if name not in FLAT_FIELDS}
    for name in fields:
        for section, key in FLAT_FIELDS.get(name, ()):
            nested[section] = {**nested.get(section, {}), key: fields[name]}
    return nested


def config_fields() -> list[str]:
    """The fields LinmemConfig takes as keywords: its own and its sections."""
    return [n for n in inspect.signature(LinmemConfig.__init__).parameters if n not in ("self", "kwargs")]


class LinmemConfig(PretrainedConfig):
    """Configuration of :class:`~linmem.models.LinmemForCausalLM`.

    The mixers' options come in sections (see the module docstring): ``mixer``, ``llama_attention``, ``liger``,
    ``gsa``, ``mom``, ``moe`` and ``titans``, each a dict of the keys it sets (the others keep their defaults).

    Example:
        >>> from linmem.models import LinmemConfig
        >>> config = LinmemConfig(hidden_size=256, num_heads=4, layer_pattern="LLLN", memory="gla",
        ...                       mixer={"window": 64})
        >>> config.num_hidden_layers, config.mixer["window"], config.mom["top_k"]
        (4, 64, 2)
        >>> LinmemConfig(memory="mom", mom={"num_memories": 0})
        Traceback (most recent call last):
        ...
        ValueError: LinmemConfig: `mom.num_memories` must be an integer >= 1, got 0
        >>> LinmemConfig(mixer={"windw": 16})
        Traceback (most recent call last):
        ...
        ValueError: LinmemConfig: unknown key 'mixer.windw'; did you mean 'mixer.window'?
    """

    model_type = "linmem"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_heads: int = 16,
        layer_pattern: str = "L" * 24,
        memory: str = "gated_deltanet",
        attention: str = "softmax",
        mlp: str = "swiglu",
        intermediate_size: Optional[int] = None,
        mixer: Optional[dict[str, Any]] = None,
        llama_attention: Optional[dict[str, Any]] = None,
        liger: Optional[dict[str, Any]] = None,
        gsa: Optional[dict[str, Any]] = None,
        mom: Optional[dict[str, Any]] = None,
        moe: Optional[dict[str, Any]] = None,
        titans: Optional[dict[str, Any]] = None,
        output_router_logits: bool = False,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        recurrence_backend: str = "auto",
        activation_checkpointing: bool = False,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        num_hidden_layers: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_keywords(kwargs)
        self.vocab_size = vocab_size  # tokens in the vocabulary
        self.hidden_size = hidden_size  # model width D
        self.num_heads = num_heads  # heads of every mixer
        self.layer_pattern = layer_pattern  # one letter per layer: L memory, N attention
        self.memory = memory  # the memory mixer of L layers
        self.attention = attention  # the attention mixer of N layers: softmax, swa or fox
        self.mlp = mlp  # feed-forward: swiglu (dense) or moe (mixture of experts)
        self.intermediate_size = intermediate_size  # MLP width (default ~8/3 D, multiple of 64)
        self.mixer = section_values("mixer", mixer)  # MixerArgs: options every mixer reads
        self.llama_attention = section_values("llama_attention", llama_attention)  # pretrained layout (and liger)
        self.liger = section_values("liger", liger)  # memory="liger": Liger Attention's options
        self.gsa = section_values("gsa", gsa)  # memory="gsa": the slots
        self.mom = section_values("mom", mom)  # memory="mom": the mixture of memories and its loss weight
        self.moe = section_values("moe", moe)  # mlp="moe": the experts and the weights of their losses
        self.titans = section_values("titans", titans)  # memory="titans": the momentum switch
        self.output_router_logits = output_router_logits  # also return every routed layer's router logits
        self.rms_norm_eps = rms_norm_eps  # epsilon of every RMSNorm
        self.initializer_range = initializer_range  # std of normal weight init
        self.recurrence_backend = recurrence_backend  # linear_recurrence backend
        self.activation_checkpointing = activation_checkpointing  # recompute each block in the backward pass
        self.use_cache = use_cache  # an eval-mode forward keeps a decoding cache by default (transformers' field)
        if not isinstance(layer_pattern, str):
            raise ValueError(f"{OWNER}: `layer_pattern` must be a string of L and N, got {layer_pattern!r}")
        if num_hidden_layers is not None and num_hidden_layers != len(layer_pattern):
            raise ValueError(
                f"num_hidden_layers = {num_hidden_layers} disagrees with layer_pattern {layer_pattern!r} "
                f"({len(layer_pattern)} layers); give the pattern only"
            )
        self.num_hidden_layers = len(layer_pattern)
        super().__init__(
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs,
        )
        self.validate_linmem()
        from . import register_auto_models  # the Auto classes find the model of any LinmemConfig

        register_auto_models()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> "LinmemConfig":
        """As PretrainedConfig's (and so ``LinmemForCausalLM.from_pretrained``); a local folder or file whose
        ``config.json`` is another model type's is refused first (:func:`refuse_foreign_config`)."""
        refuse_foreign_config(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "LinmemConfig":
        """As PretrainedConfig's. A config written before the sections is read into them (:func:`nest_flat_fields`);
        one without ``forget_gate`` was saved before ``window`` reached softmax and fox (it stored the sliding-window
        default for swa only), so its window is dropped unless the attention is swa. Fields given beside the saved
        ones (``from_pretrained(path, layer_pattern=..., moe={...})``) replace them, a section key by key
        (:func:`merge_fields`), and are validated with them."""
        if "window" in config_dict and "forget_gate" not in config_dict and config_dict.get("attention") != "swa":
            config_dict = {**config_dict, "window": None}  # saved before `window` reached softmax and fox
            logger.info("config saved by an earlier linmem: `window` applied to swa only, so it is dropped")
        config_dict = nest_flat_fields(config_dict)
        fields = config_fields()
        given = {name: kwargs.pop(name) for name in list(kwargs) if name in fields}
        if given:
            config_dict = merge_fields(config_dict, given)
            if "layer_pattern" in given and "num_hidden_layers" not in given:
                config_dict.pop("num_hidden_layers", None)
        return super().from_dict(config_dict, **kwargs)

    def validate_linmem(self) -> None:
        """Refuse unknown names, wrong types and values out of range, naming the field (``mom.top_k`` for a section
        key) and the valid range."""
        bad = sorted(set(self.layer_pattern) - set(LAYER_LETTERS))
        if not self.layer_pattern or bad:
            raise ValueError(
                f"layer_pattern {self.layer_pattern!r} must be a non-empty string of "
                f"{', '.join(f'{k} ({v})' for k, v in LAYER_LETTERS.items())}; unknown letters: {bad}"
            )
        if self.memory not in mixer_names("memory"):
            raise ValueError(f"unknown memory {self.memory!r}; valid: {', '.join(mixer_names('memory'))}")
        if self.attention not in mixer_names("attention"):
            raise ValueError(f"unknown attention {self.attention!r}; valid: {', '.join(mixer_names('attention'))}")
        check_choice(OWNER, "mlp", self.mlp, MLP_KINDS)
        for name in ("vocab_size", "hidden_size", "num_heads"):
            check_int(OWNER, name, getattr(self, name), minimum=1)
        check_int(OWNER, "intermediate_size", self.intermediate_size, minimum=1, optional=True)
        for name in ("output_router_logits", "activation_checkpointing", "tie_word_embeddings", "use_cache"):
            check_bool(OWNER, name, getattr(self, name))
        check_float(OWNER, "rms_norm_eps", self.rms_norm_eps, minimum=0.0)
        check_float(OWNER, "initializer_range", self.initializer_range, minimum=0.0, inclusive=True)
        check_choice(OWNER, "recurrence_backend", self.recurrence_backend, available_backends())
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            self._check_token_id(name)
        for name, cls in SECTIONS.items():  # every section's own keys, used by the stack or not
            if cls is MoEArgs:
                args: Any = self.moe_args()
            else:
                args = cls(**self._args_values(cls, 0))
            _naming_sections(getattr(args, "validate_options", args.validate), [name])
        for letter in sorted(set(self.layer_pattern)):  # each mixer of the stack checks its arguments together
            layer = self.layer_pattern.index(letter)
            cls = mixer_class(self.mixer_name(layer))
            names = [name for name, section in SECTIONS.items() if issubclass(cls.args_class, section)]
            _naming_sections(lambda owner: cls.validate_args(self.mixer_args(layer)), names)

    def _check_token_id(self, name: str) -> None:
        value = getattr(self, name, None)
        ids = value if isinstance(value, (list, tuple)) else [value]
        for token in ids:
            if token is not None and (not isinstance(token, int) or isinstance(token, bool)
                                      or not 0 <= token < self.vocab_size):
                raise ValueError(f"{OWNER}: `{name}` must be None or a token id in [0, vocab_size = "
                                 f"{self.vocab_size}), got {value!r}")

    @property
    def mlp_width(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 64 * -(-int(8 * self.hidden_size / 3) // 64)

    def mixer_name(self, layer_idx: int) -> str:
        return self.memory if self.layer_pattern[layer_idx] == "L" else self.attention

    def _args_values(self, args_class: type[MixerArgs], layer_idx: int) -> dict[str, Any]:
        """The fields of ``args_class`` from the model's own fields, the layer's place and the sections of the
        classes it derives from."""
        values = {
            "hidden_size": self.hidden_size, "num_heads": self.num_heads, "norm_eps": self.rms_norm_eps,
            "backend": self.recurrence_backend, "layer_idx": layer_idx, "num_layers": self.num_hidden_layers,
        }
        for name, cls in SECTIONS.items():
            if issubclass(args_class, cls):
                values.update({field: getattr(self, name)[key] for key, field in section_fields(name).items()})
        return values

    def mixer_args(self, layer_idx: int) -> MixerArgs:
        """The arguments of layer ``layer_idx``'s mixer, as that mixer takes them from the config."""
        cls = mixer_class(self.mixer_name(layer_idx))
        return cls.args_from(self._args_values(cls.args_class, layer_idx))

    def moe_args(self) -> MoEArgs:
        """The hyper-parameters of every MoE feed-forward (``mlp="moe"``); ``moe.intermediate_size`` None is the MLP
        width."""
        fields = {field: self.moe[key] for key, field in section_fields("moe").items()}
        if fields["intermediate_size"] is None:
            fields["intermediate_size"] = self.mlp_width
        return MoEArgs(hidden_size=self.hidden_size, init_std=self.initializer_range, **fields)


def _naming_sections(check: Callable[[str], Any], names: list[str]) -> None:
    """Run ``check(owner)``; a ValueError it raises names the fields of sections ``names`` as the config does
    (``mom.top_k``, ``liger.window`` for LigerArgs's ``liger_window``)."""
    try:
        check(OWNER)
    except ValueError as err:
        message = str(err)
        for name in names:
            for key, field in section_fields(name).items():
                message = message.replace(f"`{field}`", f"`{name}.{key}`")
        raise ValueError(message) from None


def refuse_foreign_config(path: Any) -> None:
    """Refuse a local checkpoint of another model type (a Llama's ``config.json``, say), naming its type and
    the conversion, before its fields reach LinmemConfig (which would refuse the first one it does not know).

    ``path``: a folder holding ``config.json``, or the file itself; anything else (a hub name, a missing file)
    is left to transformers.

    Example:
        >>> refuse_foreign_config("checkpoints/llama")  # doctest: +SKIP
        Traceback (most recent call last):
        ...
        ValueError: checkpoints/llama is a llama checkpoint, not a linmem model; run `linmem linearize ...
    """
    if not isinstance(path, (str, Path)):
        return
    path = Path(path)
    folder, file = (path, path / "config.json") if path.is_dir() else (path.parent, path)
    if not file.is_file():
        return
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (ValueError, AttributeError):  # not JSON, or not an object: transformers names the file
        return
    if model_type is not None and model_type != LinmemConfig.model_type:
        raise ValueError(f"{folder} is a {model_type} checkpoint, not a linmem model; run `linmem linearize --from "
                         f"{folder} --out OUT` first (it converts Llama, Mistral, Qwen2 and Qwen3 checkpoints)")


def refuse_unknown_keywords(kwargs: dict[str, Any]) -> None:
    """A keyword that is neither a LinmemConfig field nor one transformers passes is a typo: refuse it, naming
    the closest field; a flat field of the earlier configs (``window``, ``num_experts``) is named in its section."""
    unknown = sorted(set(kwargs) - pretrained_config_keys())
    if not unknown:
        return
    name = unknown[0]
    if name in FLAT_FIELDS:
        where = " and ".join(f"{section}={{{key!r}: ...}}" for section, key in FLAT_FIELDS[name])
        raise ValueError(f"{OWNER}: unknown field {name!r}; it is a mixer option, give it as {where}")
    fields = config_fields()
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(fields)}"
    raise ValueError(f"{OWNER}: unknown field {name!r}{hint}")
