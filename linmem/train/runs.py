"""A finished (or checkpointed) run directory, loaded back for evaluation and generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..models import LinmemForCausalLM
from .config import TrainConfig, apply_overrides, load_config
from .corpus import Codec
from .tasks import Task, build_task, text_codec, verify_text_shards
from .trainer import resolve_device


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
    config: TrainConfig
    model: LinmemForCausalLM
    device: torch.device
    run_dir: Path
    _task: Optional[Task] = field(default=None, repr=False)

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
        return text_codec(self.config.data, self.run_dir / "model")

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
        ids = codec.encode(prompt) or codec.start_ids()
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
    """Config (run_dir/config.yaml) and the latest weights (run_dir/model) of a run; its data is
    read only when :attr:`Run.task` is first used."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} is not a linmem run directory (no config.yaml)")
    if not (run_dir / "model").exists():
        raise FileNotFoundError(f"{run_dir} has no model/ yet: its run has not saved a checkpoint")
    config = apply_overrides(load_config(str(run_dir / "config.yaml")), overrides).validate()
    device = resolve_device(config.run.device)
    model = LinmemForCausalLM.from_pretrained(run_dir / "model").to(device).eval()
    return Run(config=config, model=model, device=device, run_dir=run_dir)
