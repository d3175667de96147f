"""LinmemConfig: one configuration for every architecture (DESIGN section 5).

The stack is a layer pattern, one letter per layer: ``L`` a memory layer (the mixer
named by ``memory``), ``N`` an attention layer (``attention``). ``"LLLN" * 3`` is a
12-layer hybrid with one softmax attention layer in four. ``memory="mom"`` makes every
memory layer a mixture of memories (rule ``mom_memory``), ``mlp="moe"`` every feed-forward
a mixture of experts; the routers' balancing losses join the training loss.
"""

from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig

from ..layers import MixerArgs, mixer_names
from ..layers.moe import MoEArgs
from ..layers.mom import MEMORY_PROJECTIONS, MoMArgs

LAYER_LETTERS = {"L": "memory", "N": "attention"}
MLP_KINDS = ("swiglu", "moe")


class LinmemConfig(PretrainedConfig):
    """Configuration of :class:`~linmem.models.LinmemForCausalLM`.

    Example:
        >>> from linmem.models import LinmemConfig
        >>> config = LinmemConfig(hidden_size=256, num_heads=4, layer_pattern="LLLN", memory="gla")
        >>> config.num_hidden_layers
        4
    """

    model_type = "linmem"
    keys_to_ignore_at_inference = ["past_key_values"]

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
        window: int = 512,
        rope_theta: float = 10000.0,
        qk_norm: bool = False,
        output_gate: bool = False,
        output_norm: bool = False,
        kv_shift: bool = False,
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
        tie_word_embeddings: bool = False,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        num_hidden_layers: Optional[int] = None,
        **kwargs,
    ) -> None:
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
        self.window = window  # sliding window of swa layers
        self.rope_theta = rope_theta  # rotary base of softmax / swa
        self.qk_norm = qk_norm  # attention: per-head q/k RMSNorm (FoX Pro)
        self.output_gate = output_gate  # attention: sigmoid output gate (FoX Pro)
        self.output_norm = output_norm  # attention: per-head output norm (FoX Pro)
        self.kv_shift = kv_shift  # attention: KV shift (FoX Pro)
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

    def validate_linmem(self) -> None:
        """Refuse unknown names and inconsistent sizes, naming the valid choices."""
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
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"unknown mlp {self.mlp!r}; valid: {', '.join(MLP_KINDS)}")
        if self.mom_memory not in MEMORY_PROJECTIONS:
            raise ValueError(f"unknown mom_memory {self.mom_memory!r}; valid: {', '.join(MEMORY_PROJECTIONS)}")
        if self.num_memories < 1 or not 1 <= self.mom_top_k <= self.num_memories:
            raise ValueError(f"mom_top_k = {self.mom_top_k} must lie in [1, num_memories = {self.num_memories}]")
        self.moe_args().validate()
        for name in ("mom_aux_loss_coef", "router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; set head_dim"
            )
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {kv}")

    @property
    def mlp_width(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 64 * -(-int(8 * self.hidden_size / 3) // 64)

    def mixer_name(self, layer_idx: int) -> str:
        return self.memory if self.layer_pattern[layer_idx] == "L" else self.attention

    def mixer_args(self, layer_idx: int) -> MixerArgs:
        """The hyper-parameters of layer ``layer_idx``'s mixer (:class:`MoMArgs` for ``mom``)."""
        shared = {name: getattr(self, name) for name in MixerArgs.field_names() if hasattr(self, name)}
        name = self.mixer_name(layer_idx)
        shared.update(hidden_size=self.hidden_size, norm_eps=self.rms_norm_eps, backend=self.recurrence_backend,
                      layer_idx=layer_idx, num_layers=self.num_hidden_layers,
                      window=self.window if name == "swa" else None)
        if name == "mom":
            return MoMArgs(**shared, mom_memory=self.mom_memory, num_memories=self.num_memories,
                           top_k=self.mom_top_k, shared_memory=self.shared_memory)
        return MixerArgs(**shared)

    def moe_args(self) -> MoEArgs:
        """The hyper-parameters of every MoE feed-forward (``mlp="moe"``)."""
        return MoEArgs(
            hidden_size=self.hidden_size, intermediate_size=self.moe_intermediate_size or self.mlp_width,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            num_shared_experts=self.num_shared_experts, router=self.moe_router,
            capacity_factor=self.moe_capacity_factor, init_std=self.initializer_range,
        )
