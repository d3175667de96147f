"""Training: config dataclasses, data pipeline, trainer, checkpoints."""

from .checkpoint import CheckpointError
from .config import ConfigError, TrainConfig, apply_overrides, load_config
from .trainer import Trainer, TrainResult, build_model

__all__ = ["CheckpointError", "ConfigError", "TrainConfig", "TrainResult", "Trainer", "apply_overrides",
           "build_model", "load_config"]
