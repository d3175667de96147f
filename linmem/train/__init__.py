"""Training: config dataclasses, data pipeline, trainer, checkpoints, run directories."""

from .checkpoint import CheckpointError
from .config import ConfigError, TrainConfig, apply_overrides, load_config
from .data import DataError
from .rundir import RunError
from .trainer import Interrupted, Trainer, TrainResult, build_model

__all__ = ["CheckpointError", "ConfigError", "DataError", "Interrupted", "RunError", "TrainConfig", "TrainResult",
           "Trainer", "apply_overrides", "build_model", "load_config"]
