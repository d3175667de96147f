"""Training: config dataclasses, tasks, trainer, checkpoints, run directories (the data itself: :mod:`linmem.data`).

Names load on first use, so that the config (:mod:`linmem.train.config`) imports without torch and a
command whose config is wrong answers at once.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CheckpointError": "checkpoint",
    "ConfigError": "config",
    "TrainConfig": "config",
    "apply_overrides": "config",
    "load_config": "config",
    "RunError": "rundir",
    "Interrupted": "trainer",
    "Trainer": "trainer",
    "TrainResult": "trainer",
    "build_model": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
