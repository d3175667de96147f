"""Linearize a pretrained Transformer (Llama / Mistral / Qwen2 / Qwen3) into a gated recurrent or hybrid
model with no new parameters (Liger, arXiv 2503.01496), and fine-tune it with LoRA.

    linmem linearize --from checkpoints/llama --out checkpoints/liger --memory gla --window 64
    linmem train data.task=instruct model.pretrained=checkpoints/liger lora.rank=8 ...

A trained Gated DeltaNet model becomes a Bayesian-memory model over the same weights
(:func:`gated_deltanet_to_bayes`, Memory by Design's distillation).
"""

from .bayes import BayesConversion, gated_deltanet_to_bayes
from .checkpoint import SUPPORTED_FAMILIES, Architecture, UnsupportedCheckpointError, architecture
from .convert import LinearizeOptions, LinearizeResult, layer_pattern, linearize
from .lora import apply_lora, save_lora

__all__ = [
    "BayesConversion",
    "gated_deltanet_to_bayes",
    "SUPPORTED_FAMILIES",
    "Architecture",
    "UnsupportedCheckpointError",
    "architecture",
    "LinearizeOptions",
    "LinearizeResult",
    "layer_pattern",
    "linearize",
    "apply_lora",
    "save_lora",
]
