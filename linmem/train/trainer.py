"""The trainer: AdamW with warm-up + cosine, clipping, accumulation, bf16 autocast on GPU,
skip-and-count of non-finite steps, atomic checkpoints and exact resume.

A run owns its directory (:mod:`linmem.train.rundir`) while it trains: a second run there
is refused, a different config is refused before anything is written, a finished run is
left as it is. The first SIGINT / SIGTERM ends the current step, saves a checkpoint and
raises :class:`Interrupted` (a second one stops at once).

Example:
    >>> from linmem.train import Trainer, load_config
    >>> cfg = load_config(overrides=["schedule.steps=20", "run.out_dir=/tmp/linmem-doc", "run.progress=false"])
    >>> result = Trainer(cfg).train()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..models import LinmemConfig, LinmemForCausalLM, model_recipe
from ..models.modeling import LinmemCausalLMOutput
from ..ops.routing import load_summary
from .checkpoint import (CheckpointError, latest_valid_checkpoint, load_checkpoint, remove_stale_temporaries,
                         save_checkpoint)
from .config import ConfigError, ModelSection, TrainConfig
from .metrics import MetricsLog
from .rundir import CONFIG, RunLock, check_run_directory, mark_finished, start_over, write_atomically
from .tasks import Task, build_task

logger = logging.getLogger("linmem.train")


@dataclass
class TrainResult:
    out_dir: Path
    steps: int  # optimiser steps done in total
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss, this process
    metrics: dict[str, float] = field(default_factory=dict)  # last evaluation
    skipped_steps: int = 0  # non-finite steps skipped
    already_finished: bool = False  # the directory held a finished run: nothing was done


class Interrupted(Exception):
    """Training stopped by a signal after saving a checkpoint; ``exit_code`` is 128 + the signal."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"interrupted at step {step}, checkpoint saved; run the same command to resume")
        self.step, self.signum, self.exit_code = step, signum, 128 + signum


def build_model(section: ModelSection, vocab_size: int,
                special_tokens: Optional[dict[str, Optional[int]]] = None) -> LinmemForCausalLM:
    """A LinmemForCausalLM from the model section (recipe, then fields, then options).

    ``special_tokens``: bos/eos/pad token ids of the tokenizer (``model.options`` may override them).
    """
    options = {**(special_tokens or {}), **section.options}
    if section.pretrained is not None:
        model = LinmemForCausalLM.from_pretrained(section.pretrained, **section.options)
        if vocab_size > model.config.vocab_size:
            raise ConfigError(f"model.pretrained {section.pretrained} has {model.config.vocab_size} tokens, fewer than "
                              f"the task's {vocab_size}: give the data the model's tokenizer")
        return model
    if section.recipe is not None:
        config = model_recipe(section.recipe).build_config(vocab_size=vocab_size, **options)
    else:
        config = LinmemConfig(vocab_size=vocab_size, hidden_size=section.hidden_size, num_heads=section.num_heads,
                              layer_pattern=section.layer_pattern, memory=section.memory,
                              attention=section.attention, **options)
    return LinmemForCausalLM(config)


