"""The trainer: AdamW with warm-up + cosine, clipping, accumulation, bf16 autocast on GPU,
skip-and-count of non-finite steps, atomic checkpoints and exact resume, on one process or on
the ranks of a torchrun launch (the ``parallel`` section: FSDP2, sequence, expert and tensor parallelism).

A run owns its directory (:mod:`linmem.train.rundir`) while it trains: a second run there
is refused, a different config is refused before anything is written, a finished run is
left as it is. The first SIGINT / SIGTERM ends the current step, saves a checkpoint and
raises :class:`Interrupted` (a second one stops at once); under torchrun a signal that reaches
any rank stops every rank after the same step, and they save together.

Under torchrun (``WORLD_SIZE`` > 1) each rank trains on its share of every step's global batch
(:mod:`linmem.distributed`): data-parallel rank d takes the d-th of ``dp`` consecutive batches
of the one batch source, sequence-parallel ranks a piece of each sequence, and the tensor-parallel ranks
of one data and sequence index the same piece (each computes its share of the heads); the loss is the mean
over the global batch. Rank 0 alone writes the run directory (metrics, config, checkpoint
records, ``model/``) and shows the progress bar; every rank writes its checkpoint shards and runs
the evaluation. One process with ``schedule.grad_accum = dp`` sees the same data per step.

Example:
    >>> from linmem.train import Trainer, load_config
    >>> cfg = load_config(overrides=["schedule.steps=20", "run.out_dir=/tmp/linmem-doc", "run.progress=false"])
    >>> result = Trainer(cfg).train()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed import (DataParallelBatches, ParallelConfigError, SequenceParallel, apply_activation_checkpointing,
                           apply_compile, check_model, clip_grad_norm_, export_pretrained, global_lm_loss,
                           next_token_targets, parallelize, sequence_parallel, shard_sequence, write_shards)
from ..data.config import DataSection
from ..distributed.batch import IGNORE_INDEX
from ..distributed.config import TORCHRUN_ENVIRONMENT, world_size
from ..linearize.lora import ADAPTER_DIR, apply_lora, save_lora
from ..models import LinmemConfig, LinmemForCausalLM, model_recipe
from ..models.config import refuse_foreign_config
from ..models.outputs import LinmemCausalLMOutput
from ..ops.routing import load_summary
from .compilation import CompileProgress, use_compile_cache
from .checkpoint import (CheckpointError, begin_checkpoint, finish_checkpoint, latest_valid_checkpoint,
                         load_checkpoint, optimizer_order, remove_stale_temporaries, save_checkpoint, weight_decayed)
from .config import ConfigError, ModelSection, TrainConfig, check_processes
from .console import Console, TokenRate, on_terminal
from .graphs import GraphCaptureError, GraphedMicroSteps, graph_refusal
from .metrics import MetricsLog
from .ranks import Ranks, join
from .rundir import CONFIG, RunError, RunLock, check_run_directory, mark_finished, start_over, write_atomically
from .tasks import Task, build_task, verify_text_shards

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
        if not Path(section.pretrained).is_dir():  # a local folder: nothing is downloaded
            raise FileNotFoundError(f"model.pretrained {section.pretrained} is not a folder (a model saved by "
                                    f"save_pretrained, a run's model/ or a linmem linearize output)")
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


def resolve_device(name: str, option: str = "run.device") -> torch.device:
    """``run.device`` (or the ``option`` named in errors) as a torch device; a device this machine lacks
    is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"{option}={name!r} is not a device: use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{option}={name!r}, but CUDA is not available here (torch {torch.__version__}, "
                              f"cuda build {torch.version.cuda}): use {option}=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{option}={name!r}, but there are {torch.cuda.device_count()} CUDA devices")
    elif device.type != "cpu":
        raise ConfigError(f"{option}={name!r}: linmem runs on cpu or cuda")
    return device


