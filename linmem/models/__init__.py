"""One configurable model (layer pattern) + Hugging Face integration + decoding cache.

Names are loaded on first use, so that ``linmem.models.config`` alone (what ``AutoConfig`` needs)
does not import the modelling code. :func:`register_auto_config` makes ``AutoConfig`` build a
:class:`LinmemConfig` (``import linmem`` calls it as soon as transformers' ``AutoConfig`` is
imported); :func:`register_auto_models` makes ``AutoModel`` / ``AutoModelForCausalLM`` build linmem
models (the first :class:`LinmemConfig` calls it: every Auto path to a model goes through a config).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import import_module
from typing import Any

_EXPORTS = {
    "LinmemCache": "cache",
    "LinmemConfig": "config",
    "LinmemForCausalLM": "modeling",
    "LinmemModel": "modeling",
    "MODEL_RECIPES": "recipes",
    "ModelRecipe": "recipes",
    "StaticLinmemCache": "cache",
    "model_recipe": "recipes",
}

__all__ = [*_EXPORTS, "register_auto_config", "register_auto_models"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def register_auto_config() -> None:
    """``AutoConfig`` builds a :class:`LinmemConfig` for ``model_type="linmem"``."""
    from transformers import AutoConfig

    from .config import LinmemConfig

    AutoConfig.register(LinmemConfig.model_type, LinmemConfig, exist_ok=True)


@lru_cache(maxsize=1)
def register_auto_models() -> None:
    """``AutoModel`` / ``AutoModelForCausalLM`` build :class:`LinmemModel` / :class:`LinmemForCausalLM`."""
    from transformers import AutoModel, AutoModelForCausalLM

    from .config import LinmemConfig
    from .modeling import LinmemForCausalLM, LinmemModel

    register_auto_config()
    AutoModel.register(LinmemConfig, LinmemModel, exist_ok=True)
    AutoModelForCausalLM.register(LinmemConfig, LinmemForCausalLM, exist_ok=True)
