"""linmem: memory layers of sequence models under one unified linear recurrence.

``import linmem`` is cheap: it imports neither torch nor transformers. The names below load on first
use (``from linmem import LinmemForCausalLM, LinmemConfig``), and linmem registers itself with
transformers' Auto classes (``AutoConfig.for_model("linmem")``, ``AutoModelForCausalLM``) as soon as
transformers' ``AutoConfig`` is imported, before or after linmem.
"""

from __future__ import annotations

import importlib.machinery
import sys
from importlib import import_module
from types import ModuleType
from typing import Any, Callable

__version__ = "0.1.0"

_EXPORTS = {
    "LinmemCache": "linmem.models",
    "LinmemConfig": "linmem.models",
    "LinmemForCausalLM": "linmem.models",
    "LinmemModel": "linmem.models",
    "MODEL_RECIPES": "linmem.models",
    "model_recipe": "linmem.models",
    "MixerArgs": "linmem.layers",
    "build_mixer": "linmem.layers",
    "mixer_names": "linmem.layers",
    "linear_recurrence": "linmem.ops",
    "linear_recurrence_step": "linmem.ops",
    "forgetting_attention": "linmem.ops.attention",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _AfterImport:
    """A meta path finder that runs a callback once a given module has been executed (its first import)."""

    def __init__(self, module: str, callback: Callable[[], None]) -> None:
        self.module, self.callback = module, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec


class _CallbackLoader:
    """A module's own loader, followed by a callback once the module has run."""

    def __init__(self, loader: Any, callback: Callable[[], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.callback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _register_auto_config() -> None:
    import_module("linmem.models").register_auto_config()


_AUTO_CONFIG = "transformers.models.auto.configuration_auto"
if _AUTO_CONFIG in sys.modules:
    _register_auto_config()
else:
    sys.meta_path.insert(0, _AfterImport(_AUTO_CONFIG, _register_auto_config))