def check_launch(config: TrainConfig) -> int:
    """Refuse, before any work, a launch that ``config`` cannot run on; returns the number of processes.

    First what the config alone decides (:func:`~linmem.train.config.check_processes`: ``parallel.dp *
    parallel.sp * parallel.tp`` processes, 1 without torchrun; no saved model to fine-tune under torchrun). One process:
    ``run.device`` must exist here and ``model.pretrained`` be a saved linmem model folder
    (:func:`check_pretrained`). Several (torchrun): ``sp`` must divide every training sequence and
    ``ep`` the experts, the model must suit the layout (checked on the meta device: ``tp`` divides every layer's
    heads and hidden units, its mixers can be split), every rank takes its
    own device (``run.device`` auto, cuda or cpu) and torchrun's environment must be there
    (:class:`~linmem.distributed.ParallelConfigError` or :class:`ConfigError`).
    """
    world, parallel = world_size(), config.parallel
    check_processes(config, world)
    if world == 1:
        resolve_device(config.run.device)
        check_pretrained(config.model)
        return 1
    for length in _sequence_lengths(config.data):
        parallel.validate(seq_len=length)
    parallel_device_type(config.run.device)
    missing = [name for name in TORCHRUN_ENVIRONMENT if name not in os.environ]
    if missing and not dist.is_initialized():
        raise ParallelConfigError(f"WORLD_SIZE={world} but no process group to join ({', '.join(missing)} unset): "
                                  "launch with torchrun --nproc-per-node N -m linmem.cli train ...")
    with torch.device("meta"):  # the structure only: any vocabulary will do
        model = build_model(config.model, _STRUCTURE_VOCAB)
    check_model(model, parallel, compile_blocks=config.run.compile)
    return world


def check_pretrained(section: ModelSection) -> None:
    """``model.pretrained`` must be a local folder holding a saved linmem model (``config.json``): a missing
    folder, a run directory (its model is in ``model/``) or another model type's checkpoint (a Llama's, to
    convert with ``linmem linearize``) is a ConfigError naming it."""
    if section.pretrained is None:
        return
    folder = Path(section.pretrained)
    if not (folder / "config.json").is_file():
        hint = f": a run directory keeps its model in {folder / 'model'}" if (folder / CONFIG).is_file() else ""
        raise ConfigError(f"model.pretrained {folder} is not a saved model folder (no config.json){hint}")
    try:
        refuse_foreign_config(folder)
    except ValueError as err:
        raise ConfigError(f"model.pretrained: {err}") from err


_STRUCTURE_VOCAB = 1 << 20  # the vocabulary of the meta-device model that check_launch inspects


def _sequence_lengths(data: DataSection) -> list[int]:
    """Tokens per row of the training batches: every MQAR setting's length, or the packed row."""
    if data.task == "mqar":
        return sorted({seq_len for seq_len, _ in data.mqar.settings})
    return [data.tokens_per_batch]


