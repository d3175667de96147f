"""Named model recipes of real sizes.

Sizes follow the papers: the 340M / 1.3B settings of MoM (arXiv 2502.13685: 24 layers,
width 1024 / 2048, Llama tokenizer of 32000 tokens) and FoX's 760M setting (arXiv
2503.02130: 24 layers, width 1536), and the Linear-MoE families (arXiv 2503.05447)
A0.3B-2B (width 1024, 12 layers) and A1B-7B (width 2048, 16 layers), both with 64 SwiGLU
experts of width 896 / 1024, 8 per token, pure (``L`` only) or hybrid (``LLLN`` repeated).
MoM's own models (``mom-340m``, ``mom-1.3b`` and their ``-hybrid`` forms, ``LLLN`` repeated with
softmax attention) route each token to 2 of 4 Gated DeltaNet memories plus a shared one.

A recipe's name carries the paper's label (``nominal_params``; ``nominal_active_params`` for
mixtures of experts); ``params`` / ``active_params`` are the parameters our model of that
config really has (embeddings and an untied ``lm_head`` included), counted on the meta device
(the tests check them). The labels differ from the counts by the papers' conventions (some
leave out embeddings) and by our layers' parameterisation: ``gated_deltanet-340m`` has 394.9M.
MoM's labels name the width and depth of the dense model they are compared with: each memory has
its own key and value projections, so ``mom-340m`` has 597.1M parameters, 496.0M of them used per
token, where the same model with one Gated DeltaNet memory per layer has 394.9M.
Every mixer of a model has the same heads, so the hybrids have heads of 128: a head dim of the
attention kernels (32 to 256), which serve packed batches that SDPA does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .config import LinmemConfig, merge_fields


@dataclass(frozen=True)
class ModelRecipe:
    """A named configuration with the size the papers call it."""

    name: str
    nominal_params: float  # in millions, as the source names it
    params: float  # in millions, counted: every parameter of LinmemForCausalLM(build_config())
    config: dict[str, Any] = field(default_factory=dict)  # LinmemConfig fields and sections
    nominal_active_params: Optional[float] = None  # in millions: the source's label of the parameters one token uses
    active_params: Optional[float] = None  # in millions, counted: the parameters one token uses (MoE models)

    def build_config(self, **overrides: Any) -> LinmemConfig:
        """The config, ``overrides`` on top (a section key by key: ``moe={"num_experts": 4}`` keeps the rest)."""
        return LinmemConfig(**merge_fields(self.config, overrides))


def _sized(width: int, heads: int) -> dict[str, Any]:
    return dict(vocab_size=32000, hidden_size=width, num_heads=heads, layer_pattern="L" * 24)


def _mom(width: int, heads: int, hybrid: bool) -> dict[str, Any]:
    """MoM: 4 Gated DeltaNet memories per layer, top-2, and a shared memory; hybrids have ``LLLN`` x 6."""
    return {**_sized(width, heads), "memory": "mom", "layer_pattern": "LLLN" * 6 if hybrid else "L" * 24,
            "mom": {"memory": "gated_deltanet", "num_memories": 4, "top_k": 2, "shared_memory": True}}


def _linear_moe(width: int, layers: int, expert_width: int, hybrid: bool) -> dict[str, Any]:
    """Linear-MoE: Gated DeltaNet memories (any rule fits: override ``memory``), 64 experts, top-8."""
    return dict(vocab_size=32000, hidden_size=width, num_heads=width // 128, memory="gated_deltanet",
                layer_pattern="LLLN" * (layers // 4) if hybrid else "L" * layers, mlp="moe",
                moe={"num_experts": 64, "num_experts_per_tok": 8, "intermediate_size": expert_width})


MODEL_RECIPES: dict[str, ModelRecipe] = {
    r.name: r
    for r in [
        ModelRecipe("gated_deltanet-340m", 340, 394.9, {**_sized(1024, 4), "memory": "gated_deltanet"}),
        ModelRecipe("gated_deltanet-1.3b", 1300, 1447.6, {**_sized(2048, 8), "memory": "gated_deltanet"}),
        ModelRecipe("gla-340m", 340, 332.0, {**_sized(1024, 4), "memory": "gla", "mixer": {"head_dim": 128}}),
        ModelRecipe("gla-1.3b", 1300, 1195.6, {**_sized(2048, 8), "memory": "gla", "mixer": {"head_dim": 128}}),
        ModelRecipe("mamba2-340m", 340, 423.3,
                    {**_sized(1024, 16), "memory": "mamba2", "mixer": {"head_dim": 64, "expand_v": 2.0}}),
        ModelRecipe("hybrid-gdn-340m", 340, 388.6,  # heads of 128, a head dim of the attention kernels
                    {**_sized(1024, 8), "memory": "gated_deltanet", "layer_pattern": "LLLN" * 6}),
        ModelRecipe("fox-760m", 760, 778.7, dict(vocab_size=32000, hidden_size=1536, num_heads=24,
                                                 layer_pattern="N" * 24, attention="fox")),
        ModelRecipe("fox-pro-760m", 760, 837.2, dict(vocab_size=32000, hidden_size=1536, num_heads=24,
                                                     layer_pattern="N" * 24, attention="fox",
                                                     mixer=dict(qk_norm=True, output_gate=True, output_norm=True,
                                                                kv_shift=True))),
        ModelRecipe("mom-340m", 340, 597.1, _mom(1024, 4, hybrid=False)),
        ModelRecipe("mom-1.3b", 1300, 2256.3, _mom(2048, 8, hybrid=False)),
        ModelRecipe("mom-340m-hybrid", 340, 540.8, _mom(1024, 8, hybrid=True)),  # heads of 128, as hybrid-gdn-340m
        ModelRecipe("mom-1.3b-hybrid", 1300, 2031.5, _mom(2048, 16, hybrid=True)),
        ModelRecipe("transformer-340m", 340, 369.1, {**_sized(1024, 16), "layer_pattern": "N" * 24}),
        ModelRecipe("linear-moe-a0.3b-2b", 2000, 2243.6, _linear_moe(1024, 12, 896, hybrid=False), 300, 393.9),
        ModelRecipe("linear-moe-a0.3b-2b-hybrid", 2000, 2240.3, _linear_moe(1024, 12, 896, hybrid=True), 300, 390.6),
        ModelRecipe("linear-moe-a1b-7b", 7000, 6912.8, _linear_moe(2048, 16, 1024, hybrid=False), 1000, 1275.6),
        ModelRecipe("linear-moe-a1b-7b-hybrid", 7000, 6895.6, _linear_moe(2048, 16, 1024, hybrid=True), 1000, 1258.5),
    ]
}


def model_recipe(name: str) -> ModelRecipe:
    """Look a recipe up by name; unknown names are refused with the list of valid ones."""
    if name not in MODEL_RECIPES:
        raise ValueError(f"unknown model recipe {name!r}; valid: {', '.join(MODEL_RECIPES)}")
    return MODEL_RECIPES[name]
