"""LoRA fine-tuning of a (linearized) model with peft: adapters on the target projections, everything
else frozen, and at the end the adapter plus a merged model that loads without peft.

    W x  ->  W x + (alpha / r) B A x,      A: [r, d_in] (random), B: [d_out, r] (zeros)

As in Liger, the adapters sit on q, k and v by default. Modules an ablation added to the model (a
random gate projection, a learnable feature map) have no pretrained values to keep, so they train in
full (``train_modules``, those the model has). peft is an optional dependency: ``pip install
linmem[liger]``.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel

#: where the trainer writes the adapter (the merged model goes to the run's model/ folder)
ADAPTER_DIR = "adapter"


def _peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError("LoRA needs peft: pip install 'linmem[liger]' (or pip install 'peft>=0.11')") from err
    return peft


def _leaf_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}


def apply_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               targets: Sequence[str] = ("q_proj", "k_proj", "v_proj"),
               train_modules: Sequence[str] = ()) -> "PeftModel":
    """Wrap ``model`` with LoRA adapters of rank ``rank`` on the modules named ``targets``; only the
    adapters and the modules of ``train_modules`` that the model has stay trainable.

    A target the model has no module of is refused (ValueError naming it and the model's module names).

    Example:
        >>> from linmem.models import LinmemConfig, LinmemForCausalLM
        >>> model = LinmemForCausalLM(LinmemConfig(vocab_size=64, hidden_size=32, num_heads=2, layer_pattern="L",
        ...                                        memory="liger", intermediate_size=64))
        >>> tuned = apply_lora(model, rank=4, alpha=8)
        >>> sorted({n.split(".")[-2] for n, p in tuned.named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']
    """
    peft = _peft()
    names = _leaf_names(model)
    unknown = [t for t in targets if t not in names]
    if unknown or not targets:
        raise ValueError(f"lora.targets: the model has no module named {unknown[0] if unknown else '(none given)'!r}; "
                         f"its modules: {', '.join(sorted(names))}")
    if rank < 1:
        raise ValueError(f"lora.rank must be >= 1, got {rank}")
    saved = [name for name in train_modules if name in names]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                             modules_to_save=saved or None, bias="none")
    with warnings.catch_warnings():  # peft asks a deprecated transformers property
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, config)


def merged_copy(model: "PeftModel") -> nn.Module:
    """A copy of the model with every adapter merged into its weights and peft's wrappers removed
    (``model`` itself keeps training unchanged)."""
    return copy.deepcopy(model).merge_and_unload()


def save_lora(model: "PeftModel", adapter_dir: Path, model_dir: Path) -> None:
    """The adapter (peft's ``adapter_config.json`` + ``adapter_model.safetensors``) to ``adapter_dir``
    and the merged model (a plain LinmemForCausalLM folder) to ``model_dir``."""
    model.save_pretrained(str(adapter_dir))
    merged_copy(model).save_pretrained(model_dir)
