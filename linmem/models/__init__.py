"""One configurable model (layer pattern) + Hugging Face integration + decoding cache."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import LinmemCache
from .config import LinmemConfig
from .modeling import LinmemForCausalLM, LinmemModel
from .recipes import MODEL_RECIPES, ModelRecipe, model_recipe

AutoConfig.register(LinmemConfig.model_type, LinmemConfig, exist_ok=True)
AutoModel.register(LinmemConfig, LinmemModel, exist_ok=True)
AutoModelForCausalLM.register(LinmemConfig, LinmemForCausalLM, exist_ok=True)

__all__ = ["LinmemCache", "LinmemConfig", "LinmemForCausalLM", "LinmemModel", "MODEL_RECIPES", "ModelRecipe", "model_recipe"]
