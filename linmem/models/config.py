"""LinmemConfig: one configuration for every architecture.

The stack is a layer pattern, one letter per layer: ``L`` a memory layer (the mixer
named by ``memory``), ``N`` an attention layer (``attention``). ``"LLLN" * 3`` is a
12-layer hybrid with one softmax attention layer in four. ``memory="mom"`` makes every
memory layer a mixture of memories (rule ``mom_memory``), ``mlp="moe"`` every feed-forward
a mixture of experts; the routers' balancing losses join the training loss.

Each mixer takes from the config the fields of its own arguments (:meth:`Mixer.args_from`);
the config only renames its model-wide fields (``rms_norm_eps`` -> ``norm_eps``, ...).
Every field is validated on construction: a wrong type or value, or an unknown keyword
(with the closest field name), is a ``ValueError`` that names it. The keywords every transformers config takes
(``use_cache``, ``output_hidden_states``, ``return_dict``, ``tie_word_embeddings``, the token ids, ``dtype``, ...)
are kept, and the models read them as transformers' do; ``output_attentions`` is kept too, but the models refuse
to run with it True (they have no attention weights to return).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from transformers import GenerationConfig, PretrainedConfig

from ..layers import MixerArgs, mixer_class, mixer_names
from ..layers.base import check_bool, check_choice, check_float, check_int
from ..layers.liger import LIGER_MEMORIES
from ..layers.moe import MoEArgs
from ..ops.recurrence import available_backends
from ..layers.mom import mom_rules
from ..ops.routing import ROUTERS

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


class LinmemConfig(PretrainedConfig):
    """Configuration of :class:`~linmem.models.LinmemForCausalLM`.

    Example:
        >>> from linmem.models import LinmemConfig
        >>> config = LinmemConfig(hidden_size=256, num_heads=4, layer_pattern="LLLN", memory="gla")
        >>> config.num_hidden_layers
        4
        >>> LinmemConfig(windw=16)
        Traceback (most recent call last):
        ...
        ValueError: LinmemConfig: unknown field 'windw'; did you mean 'window'?
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
        head_dim: Optional[int] = None,
        expand_v: float = 1.0,
        num_kv_heads: Optional[int] = None,
        use_short_conv: Optional[bool] = None,
        conv_size: int = 4,
        feature_map: Optional[str] = None,
        gate_low_rank: int = 16,
        window: Optional[int] = None,
        rope_theta: float = 10000.0,
        qk_norm: bool = False,
        output_gate: bool = False,
        output_norm: bool = False,
        kv_shift: bool = False,
        forget_gate: str = "data_dependent",
        qkv_bias: bool = False,
        o_bias: bool = False,
        rope_scaling_params: Optional[dict] = None,
        liger_memory: str = "gla",
        liger_memory_weight: float = 0.5,
        liger_window: int = 64,
        liger_gate: str = "pooled_key",
        liger_feature_map: str = "softmax",
        num_slots: Optional[int] = None,
        mom_memory: str = "gated_deltanet",
        num_memories: int = 4,
        mom_top_k: int = 2,
        shared_memory: bool = True,
        mom_aux_loss_coef: float = 0.01,
        mlp: str = "swiglu",
        intermediate_size: Optional[int] = None,
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: Optional[int] = None,
        num_shared_experts: int = 0,
        moe_router: str = "softmax",
        moe_capacity_factor: Optional[float] = None,
        router_aux_loss_coef: float = 0.01,
        router_z_loss_coef: float = 0.001,
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
        self.head_dim = head_dim  # key dim per head (default hidden_size / num_heads)
        self.expand_v = expand_v  # value dim = head_dim * expand_v
        self.num_kv_heads = num_kv_heads  # attention KV heads (GQA), default num_heads
        self.use_short_conv = use_short_conv  # short conv in memory layers (None: the mixer's default)
        self.conv_size = conv_size  # kernel of the short convolution
        self.feature_map = feature_map  # linear_attention feature map
        self.gate_low_rank = gate_low_rank  # rank of low-rank gate projections (GLA, RWKV)
        self.window = window  # attention: keys a query sees (swa needs it; softmax and fox when set)
        self.rope_theta = rope_theta  # rotary base of softmax / swa
        self.qk_norm = qk_norm  # attention: per-head q/k RMSNorm ("Pro")
        self.output_gate = output_gate  # attention: sigmoid output gate ("Pro")
        self.output_norm = output_norm  # attention: per-head output norm ("Pro")
        self.kv_shift = kv_shift  # attention: KV shift ("Pro")
        self.forget_gate = forget_gate  # fox: data_dependent, data_independent (learnt per head) or fixed
        self.qkv_bias = qkv_bias  # llama_attention, liger: biases on the q, k, v projections (Qwen2)
        self.o_bias = o_bias  # llama_attention, liger: a bias on the output projection (Llama's attention_bias)
        self.rope_scaling_params = rope_scaling_params  # llama_attention, liger: RoPE scaling {"rope_type": ...}
        self.liger_memory = liger_memory  # liger: the gated recurrence (gla, mamba2, hgrn2, rwkv6, gated_retention, gsa)
        self.liger_memory_weight = liger_memory_weight  # liger: weight of the memory read-out (window: 1 - it)
        self.liger_window = liger_window  # liger: keys the sliding-window branch sees
        self.liger_gate = liger_gate  # liger: gate from the pooled key, or a new random projection (ablation)
        self.liger_feature_map = liger_feature_map  # liger: phi of q, k: softmax, or learnable (ablation)
        self.num_slots = num_slots  # gsa, liger with gsa: memory slots per head (default head_dim)
        self.mom_memory = mom_memory  # memory="mom": the update rule of every memory (gla, gated_deltanet, ...)
        self.num_memories = num_memories  # memory="mom": routed memories per layer
        self.mom_top_k = mom_top_k  # memory="mom": memories per token (`top_k` would clash with generation's)
        self.shared_memory = shared_memory  # memory="mom": one more memory every token writes
        self.mom_aux_loss_coef = mom_aux_loss_coef  # weight of the memories' balancing loss in `loss`
        self.mlp = mlp  # feed-forward: swiglu (dense) or moe (mixture of experts)
        self.intermediate_size = intermediate_size  # MLP width (default ~8/3 D, multiple of 64)
        self.num_experts = num_experts  # mlp="moe": routed experts per layer
        self.num_experts_per_tok = num_experts_per_tok  # mlp="moe": experts per token (top-k)
        self.moe_intermediate_size = moe_intermediate_size  # mlp="moe": width of each expert (default: mlp_width)
        self.num_shared_experts = num_shared_experts  # mlp="moe": always-on experts of the same width
        self.moe_router = moe_router  # mlp="moe": router scores, softmax or sigmoid
        self.moe_capacity_factor = moe_capacity_factor  # mlp="moe": None = dropless, else tokens per expert cap
        self.router_aux_loss_coef = router_aux_loss_coef  # weight of the experts' balancing loss in `loss`
        self.router_z_loss_coef = router_z_loss_coef  # weight of the experts' router z-loss in `loss`
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
        """As PretrainedConfig's; a ``window`` saved before it reached softmax and fox (configs without
        ``forget_gate``) stored the sliding-window default for swa only, so it is dropped for them."""
        if "forget_gate" not in config_dict and config_dict.get("attention", "softmax") != "swa":
            config_dict = {**config_dict, "window": None}
            logger.info("config saved by an earlier linmem: `window` applied to swa only, so it is dropped")
        fields = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
        given = {name: kwargs.pop(name) for name in list(kwargs) if name in fields}
        if given:  # fields given beside the saved ones (from_pretrained(path, layer_pattern=...)): validated as one
            config_dict = {**config_dict, **given}
            if "layer_pattern" in given and "num_hidden_layers" not in given:
                config_dict.pop("num_hidden_layers", None)
        return super().from_dict(config_dict, **kwargs)

    def validate_linmem(self) -> None:
        """Refuse unknown names, wrong types and values out of range, naming the field and the valid range."""
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
        check_choice(OWNER, "mom_memory", self.mom_memory, mom_rules())
        check_choice(OWNER, "moe_router", self.moe_router, ROUTERS)
        for name in ("vocab_size", "hidden_size", "num_heads", "conv_size", "gate_low_rank", "num_memories",
                     "mom_top_k", "num_experts", "num_experts_per_tok"):
            check_int(OWNER, name, getattr(self, name), minimum=1)
        for name in ("head_dim", "num_kv_heads", "window", "intermediate_size", "moe_intermediate_size", "num_slots"):
            check_int(OWNER, name, getattr(self, name), minimum=1, optional=True)
        check_int(OWNER, "liger_window", self.liger_window, minimum=1)
        check_choice(OWNER, "liger_memory", self.liger_memory, LIGER_MEMORIES)
        check_int(OWNER, "num_shared_experts", self.num_shared_experts, minimum=0)
        for name in ("qk_norm", "output_gate", "output_norm", "kv_shift", "shared_memory", "output_router_logits",
                     "activation_checkpointing", "tie_word_embeddings", "qkv_bias", "o_bias", "use_cache"):
            check_bool(OWNER, name, getattr(self, name))
        check_bool(OWNER, "use_short_conv", self.use_short_conv, optional=True)
        for name in ("expand_v", "rope_theta", "rms_norm_eps"):
            check_float(OWNER, name, getattr(self, name), minimum=0.0)
        for name in ("initializer_range", "mom_aux_loss_coef", "router_aux_loss_coef", "router_z_loss_coef"):
            check_float(OWNER, name, getattr(self, name), minimum=0.0, inclusive=True)
        check_float(OWNER, "moe_capacity_factor", self.moe_capacity_factor, minimum=0.0, optional=True)
        check_choice(OWNER, "recurrence_backend", self.recurrence_backend, available_backends())
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            self._check_token_id(name)
        if self.mom_top_k > self.num_memories:
            raise ValueError(f"mom_top_k = {self.mom_top_k} must lie in [1, num_memories = {self.num_memories}]")
        self.moe_args().validate()
        for letter in sorted(set(self.layer_pattern)):  # each mixer of the stack checks its own arguments
            layer = self.layer_pattern.index(letter)
            mixer_class(self.mixer_name(layer)).validate_args(self.mixer_args(layer))

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

    def mixer_values(self, layer_idx: int) -> dict[str, Any]:
        """Every setting under the name a mixer's arguments give it (config fields, model-wide renames,
        the layer's place in the stack)."""
        return {
            **vars(self), "norm_eps": self.rms_norm_eps, "backend": self.recurrence_backend, "top_k": self.mom_top_k,
            "layer_idx": layer_idx, "num_layers": self.num_hidden_layers,
        }

    def mixer_args(self, layer_idx: int) -> MixerArgs:
        """The arguments of layer ``layer_idx``'s mixer, as that mixer takes them from the config."""
        return mixer_class(self.mixer_name(layer_idx)).args_from(self.mixer_values(layer_idx))

    def moe_args(self) -> MoEArgs:
        """The hyper-parameters of every MoE feed-forward (``mlp="moe"``)."""
        return MoEArgs(
            hidden_size=self.hidden_size, intermediate_size=self.moe_intermediate_size or self.mlp_width,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            num_shared_experts=self.num_shared_experts, router=self.moe_router,
            capacity_factor=self.moe_capacity_factor, init_std=self.initializer_range,
        )


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
    """A keyword that is neither a LinmemConfig field nor one transformers passes is a typo: refuse it,
    naming the closest field."""
    unknown = sorted(set(kwargs) - pretrained_config_keys())
    if not unknown:
        return
    fields = [n for n in inspect.signature(LinmemConfig.__init__).parameters if n not in ("self", "kwargs")]
    name = unknown[0]
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(fields)}"
    raise ValueError(f"{OWNER}: unknown field {name!r}{hint}")
