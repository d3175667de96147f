"""A run directory or a model folder opened for evaluation: its model, tokenizer and training length.

Example:
    >>> run = open_run("runs/text-hybrid-tiny")  # doctest: +SKIP
    >>> run.codec.vocab_size, run.train_length  # doctest: +SKIP
    (256, 256)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ..data.codec import Codec
from ..models import LinmemForCausalLM
from ..train.runs import Run, load_run
from ..train.trainer import resolve_device

PathLike = Union[str, Path]


@dataclass
class EvalRun:
    """A run directory opened for evaluation: its config, model, tokenizer and (on first use) its task."""

    run_dir: Path
    loaded: Run  # the run as the trainer's loader returns it
    model: LinmemForCausalLM
    device: torch.device
    codec: Optional[Codec]  # None for MQAR runs (token ids, no text)
    train_length: int  # tokens per training sequence (text: per document piece)

    @property
    def config(self):
        return self.loaded.config

    @property
    def task_kind(self) -> str:
        return self.config.data.task

    @property
    def task(self):
        return self.loaded.task


def open_run(run_dir: PathLike, overrides: Sequence[str] = (), device: Optional[str] = None) -> EvalRun:
    """Load a run directory (``config.yaml``, ``model/``) or a model folder (``config.json``, weights: see
    :func:`~linmem.train.runs.load_run`) for evaluation, on ``device`` if given.

    Text goes through the run's tokenizer (the one saved beside its weights, else its config's, else
    bytes), a model folder's through its own (else bytes). The training length of a text run is its
    document length (``data.max_document_tokens``), of an instruction run its example length, and of a
    model folder the default document length (1024 tokens).

    Example:
        >>> run = open_run("runs/text-hybrid-tiny")  # doctest: +SKIP
        >>> run.train_length  # doctest: +SKIP
        256
    """
    run_dir = Path(run_dir)
    if device is not None:  # refused by name before the run loads, then loaded onto it directly
        resolve_device(device, option="device")
        overrides = [*overrides, f"run.device={device}"]
    loaded = load_run(run_dir, overrides=overrides)
    model, run_device = loaded.model, loaded.device
    data = loaded.config.data
    if data.task == "mqar":
        codec = None
        train_length = max(seq_len for seq_len, _ in data.mqar.settings)
    else:
        codec = loaded.codec
        train_length = min(data.instruct.max_tokens, data.tokens_per_batch) if data.task == "instruct" else \
            data.max_document_tokens or data.tokens_per_batch
    return EvalRun(run_dir=run_dir, loaded=loaded, model=model, device=run_device, codec=codec,
                   train_length=int(train_length))
