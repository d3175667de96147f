"""The models of ``linmem bench models`` and ``linmem bench decode``: linmem's, and its peers of the same shape.

Every model is a stack of ``num_layers`` pre-norm blocks of width ``D`` (``hidden_size``) with a
SwiGLU MLP of width ``256 * ceil(int(8 D / 3) / 256)`` (fla's rule: 2816 at D = 1024, HF Llama given
the same), untied embeddings, vocabulary 32000. The default shape (D = 1024, 24 layers) is the ~370M
models of the papers. Head counts are fixed per architecture and head dims follow from ``D``, so a
smaller ``D`` gives the same architecture, smaller.

The mapping, linmem config <-> peer config, at D = 1024 (K: key dim per head, V: value dim per head):

================  ===============================================  =================================================
key (peer key)    linmem ``LinmemConfig``                          peer
================  ===============================================  =================================================
transformer       ``"N"*24``, ``attention="softmax"``, 16 heads    HF ``LlamaForCausalLM`` (``attn_implementation=
(llama)           (K = V = 64), RoPE 10000                         "sdpa"``), 16 heads, 16 KV heads, RoPE 10000
gla (fla-gla)     ``memory="gla"``, 4 heads, ``head_dim=128``,     fla ``GLAConfig(num_heads=4, expand_k=0.5,
                  ``expand_v=2`` (K = 128, V = 256), no short      expand_v=1)``: its defaults (K = 128, V = 256,
                  conv, rank-16 gate, swish output gate            no short conv, rank-16 gate, output gate)
deltanet          ``memory="deltanet"``, 8 heads (K = V = 128),    fla ``DeltaNetConfig(num_heads=8, expand_k=1,
(fla-deltanet)    short conv, L2-normed q/k, output RMSNorm        expand_v=1)``: fla's 340M DeltaNet (short conv,
                                                                   SiLU + L2 q/k, output norm, no gate)
gated_deltanet    ``memory="gated_deltanet"``, 4 heads             fla ``GatedDeltaNetConfig(num_heads=4,
(fla-gated_       (K = V = 256), short conv, output gate           head_dim=256, expand_v=1)``: fla's default head
deltanet)                                                          dim 256; fla's ``expand_v=2`` would give V = 512,
                                                                   past linmem's kernels' 256, so V = K on both sides
hybrid            ``"LLLN"*6``: Gated DeltaNet layers of 8 heads   fla ``GatedDeltaNetConfig(num_heads=8,
(fla-hybrid)      (K = V = 128; short conv, output gate) and       head_dim=128, expand_v=1, attn={"layers":
                  softmax attention at layers 3, 7, .., 23, 8      [3, 7, .., 23], "num_heads": 8})`` (fla's
                  heads of 128: one ``num_heads`` serves every     attention layer needs the ``flash-attn``
                  mixer, and 128 is a head dim of linmem's         package)
                  attention kernels (256 is not); the projections
                  are those of 4 heads of 256 (393.3M parameters)
fox (fla-fox)     ``"N"*24``, ``attention="fox"``, 16 heads        fla ``ForgettingTransformerConfig(num_heads=16)``:
                  (K = V = 64), no RoPE, no Pro options            its defaults (no QK-norm, no output gate)
mom (fla-mom)     ``memory="mom"``, 4 Gated DeltaNet memories      fla ``MomConfig(num_heads=4, head_dim=256,
                  of 4 heads (K = V = 256), top-2, shared memory   expand_v=1, num_memories=4, topk=2,
                                                                   shared_mem=True, mom_backend="gated_deltanet")``
================  ===============================================  =================================================

Every peer keeps its own defaults otherwise (fla's fused cross-entropy and norms, HF's loss), as a
user of it gets them. A peer whose package is not importable is reported with the reason, not
built; fla's gated kernels refuse their backward on Hopper with Triton 3.4 to 3.7.0 (fla issue 640),
which :func:`training_refusal` reports before building.

Example:
    >>> shape = ModelShape(vocab_size=128, hidden_size=64, num_layers=4)
    >>> shape.mlp_width, shape.hybrid_pattern
    (256, 'LLLN')
    >>> model, note = build_model("hybrid", shape, device="cpu")
    >>> model.config.layer_pattern, model.config.num_heads
    ('LLLN', 8)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

#: linmem architectures, in table order
ARCHITECTURES = ("transformer", "gla", "deltanet", "gated_deltanet", "hybrid", "fox", "mom")
#: the peer of each architecture: HF Llama for the transformer, fla's model of the same name otherwise
PEER_OF = {"transformer": "llama", **{a: f"fla-{a}" for a in ARCHITECTURES if a != "transformer"}}
PEERS = tuple(PEER_OF.values())
#: the peers whose backward runs fla's gated ``chunk_bwd_dqkwg`` (refused on Hopper, Triton 3.4 - 3.7.0)
FLA_GATED_BACKWARD = ("fla-gated_deltanet", "fla-hybrid", "fla-mom")


@dataclass(frozen=True)
class ModelShape:
    """The size every model of a benchmark run shares."""

    vocab_size: int = 32000  # tokens in the vocabulary
    hidden_size: int = 1024  # model width D; head dims follow from it (D / 16 for attention)
    num_layers: int = 24  # blocks
    max_positions: int = 132096  # position capacity of the configs that ask for one (128K + 1K)

    def __post_init__(self) -> None:
        if self.hidden_size % 64:
            raise ValueError(f"hidden_size must be a multiple of 64 (16 heads of D / 16 and GLA's D / 8), "
                             f"got {self.hidden_size}")
        if self.num_layers < 1 or self.vocab_size < 2:
            raise ValueError(f"num_layers >= 1 and vocab_size >= 2 expected, got {self.num_layers}, {self.vocab_size}")

    @property
    def mlp_width(self) -> int:
        """fla's SwiGLU width: int(8 D / 3) rounded up to a multiple of 256."""
        return 256 * -(-int(self.hidden_size * 4 * 2 / 3) // 256)

    @property
    def hybrid_pattern(self) -> str:
        """One softmax attention layer in four, the fourth: ``"LLLN" * (num_layers / 4)``."""
        return "".join("N" if i % 4 == 3 else "L" for i in range(self.num_layers))


@dataclass
class ModelSpec:
    """What a row of a table is: its label, family ("linmem", "hf", "fla") and architecture."""

    key: str
    label: str
    family: str
    arch: str


def model_spec(key: str) -> ModelSpec:
    """The spec of a linmem architecture or a peer key; unknown keys are refused with the valid ones."""
    if key in ARCHITECTURES:
        return ModelSpec(key, f"linmem {key}", "linmem", key)
    if key == "llama":
        return ModelSpec(key, "HF Llama (SDPA)", "hf", "transformer")
    if key in PEERS:
        return ModelSpec(key, f"fla {key[4:]}", "fla", key[4:])
    raise ValueError(f"unknown model {key!r}; valid: {', '.join(ARCHITECTURES + PEERS)}")


def row_keys(models: tuple[str, ...], peers: tuple[str, ...]) -> list[str]:
    """Table order: each architecture with its peer (when timed) above it, peers of no listed model last."""
    keys = []
    for arch in models:
        keys += [PEER_OF[arch]] if PEER_OF[arch] in peers else []
        keys.append(arch)
    return keys + [p for p in peers if p not in keys]


def linmem_config_kwargs(arch: str, shape: ModelShape) -> dict:
    """``LinmemConfig`` keywords of a linmem architecture at ``shape`` (the table of the module docstring)."""
    D, L = shape.hidden_size, shape.num_layers
    common = dict(vocab_size=shape.vocab_size, hidden_size=D, intermediate_size=shape.mlp_width,
                  tie_word_embeddings=False)
    gated_deltanet = dict(memory="gated_deltanet", num_heads=4, mixer=dict(head_dim=D // 4, expand_v=1.0))
    hybrid = dict(memory="gated_deltanet", num_heads=8, mixer=dict(head_dim=D // 8, expand_v=1.0))  # attention too
    per_arch = {
        "transformer": dict(layer_pattern="N" * L, attention="softmax", num_heads=16),
        "gla": dict(layer_pattern="L" * L, memory="gla", num_heads=4, mixer=dict(head_dim=D // 8, expand_v=2.0)),
        "deltanet": dict(layer_pattern="L" * L, memory="deltanet", num_heads=8),
        "gated_deltanet": dict(layer_pattern="L" * L, **gated_deltanet),
        "hybrid": dict(layer_pattern=shape.hybrid_pattern, attention="softmax", **hybrid),
        "fox": dict(layer_pattern="N" * L, attention="fox", num_heads=16),
        "mom": dict(layer_pattern="L" * L, memory="mom", num_heads=4, mixer=dict(head_dim=D // 4, expand_v=1.0),
                    mom=dict(memory="gated_deltanet", num_memories=4, top_k=2, shared_memory=True)),
    }
    if arch not in per_arch:
        raise ValueError(f"unknown linmem architecture {arch!r}; valid: {', '.join(per_arch)}")
    return common | per_arch[arch]


def _llama(shape: ModelShape) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.mlp_width, num_hidden_layers=shape.num_layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=shape.max_positions,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _fla(arch: str, shape: ModelShape) -> nn.Module:
    models = importlib.import_module("fla.models")  # ImportError: reported as "fla not installed"
    D = shape.hidden_size
    common = dict(vocab_size=shape.vocab_size, hidden_size=D, num_hidden_layers=shape.num_layers,
                  intermediate_size=shape.mlp_width, tie_word_embeddings=False, norm_eps=1e-6,
                  max_position_embeddings=shape.max_positions)
    gated_deltanet = dict(num_heads=4, head_dim=D // 4, expand_v=1.0)
    attention_layers = [i for i, letter in enumerate(shape.hybrid_pattern) if letter == "N"]
    config_class, model_class, kwargs = {
        "gla": ("GLAConfig", "GLAForCausalLM", dict(num_heads=4, expand_k=0.5, expand_v=1.0)),
        "deltanet": ("DeltaNetConfig", "DeltaNetForCausalLM", dict(num_heads=8, expand_k=1.0, expand_v=1.0)),
        "gated_deltanet": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM", gated_deltanet),
        "hybrid": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM",
                   dict(num_heads=8, head_dim=D // 8, expand_v=1.0, attn={"layers": attention_layers, "num_heads": 8})),
        "fox": ("ForgettingTransformerConfig", "ForgettingTransformerForCausalLM", dict(num_heads=16)),
        "mom": ("MomConfig", "MomForCausalLM", dict(num_heads=4, head_dim=D // 4, expand_v=1.0, num_memories=4,
                                                    topk=2, shared_mem=True, mom_backend="gated_deltanet")),
    }[arch]
    return getattr(models, model_class)(getattr(models, config_class)(**common, **kwargs))


def build_model(key: str, shape: ModelShape, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                activation_checkpointing: bool = False, mixer: Optional[dict] = None,
                recurrence_backend: str = "auto") -> tuple[nn.Module, str]:
    """``(model, note)``: the model of ``key`` built on ``device`` in ``dtype``; the note says what was asked
    and not done (activation checkpointing on a config without the option). Peers' import errors propagate.

    ``activation_checkpointing`` is set on linmem configs that have the ``activation_checkpointing`` field;
    peers always run without it. ``mixer`` sets keys of a linmem config's ``mixer`` section (FoX's
    ``prune_tolerance``); peers are built without it. ``recurrence_backend`` is a linmem config's
    ``linear_recurrence`` backend (``"triton"`` runs the kernels on a CPU through the Triton interpreter); peers run
    their own kernels.
    """
    spec = model_spec(key)
    note = ""
    with torch.device(device):
        if spec.family == "hf":
            model = _llama(shape)
        elif spec.family == "fla":
            model = _fla(spec.arch, shape)
        else:
            from ..models import LinmemConfig, LinmemForCausalLM
            from ..models.config import merge_fields

            config = LinmemConfig(**merge_fields(linmem_config_kwargs(spec.arch, shape), {"mixer": mixer or {}}),
                                  recurrence_backend=recurrence_backend)
            if activation_checkpointing:
                if hasattr(config, "activation_checkpointing"):
                    config.activation_checkpointing = True
                else:
                    note = "LinmemConfig has no activation_checkpointing: run without"
            model = LinmemForCausalLM(config)
    return model.to(dtype), note


def training_refusal(key: str, device: str) -> Optional[str]:
    """Why a peer cannot train here, known before building it, or None.

    fla 0.6.0 raises in the backward of its gated kernels on Hopper with Triton 3.4 to 3.7.0 (a
    miscompilation gave wrong gradients, fla issue 640); its own flags say whether this stack is in
    that range. Refusals discovered only while running are reported as the cell's error.
    """
    if key not in FLA_GATED_BACKWARD or not str(device).startswith("cuda"):
        return None
    try:
        flags = importlib.import_module("fla.ops.common.chunk_o")
    except ImportError:
        return None  # fla not installed: reported when building
    hopper = getattr(flags, "IS_NVIDIA_HOPPER", False)
    in_range = getattr(flags, "TRITON_ABOVE_3_4_0", False) and not getattr(flags, "TRITON_ABOVE_3_7_1", True)
    if hopper and in_range:
        import triton

        return (f"fla refuses its gated backward on Hopper with Triton 3.4 to 3.7.0 (fla issue 640); "
                f"Triton {triton.__version__}")
    return None


def unavailable_reason(error: ImportError) -> str:
    """A short reason for a peer whose package (fla, flash-attn) is missing."""
    name = getattr(error, "name", None) or ""
    if name.split(".")[0] == "fla":
        return "fla not installed"
    return f"not importable: {str(error).splitlines()[0][:160]}"


def parse_keys(text: str, valid: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma list of keys, each one of ``valid``; an unknown one raises ValueError naming the valid ones."""
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in keys if k not in valid]
    if bad:
        raise ValueError(f"unknown {what} {', '.join(bad)}; valid: {', '.join(valid)}")
    return keys


def parse_peers(text: str, models: tuple[str, ...]) -> tuple[str, ...]:
    """``--peers``: "auto" is the peer of every model of ``models``, else a comma list of peer keys."""
    if text == "auto":
        return tuple(PEER_OF[m] for m in models)
    return parse_keys(text, PEERS, "peer")


def add_common_arguments(parser, default_models: tuple[str, ...], peers_const: str, out: str) -> None:
    """The options ``linmem bench models`` and ``linmem bench decode`` share."""
    parser.add_argument("--models", default=",".join(default_models),
                        help=f"linmem architectures, comma list of {', '.join(ARCHITECTURES)}")
    bare = "the peer of every model of --models" if peers_const == "auto" else peers_const
    parser.add_argument("--peers", nargs="?", const=peers_const, default="",
                        help=f"also time peers of the same shape in the same run; bare: {bare}; "
                             f"or a comma list of {', '.join(PEERS)}")
    parser.add_argument("--hidden-size", type=int, default=1024, help="model width D")
    parser.add_argument("--layers", type=int, default=24, help="blocks")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="weights (and, in training, gradients and optimizer states)")
    parser.add_argument("--budget-s", type=float,
                        help="start no new cell after this many seconds; the rest is reported 'not run'")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=out, help="folder of the JSON and Markdown tables (and plots)")


def shape_from_args(args) -> ModelShape:
    return ModelShape(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.layers)
