"""A finished (or checkpointed) run directory, or a saved model folder, loaded back for evaluation and generation.

Two kinds of folder load:

* a run directory of ``linmem train`` (``config.yaml`` and the weights in ``model/``), text, instruction or
  MQAR runs alike: its config says how text becomes tokens and which data it holds out;
* a model folder: the ``save_pretrained`` output of a LinmemForCausalLM (``config.json`` and weights), such as
  ``linmem linearize --out`` writes or a run's ``model/``. It has no training config, so it is given the
  config of a text run on the default corpus (``data.text.*`` overrides choose other text), with the
  folder's tokenizer, or UTF-8 bytes when it has none.

A folder holding another model type's checkpoint (a Llama's) is refused, pointing at ``linmem linearize``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..data.codec import Codec
from ..data.corpus import section_codec
from ..models import LinmemForCausalLM
from .config import ConfigError, TrainConfig, apply_overrides, load_config
from .tasks import Task, build_task, text_codec, verify_text_shards
from .trainer import resolve_device

logger = logging.getLogger("linmem.train")


class _TextStream:
    """Receives generated token ids (the ``streamer`` protocol of ``generate``), decodes them and
    passes each newly safe piece of text to ``emit``: a trailing incomplete UTF-8 character, and
    a trailing piece that may begin ``stop``, wait for the next token. Text from ``stop`` on is
    cut and ends generation (:attr:`stopped`)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], emit: Callable[[str], None], stop: Optional[str]):
        self.decode, self.emit, self.stop = decode, emit, stop
        self.ids: list[int] = []
        self.text, self.shown, self.stopped, self.prompt_seen = "", 0, False, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first passes the prompt
            self.prompt_seen = True
            return
        if self.stopped:
            return
        self.ids.extend(value.flatten().tolist())
        text = self.decode(self.ids)
        safe = len(text) - 1 if text.endswith("\ufffd") else len(text)
        if self.stop:
            at = text.find(self.stop)
            if at >= 0:
                text, safe, self.stopped = text[:at], at, True
            else:
                safe = min(safe, _stop_prefix_start(text[:safe], self.stop))
        self.text = text
        self._emit_to(safe)

    def end(self) -> None:
        self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> None:
        if end > self.shown:
            self.emit(self.text[self.shown:end])
            self.shown = end


def _stop_prefix_start(text: str, stop: str) -> int:
    """Where the longest suffix of ``text`` that is a proper prefix of ``stop`` starts (len(text) if none)."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return len(text) - size
    return len(text)


class _StopWhen(StoppingCriteria):
    def __init__(self, stream: _TextStream) -> None:
        self.stream = stream

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.stream.stopped, dtype=torch.bool, device=input_ids.device)


def check_generation_args(*, max_new_tokens: int, temperature: float, top_k: Optional[int],
                          top_p: Optional[float]) -> None:
    """Refuse sampling settings outside their ranges, naming the argument."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


@dataclass
class Run:
    config: TrainConfig  # a model folder's: a text run on the default corpus with the folder's tokenizer
    model: LinmemForCausalLM
    device: torch.device
    run_dir: Path  # the run directory or the model folder (evaluations write to its eval/)
    model_folder: bool = False  # a model folder, without a training config of its own
    _task: Optional[Task] = field(default=None, repr=False)

    @property
    def model_dir(self) -> Path:
        """The folder of the weights (and of a run's saved tokenizer)."""
        return self.run_dir if self.model_folder else self.run_dir / "model"

    @property
    def task(self) -> Task:
        """The run's task with its held-out data (read on first use)."""
        if self._task is None:
            verify_text_shards(self.config.data, ("validation",))
            self._task = build_task(self.config.data)
        return self._task

    @property
    def codec(self) -> Codec:
        """How text becomes tokens (text and instruction runs), without reading the corpus."""
        if self.config.data.task not in ("text", "instruct"):
            raise ValueError(f"{self.run_dir} was trained on {self.config.data.task}, which has no text to generate")
        if self.model_folder:
            return section_codec(self.config.data.text)
        return text_codec(self.config.data, self.model_dir)

    @torch.no_grad()
    def generate(self, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, stop: Optional[str] = None,
                 seed: int = 0, stream: Optional[Callable[[str], None]] = None) -> str:
        """Continue ``prompt`` (text runs): greedy when temperature == 0, else sampled (top-k / top-p).

        Returns the prompt and its continuation, cut before ``stop``; ``stream`` receives the
        continuation piece by piece as it is generated. On CUDA it decodes against a static cache from a
        CUDA graph (``cache_implementation="static"``), elsewhere against the dynamic cache: the same tokens.
        """
        check_generation_args(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"prompt is not valid UTF-8 (character {err.start}: {prompt[err.start]!r})") from err
        if stop == "":
            raise ValueError("stop must be a non-empty string")
        codec = self.codec
        ids = codec.encode(prompt) or [codec.prefix_token_id]
        text_stream = _TextStream(codec.decode, stream or (lambda piece: None), stop)
        sampling = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0 else \
            dict(do_sample=False)
        config = self.model.config
        pad = next((t for t in (config.pad_token_id, config.eos_token_id) if t is not None), 0)
        torch.manual_seed(seed)
        cache = {"cache_implementation": "static"} if self.device.type == "cuda" else {}
        self.model.generate(torch.tensor([ids], device=self.device), max_new_tokens=max_new_tokens,
                            pad_token_id=pad, streamer=text_stream,
                            stopping_criteria=StoppingCriteriaList([_StopWhen(text_stream)]), **sampling, **cache)
        text_stream.end()
        return prompt + text_stream.text