def parallel_device_type(name: str) -> str:
    """``run.device`` under torchrun: "cuda" (rank r on cuda:LOCAL_RANK) or "cpu"; a device index is refused."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cuda", "cpu"):
        raise ConfigError(f"run.device={name!r}: under torchrun every rank takes its own device (cuda:LOCAL_RANK); "
                          f"use auto, cuda or cpu")
    resolve_device(name)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if name == "cuda" and local > torch.cuda.device_count():
        raise ConfigError(f"{local} processes on this host but {torch.cuda.device_count()} CUDA devices: launch at "
                          f"most one process per GPU")
    return name


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine down to min_ratio at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups: decayed parameters, then the others (:func:`optimizer_order`); parallelised ones
    further split by device mesh (the experts' and the rest), since one fused update cannot mix meshes."""
    named = dict(model.named_parameters())
    groups: dict[tuple[bool, Any], list[torch.nn.Parameter]] = {}
    for name in optimizer_order(model):
        p = named[name]
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((weight_decayed(name, p), mesh), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decayed else 0.0}
            for (decayed, _), params in groups.items()]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state(ranks: Ranks) -> dict[str, Any]:
    """This process's RNG states; under torchrun rank 0's (every rank seeds and draws alike, each on its own GPU)."""
    state = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64))}
    if ranks.mesh is not None and ranks.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(ranks.device)[None]
    elif ranks.mesh is None and torch.cuda.is_available():
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
    """Train a LinmemForCausalLM on a task as the config says, on one process or on torchrun's ranks.

    Args:
        config: a validated :class:`TrainConfig`.
        task: an already built task (to share data between runs); built from the config if None.
    """

    def __init__(self, config: TrainConfig, task: Optional[Task] = None) -> None:
        self.config = config.validate()
        world = check_launch(config)
        self.out_dir = Path(config.run.out_dir)
        self.ranks = Ranks(resolve_device(config.run.device)) if world == 1 else \
            join(config.parallel, parallel_device_type(config.run.device))
        self.device = self.ranks.device
        self.ranks.on_main(check_run_directory, config)  # a different config is refused before the data is read
        _seed_everything(config.run.seed)  # the same on every rank: the same initial weights and data order
        if task is None:  # every start and resume: rank 0 hashes the shards, its refusal stops all ranks
            self.ranks.on_main(verify_text_shards, config.data)
        self.task = task if task is not None else build_task(config.data)
        self.batches = self.task.train_batches if self.ranks.mesh is None else DataParallelBatches(
            self.task.train_batches, rank=self.ranks.mesh.dp.get_local_rank(), size=config.parallel.dp)
        special = self.task.codec.special_tokens() if self.task.codec is not None else {}
        bf16 = config.run.dtype == "bf16" or (config.run.dtype == "auto" and self.device.type == "cuda")
        model = build_model(config.model, self.task.vocab_size, special).to(self.device)
        self.compiled = config.run.compile
        if self.compiled:
            use_compile_cache(config.run.compile_cache)
        if self.ranks.mesh is None:
            self.model = apply_activation_checkpointing(model) if config.parallel.activation_checkpointing else model
            if config.lora.rank:  # adapters on the targets, everything else frozen
                lora = config.lora
                self.model = apply_lora(self.model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                        targets=lora.targets, train_modules=lora.train_modules)
            if self.compiled:
                apply_compile(self.model)
            self.autocast_dtype = torch.bfloat16 if bf16 else None
        else:  # FSDP gathers the parameters in the compute dtype: no autocast
            self.model = parallelize(model, self.ranks.mesh, param_dtype=torch.bfloat16 if bf16 else torch.float32,
                                     compile_blocks=self.compiled)  # each block inside its FSDP unit
            self.autocast_dtype = None
        self.graphs = self._graphed_steps(world)
        o = config.optim
        self.optimizer = torch.optim.AdamW(_param_groups(self.model, o.weight_decay), lr=o.lr,
                                           betas=(o.beta1, o.beta2), eps=o.eps,
                                           fused=self.device.type == "cuda")
        s = config.schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: cosine_with_warmup(step, s.warmup, s.steps, s.min_lr_ratio))
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.saved_step: Optional[int] = None  # step of the newest checkpoint on disk

    def _graphed_steps(self, world: int) -> Optional[GraphedMicroSteps]:
        """CUDA-graph micro-steps where ``run.cuda_graph`` asks for them (null: wherever they can run)."""
        self.no_graph_reason = None if self.config.run.cuda_graph is False else graph_refusal(self.model, self.device,
                                                                                              world)
        if self.config.run.cuda_graph is False or self.no_graph_reason is not None:
            if self.config.run.cuda_graph:
                raise ConfigError(f"run.cuda_graph=true: {self.no_graph_reason}; set run.cuda_graph=false")
            return None
        return GraphedMicroSteps(self.model, self.autocast_dtype)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def micro_batches_per_step(self) -> int:
        """Batches of the source that one optimiser step trains on (all ranks together)."""
        dp = self.config.parallel.dp if self.ranks.mesh is not None else 1
        return dp * self.config.schedule.grad_accum

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _checkpoint_to_resume(self) -> Optional[Path]:
        """The newest valid checkpoint (None: start at step 0), if this launch may continue it (rank 0)."""
        try:
            path = latest_valid_checkpoint(self.checkpoint_dir)
        except CheckpointError as err:
            raise CheckpointError(f"{err}; set run.resume=false to start over (removes them)") from err
        if path is None:
            return None
        state = json.loads((path / "trainer_state.json").read_text())
        saved = state.get("micro_batches_per_step", state["config"]["schedule"]["grad_accum"])
        if saved != self.micro_batches_per_step:
            dp = self.micro_batches_per_step // self.config.schedule.grad_accum
            fix = f"set schedule.grad_accum={saved // dp}" if saved % dp == 0 else \
                f"launch a number of data-parallel ranks that divides {saved}"
            raise RunError(f"{path} was trained on {saved} micro-batches per optimiser step (data-parallel ranks x "
                           f"schedule.grad_accum); this launch takes {self.micro_batches_per_step} ({dp} x "
                           f"{self.config.schedule.grad_accum}): {fix}, so that a step keeps its data")
        return path

    def _resume(self) -> None:
        path = self.ranks.on_main(self._checkpoint_to_resume)
        if path is None:
            return
        state, rng = load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                     verify=False)  # rank 0 verified it
        self.step, self.skipped_steps, self.tokens_seen = state["step"], state["skipped_steps"], state["tokens_seen"]
        self.batches.load_state_dict(state["data"])
        version, internal, gauss = state["python_rng"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(rng["torch"])
        np_state = list(np.random.get_state())
        np_state[1] = rng["numpy"].numpy().astype(np.uint32)
        np.random.set_state(tuple(np_state))
        if "cuda" in rng and self.ranks.mesh is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"][0], self.device)
        elif "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(rng["cuda"]))
        self.saved_step = self.step
        logger.info("resumed from %s (step %d)", path, self.step)

    def save(self) -> Path:
        """A checkpoint of this step, and ``model/`` (the latest weights, loadable with from_pretrained);
        under torchrun every rank calls it."""
        state = {"skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen,
                 "micro_batches_per_step": self.micro_batches_per_step, "data": self.batches.state_dict(),
                 "python_rng": _python_rng(), "config": self.config.to_dict()}
        keep, model_dir = self.config.run.keep_checkpoints, self.out_dir / "model"
        if self.ranks.mesh is None:
            path = save_checkpoint(self.checkpoint_dir, self.step, model=self.model, optimizer=self.optimizer,
                                   scheduler=self.scheduler, trainer_state=state, rng_state=_rng_state(self.ranks),
                                   keep=keep)
            if self.config.lora.rank:  # the adapter, and the merged weights in model/
                save_lora(self.model, self.out_dir / ADAPTER_DIR, model_dir)
            else:
                self.model.save_pretrained(model_dir)
        else:
            tmp = self.ranks.on_main(begin_checkpoint, self.checkpoint_dir, self.step)
            write_shards(tmp, self.model, self.optimizer)
            path = self.ranks.on_main(lambda: finish_checkpoint(
                tmp, self.step, scheduler=self.scheduler, trainer_state=state, rng_state=_rng_state(self.ranks),
                keep=keep))
            export_pretrained(self.model, model_dir)
        if self.ranks.is_main and self.task.codec is not None and self.task.codec.tokenizer is not None:
            self.task.codec.tokenizer.save_pretrained(str(model_dir))
        self.saved_step = self.step
        return path

    def _micro_step(self, batch: dict[str, torch.Tensor], num_targets: float,
                    step_targets: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward + backward of one micro-batch: (its loss weighted by its share of the step's targets,
        router metrics). ``num_targets``: the batch's target tokens (under torchrun: its batches' on all
        data-parallel ranks); ``step_targets``: the step's, so that the step's loss is its mean over targets."""
        if self.ranks.mesh is not None:
            return self._parallel_micro_step(batch, num_targets, step_targets)
        if self.graphs is not None:
            try:
                loss = self.graphs(batch, num_targets / step_targets)
                self.tokens_seen += batch["input_ids"].numel()
                return loss, {}
            except GraphCaptureError as err:
                if self.config.run.cuda_graph:
                    raise
                logger.warning("%s; the run goes on with eager steps (run.cuda_graph=false skips the capture)", err)
                self.graphs = None
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.model(**batch, use_cache=False)
        loss = out.loss * (num_targets / step_targets)
        loss.backward()
        self.tokens_seen += batch["input_ids"].numel()
        return loss.detach(), _router_metrics(out)

    def _parallel_micro_step(self, batch: dict[str, torch.Tensor], num_targets: float,
                             step_targets: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's piece of its data-parallel batch: forward and backward under the sequence-parallel
        handler (checkpointed blocks recompute in the backward pass), the loss over the global batch."""
        mesh, sp = self.ranks.mesh, self.config.parallel.sp
        piece, layout = shard_sequence(batch, mesh.sp.get_local_rank(), sp)
        piece = {k: v.to(self.device, non_blocking=True) for k, v in piece.items()}
        cu_seqlens = piece.get("cu_seqlens")
        handler = sequence_parallel(SequenceParallel(mesh.sp.get_group(), layout, cu_seqlens)) if sp > 1 \
            else contextlib.nullcontext()
        with handler:
            out = self.model(piece["input_ids"], position_ids=piece["position_ids"], cu_seqlens=cu_seqlens,
                               use_cache=False)
            loss = global_lm_loss(out.logits, piece["targets"], mesh.data.get_group(), num_targets=num_targets)
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
            loss = loss * (num_targets / step_targets)
            loss.backward()
        self.tokens_seen += piece["input_ids"].numel() * mesh.data.size()  # the tp ranks share their tokens
        return loss.detach(), _router_metrics(out)

    def evaluate(self, progress: bool = False) -> dict[str, float]:
        """The task's metrics (under torchrun every rank evaluates the whole held-out set; rank 0's bar)."""
        self.model.eval()
        try:
            with torch.compiler.set_stance("force_eager"):  # compiled blocks would compile again for inference
                return self.task.evaluate(self.model, self.device, progress=progress and self.ranks.is_main)
        finally:
            self.model.train()

    def train(self, stop_at: Optional[int] = None) -> TrainResult:
        """Run to ``schedule.steps`` (resuming if a checkpoint exists); a finished run is left as it is.

        ``stop_at`` ends the process after that step without a final checkpoint, as a
        crash would (used to test exact resume). Raises :class:`Interrupted` after saving
        a checkpoint when SIGINT or SIGTERM arrives. Under torchrun rank 0 holds the lock and
        checks the directory; a refusal stops every rank.
        """
        lock = RunLock(self.out_dir)
        self.ranks.on_main(lock.acquire)
        try:
            finished = self.ranks.on_main(check_run_directory, self.config)
            if finished is not None:
                return TrainResult(out_dir=self.out_dir, steps=finished["step"], metrics=finished["metrics"],
                                   already_finished=True)
            if not self.config.run.resume:
                self.ranks.on_main(start_over, self.out_dir)
            self.ranks.on_main(remove_stale_temporaries, self.checkpoint_dir)
            if self.config.run.resume:
                self._resume()
            self.ranks.on_main(write_atomically, self.out_dir / CONFIG, self.config.to_yaml())
            return self._train(stop_at)
        finally:
            lock.release()

    def _train(self, stop_at: Optional[int]) -> TrainResult:
        cfg, run, main = self.config, self.config.run, self.ranks.is_main
        log = MetricsLog(self.out_dir, run.tensorboard) if main else _NoMetrics()
        log.truncate_after(self.step)
        result = TrainResult(out_dir=self.out_dir, steps=self.step)
        console = Console(self.step, cfg.schedule.steps, main=main, bar=run.progress and on_terminal())
        log.write(self.step, {"mode": self.mode})
        try:  # the final save and evaluation below stop at once on Ctrl-C
            with _StopSignals() as signals, CompileProgress(lambda line: console.write(f"compile: {line}")) as compiling:
                self.compiling = compiling
                self._steps(result, log, console, signals, stop_at)
            console.close()
            if self.step >= cfg.schedule.steps:
                if self.saved_step != self.step:
                    self.save()  # before the evaluation: a failing evaluation loses no training
                result.metrics = self.evaluate(progress=console.bar_on)
                log.write(self.step, result.metrics)
                console.evaluated(self.step, result.metrics)
                if main:
                    mark_finished(self.out_dir, self.step, result.metrics)
        finally:
            console.close()
            log.close()
        result.steps, result.skipped_steps = self.step, self.skipped_steps
        return result

    def _steps(self, result: TrainResult, log: MetricsLog, console: Console, signals: _StopSignals,
               stop_at: Optional[int]) -> None:
        """Optimiser steps until schedule.steps (or ``stop_at``), logging, evaluating and saving as
        the config says; after a signal (to any rank), save and raise :class:`Interrupted`.

        ``tok_s`` is the rate of the last logging window (time spent evaluating and saving left out),
        ``tok_s_cumulative`` the rate since this process started training."""
        cfg, run = self.config, self.config.run
        batches = iter(self.batches)
        self.model.train()
        rate = TokenRate(self.tokens_seen)
        mode = self.mode
        while self.step < cfg.schedule.steps:
            loss, grad_norm, router = self._optimizer_step(batches)
            self.step += 1
            if self.mode != mode:  # a CUDA graph that could not be captured: eager from this step on
                mode = self.mode
                log.write(self.step, {"mode": mode})
            result.losses[self.step] = loss
            console.step(loss)
            if self.step % run.log_every == 0 or self.step == cfg.schedule.steps:
                values = {"loss": loss, "lr": float(self.scheduler.get_last_lr()[0]), "grad_norm": grad_norm,
                          "tokens": self.tokens_seen, "tok_s": rate.window(self.tokens_seen),
                          "tok_s_cumulative": rate.cumulative(self.tokens_seen), "skipped_steps": self.skipped_steps,
                          **router, **self._compile_metrics()}
                log.write(self.step, values)
                console.logged(self.step, values)
            if run.eval_every and self.step % run.eval_every == 0 and self.step < cfg.schedule.steps:
                with rate.paused():
                    result.metrics = self.evaluate()
                log.write(self.step, result.metrics)
                console.evaluated(self.step, result.metrics)
            if stop_at is not None and self.step >= stop_at:
                break
            if run.save_every and self.step % run.save_every == 0 and self.step < cfg.schedule.steps:
                with rate.paused():
                    self.save()
            received = self.ranks.any_signal(signals.received)
            if received is not None:
                if self.saved_step != self.step:
                    self.save()
                raise Interrupted(self.step, received)

    @property
    def mode(self) -> str:
        """How the training step runs: "eager", "compiled" (regional torch.compile of the blocks), "graph"
        (CUDA-graph micro-steps) or "compiled+graph"."""
        graph = "graph" if self.graphs is not None else ""
        if self.compiled:
            return "compiled+graph" if graph else "compiled"
        return graph or "eager"

    def _compile_metrics(self) -> dict[str, float]:
        """Seconds spent compiling so far and the graphs compiled (compiled steps only)."""
        if not self.compiled:
            return {}
        return {"compile_s": self.compiling.seconds, "compiled_graphs": self.compiling.graphs}

    def _optimizer_step(self, batches) -> tuple[float, float, dict[str, float]]:
        """One optimiser step over grad_accum micro-batches; non-finite steps are skipped and counted.

        The loss is the mean over the step's target tokens (of all micro-batches and ranks: a batch
        weighs by its targets) plus the routers' losses. Returns it, the gradient norm and the mean
        router metrics (aux loss, load), averaged over all ranks (every rank decides alike to skip).
        """
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=self.graphs is None)  # the graphs add into their gradients
        micro = [next(batches) for _ in range(cfg.schedule.grad_accum)]
        counts = self.ranks.data_parallel_sum([_target_count(batch) for batch in micro])
        step_targets = max(sum(counts), 1.0)
        losses, routers = zip(*(self._micro_step(batch, count, step_targets) for batch, count in zip(micro, counts)))
        values = {"loss": float(torch.stack(losses).float().sum()),
                  **{name: float(torch.stack([r[name] for r in routers]).float().mean()) for name in routers[0]}}
        router = self.ranks.average(values)
        loss = router.pop("loss")
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        clip_norm = torch.nn.utils.clip_grad_norm_ if self.ranks.mesh is None else clip_grad_norm_
        grad_norm = float(clip_norm(self.model.parameters(), clip))
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.skipped_steps += 1
            logger.warning("step %d: non-finite loss %.4g or grad norm %.4g: update skipped (%d so far)",
                           self.step + 1, loss, grad_norm, self.skipped_steps)
        self.scheduler.step()
        return loss, grad_norm, router


class _NoMetrics:
    """The metrics log of ranks other than 0: they write nothing."""

    def truncate_after(self, step: int) -> None:
        pass

    def write(self, step: int, values: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def _target_count(batch: dict[str, torch.Tensor]) -> int:
    """The positions of ``batch`` that predict a token: the labels shifted by one, packed sequence ends removed."""
    return int((next_token_targets(batch["labels"], batch.get("cu_seqlens")) != IGNORE_INDEX).sum())


def _router_metrics(out: LinmemCausalLMOutput) -> dict[str, torch.Tensor]:
    """The routed layers' aux loss and load summary (``moe_load_max`` ...); empty without routed layers."""
    if out.router_stats is None:
        return {}
    return {"aux_loss": out.aux_loss.detach(), **load_summary(out.router_stats)}
