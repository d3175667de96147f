"""The trainer: AdamW with warm-up + cosine, clipping, accumulation, bf16 autocast on GPU,
skip-and-count of non-finite steps, atomic checkpoints and exact resume (DESIGN section 6).

Example:
    >>> from linmem.train import Trainer, load_config
    >>> cfg = load_config(overrides=["schedule.steps=20", "run.out_dir=/tmp/linmem-doc", "run.progress=false"])
    >>> result = Trainer(cfg).train()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..models import LinmemConfig, LinmemForCausalLM, model_recipe
from ..models.modeling import LinmemCausalLMOutput
from ..ops.routing import load_summary
from .checkpoint import latest_valid_checkpoint, load_checkpoint, save_checkpoint
from .config import ModelSection, TrainConfig
from .tasks import Task, build_task

logger = logging.getLogger("linmem.train")


@dataclass
class TrainResult:
    out_dir: Path
    steps: int  # optimiser steps done in total
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss, this process
    metrics: dict[str, float] = field(default_factory=dict)  # last evaluation
    skipped_steps: int = 0  # non-finite steps skipped


def build_model(section: ModelSection, vocab_size: int) -> LinmemForCausalLM:
    """A LinmemForCausalLM from the model section (recipe, then fields, then options)."""
    fields = dict(hidden_size=section.hidden_size, num_heads=section.num_heads, layer_pattern=section.layer_pattern,
                  memory=section.memory, attention=section.attention, **section.options)
    if section.recipe is not None:
        config = model_recipe(section.recipe).build_config(vocab_size=vocab_size, **section.options)
    else:
        config = LinmemConfig(vocab_size=vocab_size, **fields)
    return LinmemForCausalLM(config)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when installed and enabled)."""

    def __init__(self, out_dir: Path, tensorboard: bool) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (left by a run that stopped after its last checkpoint)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, values: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Trainer:
    """Train a LinmemForCausalLM on a task as the config says.

    Args:
        config: a validated :class:`TrainConfig`.
        task: an already built task (to share data between runs); built from the config if None.
    """

    def __init__(self, config: TrainConfig, task: Optional[Task] = None) -> None:
        self.config = config.validate()
        self.out_dir = Path(config.run.out_dir)
        self.device = resolve_device(config.run.device)
        _seed_everything(config.run.seed)
        self.task = task if task is not None else build_task(config.data)
        self.model = build_model(config.model, self.task.vocab_size).to(self.device)
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

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _resume(self) -> None:
        path = latest_valid_checkpoint(self.checkpoint_dir)
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
        logger.info("resumed from %s (step %d)", path, self.step)

    def save(self) -> Path:
        state = {"skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen,
                 "data": self.task.train_batches.state_dict(), "python_rng": _python_rng(),
                 "config": self.config.to_dict()}
        path = save_checkpoint(self.checkpoint_dir, self.step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, trainer_state=state, rng_state=_rng_state(),
                               keep=self.config.run.keep_checkpoints)
        self.model.save_pretrained(self.out_dir / "model")  # the latest weights, loadable with from_pretrained
        return path

    def _micro_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward + backward of one micro-batch: (loss, router metrics)."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.forward(**batch, use_cache=False)
        (out.loss / self.config.schedule.grad_accum).backward()
        self.tokens_seen += batch["input_ids"].numel()
        return out.loss.detach(), _router_metrics(out)

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        try:
            return self.task.evaluate(self.model, self.device)
        finally:
            self.model.train()

    def train(self, stop_at: Optional[int] = None) -> TrainResult:
        """Run to ``schedule.steps`` (resuming if a checkpoint exists).

        ``stop_at`` ends the process after that step without a final checkpoint, as a
        crash would (used to test exact resume).
        """
        cfg, run = self.config, self.config.run
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(cfg.to_yaml())
        if run.resume:
            self._resume()
        log = MetricsLog(self.out_dir, run.tensorboard)
        log.truncate_after(self.step)
        result = TrainResult(out_dir=self.out_dir, steps=self.step)
        batches = iter(self.task.train_batches)
        self.model.train()
        progress = _progress(self.step, cfg.schedule.steps, run.progress)
        started, tokens_at_start = time.perf_counter(), self.tokens_seen
        try:
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
            if self.step >= cfg.schedule.steps:
                result.metrics = self.evaluate()
                log.write(self.step, result.metrics)
                self.save()
        finally:
            progress.close()
            log.close()
        result.steps, result.skipped_steps = self.step, self.skipped_steps
        return result

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