def load_run(run_dir: Path, overrides: Sequence[str] = ()) -> Run:
    """A run directory (``config.yaml`` and the latest weights in ``model/``) or a model folder (``config.json``
    and weights, see the module), with ``overrides`` applied to its config; its data is read only when
    :attr:`Run.task` is first used.

    Example:
        >>> run = load_run(Path("checkpoints/liger"))  # doctest: +SKIP
        >>> run.model_folder, run.codec.name  # doctest: +SKIP
        (True, 'checkpoints/liger')
    """
    run_dir = Path(run_dir)
    if (run_dir / "config.yaml").exists():
        return _load_run_directory(run_dir, overrides)
    if (run_dir / "config.json").exists():
        return _load_model_folder(run_dir, overrides)
    raise FileNotFoundError(f"{run_dir} is neither a linmem run directory (no config.yaml) nor a model folder "
                            "(no config.json)")


def _load_run_directory(run_dir: Path, overrides: Sequence[str]) -> Run:
    if not (run_dir / "model").exists():
        raise FileNotFoundError(f"{run_dir} has no model/ yet: its run has not saved a checkpoint")
    config = apply_overrides(load_config(str(run_dir / "config.yaml")), overrides).validate()
    device = resolve_device(config.run.device)
    model = LinmemForCausalLM.from_pretrained(run_dir / "model").to(device).eval()
    return Run(config=config, model=model, device=device, run_dir=run_dir)


def model_folder_config(folder: Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config a model folder is evaluated and sampled with: a text run on the default corpus, its
    tokenizer the folder's (when it holds ``tokenizer_config.json``) or bytes, then ``overrides``.

    Example:
        >>> model_folder_config(Path("checkpoints/liger")).data.text.tokenizer  # doctest: +SKIP
        'checkpoints/liger'
    """
    config = TrainConfig()
    config.data.task = "text"
    config.data.text.tokenizer = str(folder) if (folder / "tokenizer_config.json").exists() else None
    config = apply_overrides(config, overrides).validate()
    if config.data.task != "text":
        raise ConfigError(f"data.task={config.data.task}: {folder} is a model folder, evaluated and sampled as a "
                          "text model (data.text.* choose its text and tokenizer)")
    return config


def _load_model_folder(folder: Path, overrides: Sequence[str]) -> Run:
    config = model_folder_config(folder, overrides)
    device = resolve_device(config.run.device)
    model = LinmemForCausalLM.from_pretrained(folder).to(device).eval()
    run = Run(config=config, model=model, device=device, run_dir=folder, model_folder=True)
    codec = run.codec
    if codec.vocab_size > model.config.vocab_size:
        raise ValueError(f"{folder}: the model has {model.config.vocab_size} tokens, fewer than its text codec's "
                         f"{codec.vocab_size} ({codec.name}): give it its own tokenizer with data.text.tokenizer=DIR")
    logger.info("%s is a model folder (no config.yaml): text goes through %s", folder,
                f"the tokenizer in {codec.name}" if codec.tokenizer is not None else
                "UTF-8 bytes (the folder holds no tokenizer; data.text.tokenizer=DIR gives it one)")
    return run