def resolve_device(name: str) -> torch.device:
    """``run.device`` as a torch device; a device this machine lacks is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"run.device={name!r} is not a device: use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device={name!r}, but CUDA is not available here (torch {torch.__version__}, "
                              f"cuda build {torch.version.cuda}): use run.device=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"run.device={name!r}, but there are {torch.cuda.device_count()} CUDA devices")
    elif device.type != "cpu":
        raise ConfigError(f"run.device={name!r}: the trainer runs on cpu or cuda")
    return device


def check_single_process() -> None:
    """Refuse a launch of several processes (torchrun): each would train its own copy of the run."""
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.isdigit() and int(world_size) > 1:
        raise ConfigError(f"WORLD_SIZE={world_size}: distributed training is not available yet; "
                          f"run one process (python -m linmem.cli train ... or linmem train ...)")


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine down to min_ratio at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.dim() >= 2 and not name.endswith("bias")  # stacked per-memory biases (MoM) are 2-D
        (decay if matrix and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64))}
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def _python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


class _StopSignals:
    """While active, the first SIGINT or SIGTERM is recorded in ``received`` (training stops
    after the current step); a second one raises KeyboardInterrupt at once. Only in the main
    thread (elsewhere signals stay as they are)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> "_StopSignals":
        self.received: Optional[int] = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        logger.warning("%s: stopping after this step and saving a checkpoint (again to stop at once, unsaved)",
                       signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


class Trainer:
    """Train a LinmemForCausalLM on a task as the config says.

    Args:
        config: a validated :class:`TrainConfig`.
        task: an already built task (to share data between runs); built from the config if None.
    """

    def __init__(self, config: TrainConfig, task: Optional[Task] = None) -> None:
        self.config = config.validate()
        check_single_process()
        self.out_dir = Path(config.run.out_dir)
        self.device = resolve_device(config.run.device)
        check_run_directory(config)  # a different config is refused before the data is read
        _seed_everything(config.run.seed)
        self.task = task if task is not None else build_task(config.data)
        special = self.task.codec.special_tokens() if self.task.codec is not None else {}
        self.model = build_model(config.model, self.task.vocab_size, special).to(self.device)
        if config.lora.rank:  # adapters on the targets, everything else frozen
            from ..linearize.lora import apply_lora

            lora = config.lora
            self.model = apply_lora(self.model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                    targets=lora.targets, train_modules=lora.train_modules)
        o = config.optim
        self.optimizer = torch.optim.AdamW(_param_groups(self.model, o.weight_decay), lr=o.lr,
                                           betas=(o.beta1, o.beta2), eps=o.eps,
                                           fused=self.device.type == "cuda")
        s = config.schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: cosine_with_warmup(step, s.warmup_steps, s.steps, s.min_lr_ratio))
        self.autocast_dtype = torch.bfloat16 if (
            config.run.dtype == "bf16" or (config.run.dtype == "auto" and self.device.type == "cuda")) else None
        self.forward = torch.compile(self.model) if config.run.compile else self.model
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.saved_step: Optional[int] = None  # step of the newest checkpoint on disk

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
    def _resume(self) -> None:
        try:
            path = latest_valid_checkpoint(self.checkpoint_dir)
        except CheckpointError as err:
            raise CheckpointError(f"{err}; set run.resume=false to start over (removes them)") from err
        if path is None:
            return
        state, rng = load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.step, self.skipped_steps, self.tokens_seen = state["step"], state["skipped_steps"], state["tokens_seen"]
        self.task.train_batches.load_state_dict(state["data"])
        version, internal, gauss = state["python_rng"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(rng["torch"])
        np_state = list(np.random.get_state())
        np_state[1] = rng["numpy"].numpy().astype(np.uint32)
        np.random.set_state(tuple(np_state))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(rng["cuda"]))
        self.saved_step = self.step
        logger.info("resumed from %s (step %d)", path, self.step)

    def save(self) -> Path:
        state = {"skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen,
                 "data": self.task.train_batches.state_dict(), "python_rng": _python_rng(),
                 "config": self.config.to_dict()}
        path = save_checkpoint(self.checkpoint_dir, self.step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, trainer_state=state, rng_state=_rng_state(),
                               keep=self.config.run.keep_checkpoints)
        if self.config.lora.rank:  # the adapter, and the merged weights in model/
            from ..linearize.lora import ADAPTER_DIR, save_lora

            save_lora(self.model, self.out_dir / ADAPTER_DIR, self.out_dir / "model")
        else:
            self.model.save_pretrained(self.out_dir / "model")  # the latest weights, loadable with from_pretrained
        if self.task.codec is not None and self.task.codec.tokenizer is not None:
            self.task.codec.tokenizer.save_pretrained(str(self.out_dir / "model"))
        self.saved_step = self.step
        return path

    def _micro_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward + backward of one micro-batch: (loss, router metrics)."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.forward(**batch, use_cache=False)
        (out.loss / self.config.schedule.grad_accum).backward()
        self.tokens_seen += batch["input_ids"].numel()
        return out.loss.detach(), _router_metrics(out)

    def evaluate(self, progress: bool = False) -> dict[str, float]:
        self.model.eval()
        try:
            return self.task.evaluate(self.model, self.device, progress=progress)
        finally:
            self.model.train()

    def train(self, stop_at: Optional[int] = None) -> TrainResult:
        """Run to ``schedule.steps`` (resuming if a checkpoint exists); a finished run is left as it is.

        ``stop_at`` ends the process after that step without a final checkpoint, as a
        crash would (used to test exact resume). Raises :class:`Interrupted` after saving
        a checkpoint when SIGINT or SIGTERM arrives.
        """
        with RunLock(self.out_dir):
            finished = check_run_directory(self.config)
            if finished is not None:
                return TrainResult(out_dir=self.out_dir, steps=finished["step"], metrics=finished["metrics"],
                                   already_finished=True)
            if not self.config.run.resume:
                start_over(self.out_dir)
            remove_stale_temporaries(self.checkpoint_dir)
            if self.config.run.resume:
                self._resume()
            write_atomically(self.out_dir / CONFIG, self.config.to_yaml())
            return self._train(stop_at)

    def _train(self, stop_at: Optional[int]) -> TrainResult:
        cfg, run = self.config, self.config.run
        log = MetricsLog(self.out_dir, run.tensorboard)
        log.truncate_after(self.step)
        result = TrainResult(out_dir=self.out_dir, steps=self.step)
        progress = _progress(self.step, cfg.schedule.steps, run.progress)
        try:
            with _StopSignals() as signals:  # the final save and evaluation below stop at once on Ctrl-C
                self._steps(result, log, progress, signals, stop_at)
            progress.close()
            if self.step >= cfg.schedule.steps:
                if self.saved_step != self.step:
                    self.save()  # before the evaluation: a failing evaluation loses no training
                result.metrics = self.evaluate(progress=run.progress)
                log.write(self.step, result.metrics)
                mark_finished(self.out_dir, self.step, result.metrics)
        finally:
            progress.close()
            log.close()
        result.steps, result.skipped_steps = self.step, self.skipped_steps
        return result

    def _steps(self, result: TrainResult, log: MetricsLog, progress: Any, signals: _StopSignals,
               stop_at: Optional[int]) -> None:
        """Optimiser steps until schedule.steps (or ``stop_at``), logging, evaluating and saving as
        the config says; after a signal, save and raise :class:`Interrupted`."""
        cfg, run = self.config, self.config.run
        batches = iter(self.task.train_batches)
        self.model.train()
        started, tokens_at_start = time.perf_counter(), self.tokens_seen
        while self.step < cfg.schedule.steps:
            loss, grad_norm, router = self._optimizer_step(batches)
            self.step += 1
            result.losses[self.step] = loss
            elapsed = time.perf_counter() - started
            tok_s = (self.tokens_seen - tokens_at_start) / max(elapsed, 1e-9)
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
            if self.step % run.log_every == 0 or self.step == cfg.schedule.steps:
                log.write(self.step, {"loss": loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                                      "tokens": self.tokens_seen, "tok_s": tok_s,
                                      "skipped_steps": self.skipped_steps, **router})
            if run.eval_every and self.step % run.eval_every == 0 and self.step < cfg.schedule.steps:
                result.metrics = self.evaluate()
                log.write(self.step, result.metrics)
            if stop_at is not None and self.step >= stop_at:
                break
            if run.save_every and self.step % run.save_every == 0 and self.step < cfg.schedule.steps:
                self.save()
            if signals.received is not None:
                if self.saved_step != self.step:
                    self.save()
                raise Interrupted(self.step, signals.received)

    def _optimizer_step(self, batches) -> tuple[float, float, dict[str, float]]:
        """One optimiser step over grad_accum micro-batches; non-finite steps are skipped and counted.

        Returns the mean loss, the gradient norm and the mean router metrics (aux loss, load).
        """
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        losses, routers = zip(*(self._micro_step(next(batches)) for _ in range(cfg.schedule.grad_accum)))
        loss = float(torch.stack(losses).float().mean())
        router = {name: float(torch.stack([r[name] for r in routers]).float().mean()) for name in routers[0]}
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.skipped_steps += 1
            logger.warning("step %d: non-finite loss %.4g or grad norm %.4g: update skipped (%d so far)",
                           self.step + 1, loss, grad_norm, self.skipped_steps)
        self.scheduler.step()
        return loss, grad_norm, router


def _router_metrics(out: LinmemCausalLMOutput) -> dict[str, torch.Tensor]:
    """The routed layers' aux loss and load summary (``moe_load_max`` ...); empty without routed layers."""
    if out.router_stats is None:
        return {}
    return {"aux_loss": out.aux_loss.detach(), **load_summary(out.router_stats)}


def _progress(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)
