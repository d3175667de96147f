"""``linmem bench models``: training tokens/s and peak memory of whole models, linmem's beside its peers.

linmem's architectures (``--models``: transformer, GLA, DeltaNet, Gated DeltaNet, the ``"LLLN"*6``
hybrid of Gated DeltaNet and softmax attention in 8 heads of 128, FoX; MoM on request) and, with ``--peers``, the same architectures in HF transformers (Llama
with SDPA) and flash-linear-attention, all of one shape (``linmem.bench.peers``: ~370M, 24 layers,
width 1024, vocabulary 32000; the mapping of every config is in that module's docstring), timed in one
run on one GPU.

Protocol, for every model, mode (``--modes``: eager; compiled, ``torch.compile`` of each block on its own as
``run.compile`` does, for peers too; graph, the forward and backward captured as a CUDA graph as
``run.cuda_graph`` does, :mod:`linmem.train.graphs`) and sequence length T (2K, 4K, 8K, 16K, 32K by default):

1. free what the previous cell held (``gc.collect()``, ``torch.cuda.empty_cache()``) and seed 0;
2. build the model on the device with bf16 weights (no autocast: weights, gradients and AdamW's states
   are bf16), ``torch.optim.AdamW(lr=1e-4, fused=True)``, ``B = max(1, tokens_per_step // T)`` sequences
   of random token ids (16K tokens a step: 8 x 2K, 4 x 4K, 2 x 8K, 1 x 16K; 32K is one sequence);
3. one step is ``model(input_ids=x, labels=x, use_cache=False).loss.backward()``, ``optimizer.step()``,
   ``optimizer.zero_grad(set_to_none=True)``: each model's own loss (HF's, fla's fused cross-entropy,
   linmem's); in graph mode the forward and backward replay their graph (captured in the second warm-up
   step) and the gradients are zeroed in place;
4. ``warmup`` steps (default 2), timed by the wall clock after a synchronisation: they take Triton's
   compilation and autotuning, ``torch.compile``, the graph's capture and the allocation of the optimizer's
   states. For a compiled row, ``compile_s`` is the first step's wall time less the median step;
5. the peak-memory statistic is reset, then ``steps`` steps (default 5) are timed each between two CUDA
   events, synchronised after each; tokens/s is ``B * T`` over the median step; peak GB is
   ``torch.cuda.max_memory_allocated()`` over the timed steps (weights, gradients, optimizer states and
   the step's activations), in 1e9 bytes; in graph mode over the warm-up steps too (the capture allocates
   the activations that the replays reuse, and a replay allocates nothing).

A cell that runs out of memory reads "out of memory"; any other error is its message. A peer that is not
installed, or that refuses to train on this stack (fla's gated backward on Hopper with Triton < 3.7.1),
is skipped with the reason. ``--activation-checkpointing`` is passed to linmem configs that have the
option (peers run without). The table (rows: models; columns: T; cells "ktok/s (peak GB)") is printed
and written with every row as JSON (``models.json``) and Markdown (``models.md``) to ``--out``, the JSON
after every cell; ``--budget-s`` starts no cell past that many seconds. On CPU (``--device cpu``) the
steps are timed by the wall clock and no memory is reported.

    linmem bench models --peers                                  # the table of record, ~370M, one GPU
    linmem bench models --models gla,deltanet --peers --modes eager,compiled,graph  # with compile times
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..distributed import apply_compile
from ..train.graphs import GraphedMicroSteps, graph_refusal
from . import BenchError
from .peers import (ARCHITECTURES, ModelShape, add_common_arguments, build_model, model_spec, parse_keys, parse_peers,
                    row_keys, shape_from_args, training_refusal, unavailable_reason)
from .report import command_line, environment, environment_line, length_label, markdown_table, text_table, write_json

DEFAULT_MODELS = ("transformer", "gla", "deltanet", "gated_deltanet", "hybrid", "fox")
DEFAULT_SEQ_LENS = (2048, 4096, 8192, 16384, 32768)
#: how a step runs: eagerly, with compiled blocks, or replayed from a CUDA graph
MODES = ("eager", "compiled", "graph")


@dataclass(frozen=True)
class TrainBenchConfig:
    """What ``linmem bench models`` times."""

    models: tuple[str, ...] = DEFAULT_MODELS  # linmem architectures (peers.ARCHITECTURES)
    peers: tuple[str, ...] = ()  # peer keys (peers.PEERS) timed in the same run
    seq_lens: tuple[int, ...] = DEFAULT_SEQ_LENS  # T of the columns
    tokens_per_step: int = 16384  # B = max(1, tokens_per_step // T)
    shape: ModelShape = ModelShape()  # width, depth and vocabulary of every model
    dtype: str = "bfloat16"  # weights, gradients and optimizer states
    warmup: int = 2  # untimed steps first (compilation, autotuning, optimizer states)
    steps: int = 5  # timed steps; the median is reported
    modes: tuple[str, ...] = ("eager",)  # of MODES: every model in each
    activation_checkpointing: bool = False  # set on linmem configs that have the option
    budget_s: Optional[float] = None  # start no cell after this many seconds
    device: str = "cuda"

    def __post_init__(self) -> None:
        parse_keys(",".join(self.models), ARCHITECTURES, "model")
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"warmup >= 1 and steps >= 1 expected (the first step compiles), "
                             f"got warmup={self.warmup}, steps={self.steps}")
        if "graph" in self.modes and self.warmup < 2:
            raise ValueError(f"graph mode needs warmup >= 2 (an eager step, then the capture), got {self.warmup}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes: expected some of {', '.join(MODES)}, got {', '.join(self.modes) or 'none'}")
        if not self.seq_lens or min(self.seq_lens) < 2 or self.tokens_per_step < 2:
            raise ValueError(f"seq_lens >= 2 and tokens_per_step >= 2 expected, got {self.seq_lens}, "
                             f"{self.tokens_per_step}")

    def rows(self) -> list[tuple[str, str]]:
        """(model key, mode) in table order (peers.row_keys), each model's modes in MODES' order."""
        modes = [m for m in MODES if m in self.modes]
        return [(key, mode) for key in row_keys(self.models, self.peers) for mode in modes]


@dataclass
class TrainCell:
    """One (model, mode, T) of the table."""

    model: str
    label: str
    mode: str
    B: int
    T: int
    status: str = "ok"  # ok, out of memory, skipped, error, not run
    reason: str = ""
    ktok_s: Optional[float] = None
    step_ms: Optional[float] = None  # median of the timed steps
    steps_ms: list = field(default_factory=list)
    peak_GB: Optional[float] = None
    params_M: Optional[float] = None
    first_step_s: Optional[float] = None  # wall time of the first warm-up step
    compile_s: Optional[float] = None  # compiled rows: first step less the median step
    wall_s: float = 0.0  # the whole cell: build, warm-up, timed steps
    note: str = ""


def time_steps(step: Callable[[], None], warmup: int, steps: int, device: str, peak_of_warmup: bool = False
               ) -> tuple[list[float], list[float], Optional[float]]:
    """``(warm-up wall seconds, timed step ms, peak GB)`` of ``warmup`` then ``steps`` calls of ``step``.

    On CUDA each timed step lies between two events and is synchronised; the peak is
    ``max_memory_allocated`` over the timed steps (``peak_of_warmup``: over the warm-up steps too, where a
    CUDA graph's capture allocates what its replays reuse). On CPU the wall clock times them and the peak is None.
    """
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    warm = []
    for _ in range(warmup):
        start = time.perf_counter()
        step()
        sync()
        warm.append(time.perf_counter() - start)
    if cuda and not peak_of_warmup:
        torch.cuda.reset_peak_memory_stats()
    timed = []
    for _ in range(steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            timed.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            step()
            timed.append((time.perf_counter() - start) * 1e3)
    return warm, timed, torch.cuda.max_memory_allocated() / 1e9 if cuda else None


def free_memory(device: str) -> None:
    """Return what the last cell held to the CUDA allocator's pool and the pool to the device (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA out-of-memory error, also when torch.compile or a peer wraps it in another exception type."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def error_text(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def training_step(model: torch.nn.Module, mode: str, ids: torch.Tensor) -> Callable[[], None]:
    """One training step of ``model`` on the token ids ``ids`` [B, T] (its own loss, fused AdamW at lr 1e-4) in
    ``mode`` (one of :data:`MODES`): compiled blocks are compiled here, a graph is captured by the second call.

    Example:
        >>> step = training_step(model, "graph", torch.randint(0, 32000, (8, 2048), device="cuda"))  # doctest: +SKIP
        >>> step()  # doctest: +SKIP
    """
    if mode == "compiled":
        apply_compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    graphed = GraphedMicroSteps(model, autocast_dtype=None) if mode == "graph" else None

    def step() -> None:
        if graphed is not None:
            graphed({"input_ids": ids, "labels": ids}, 1.0)
        else:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=graphed is None)

    return step


class _Refused(Exception):
    """A model that cannot run in the cell's mode (a CUDA graph on a CPU, of routed layers)."""


def _train(cell: TrainCell, config: TrainBenchConfig) -> None:
    """Build the cell's model and time its training steps (the module docstring's protocol)."""
    torch.manual_seed(0)
    model, cell.note = build_model(cell.model, config.shape, device=config.device, dtype=getattr(torch, config.dtype),
                                   activation_checkpointing=config.activation_checkpointing)
    model.train()
    cell.params_M = sum(p.numel() for p in model.parameters()) / 1e6
    if cell.mode == "graph":
        refusal = graph_refusal(model, torch.device(config.device), world=1)
        if refusal is not None:
            raise _Refused(refusal)
    ids = torch.randint(0, config.shape.vocab_size, (cell.B, cell.T), device=config.device)
    step = training_step(model, cell.mode, ids)
    warm, cell.steps_ms, cell.peak_GB = time_steps(step, config.warmup, config.steps, config.device,
                                                   peak_of_warmup=cell.mode == "graph")
    cell.step_ms = statistics.median(cell.steps_ms)
    cell.ktok_s = cell.B * cell.T / cell.step_ms
    cell.first_step_s = warm[0]
    if cell.mode == "compiled":
        cell.compile_s = max(0.0, warm[0] - cell.step_ms / 1e3)


def train_cell(key: str, mode: str, T: int, config: TrainBenchConfig) -> TrainCell:
    """One cell, errors and all: out of memory, a peer that is missing or refuses, any other failure."""
    cell = TrainCell(key, model_spec(key).label, mode, max(1, config.tokens_per_step // T), T)
    refusal = training_refusal(key, config.device)
    if refusal:
        cell.status, cell.reason = "skipped", refusal
        return cell
    free_memory(config.device)
    start = time.perf_counter()
    try:
        _train(cell, config)
    except ImportError as error:
        cell.status, cell.reason = "skipped", unavailable_reason(error)
    except _Refused as error:
        cell.status, cell.reason = "skipped", str(error)
    except Exception as error:  # a model that fails at this shape says so in its cell
        cell.status, cell.reason = ("out of memory", "") if is_out_of_memory(error) else ("error", error_text(error))
    cell.wall_s = time.perf_counter() - start
    if mode == "compiled":
        torch._dynamo.reset()  # the compiled graphs hold the model: let it go
    free_memory(config.device)
    return cell


def run_models(config: TrainBenchConfig, report: Callable[[TrainCell], None] = lambda cell: None,
               row_done: Callable[[str, float], None] = lambda label, seconds: None) -> list[TrainCell]:
    """Every cell of the table; ``report`` sees each cell, ``row_done`` each row's label and seconds. linmem's rows
    run before the peers' (a peer's first autotuning can take minutes), so that ``budget_s`` cuts peers first."""
    started = time.perf_counter()
    cells = []
    for key, mode in sorted(config.rows(), key=lambda row: model_spec(row[0]).family != "linmem"):
        row_start = time.perf_counter()
        for T in config.seq_lens:
            if config.budget_s is not None and time.perf_counter() - started > config.budget_s:
                cell = TrainCell(key, model_spec(key).label, mode, max(1, config.tokens_per_step // T), T,
                                 status="not run", reason=f"time budget of {config.budget_s:.0f} s spent")
            else:
                cell = train_cell(key, mode, T, config)
            cells.append(cell)
            report(cell)
        row_done(row_label(cells[-1], config), time.perf_counter() - row_start)
    return cells


def row_label(cell: TrainCell, config: TrainBenchConfig) -> str:
    label = cell.label + (f" ({cell.mode})" if cell.mode != "eager" else "")
    if config.activation_checkpointing and model_spec(cell.model).family == "linmem" and not cell.note:
        label += " (activation checkpointing)"
    return label


def _row_cells(cells: list[TrainCell], config: TrainBenchConfig) -> list[list[TrainCell]]:
    rows = [[c for c in cells if (c.model, c.mode) == row] for row in config.rows()]
    return [row for row in rows if row]


def tables(cells: list[TrainCell], config: TrainBenchConfig) -> tuple[list[str], list[list[str]], list[str]]:
    """``(header, rows, notes)`` of the table: cells "ktok/s (peak GB)", reasons as numbered notes."""
    header = ["model", "params"] + [f"{max(1, config.tokens_per_step // T)} x {length_label(T)}"
                                    for T in config.seq_lens]
    notes: list[str] = []

    def mark(note: str) -> str:
        notes.extend([note] if note not in notes else [])
        return f"[{notes.index(note) + 1}]"

    rows = []
    for row in _row_cells(cells, config):
        texts = []
        for c in row:
            if c.status == "ok":
                texts.append(f"{c.ktok_s:.1f} ({c.peak_GB:.1f})" if c.peak_GB is not None else f"{c.ktok_s:.2f}")
            else:
                texts.append(f"{c.status} {mark(f'{c.status}: {c.reason}')}" if c.reason else c.status)
        texts += [""] * (len(config.seq_lens) - len(texts))  # a row still running
        label = row_label(row[0], config)
        label += "".join(f" {mark(n)}" for n in sorted({c.note for c in row if c.note}))
        params = next((c.params_M for c in row if c.params_M is not None), None)
        rows.append([label, "" if params is None else f"{params:.0f}M" if params >= 10 else f"{params:.2f}M"] + texts)
    return header, rows, [f"[{i + 1}] {note}" for i, note in enumerate(notes)]


def compile_table(cells: list[TrainCell], config: TrainBenchConfig) -> tuple[list[str], list[list[str]]]:
    """Seconds of compilation (the first step less a steady one) of the compiled rows."""
    header = ["compile time"] + [length_label(T) for T in config.seq_lens]
    rows = [[row_label(row[0], config)] + [f"{c.compile_s:.0f} s" if c.compile_s is not None else "-" for c in row]
            + [""] * (len(config.seq_lens) - len(row))
            for row in _row_cells(cells, config) if row[0].mode == "compiled"]
    return header, rows


def write_outputs(out: Path, config: TrainBenchConfig, env: dict, cells: list[TrainCell], command: str) -> str:
    """Write models.json (a result file of ``linmem bench report``: env, command, tables, and every cell) and
    models.md to ``out``; return the text of the tables."""
    header, rows, notes = tables(cells, config)
    unit = "thousand tokens/s (peak GB)" if torch.device(config.device).type == "cuda" else "thousand tokens/s"
    title = (f"Training, {config.tokens_per_step} tokens a step, {config.dtype} weights, fused AdamW, "
             f"D = {config.shape.hidden_size}, {config.shape.num_layers} layers, vocab {config.shape.vocab_size}: "
             f"{unit}; median of {config.steps} steps after {config.warmup}")
    parts_md = [title, environment_line(env), markdown_table(header, rows)] + (["\n".join(notes)] if notes else [])
    parts_txt = [title, environment_line(env), "", text_table(header, rows)] + notes
    tables_json = [{"header": header, "rows": rows}]
    if "compiled" in config.modes:
        compile_header, compile_rows = compile_table(cells, config)
        parts_md.append(markdown_table(compile_header, compile_rows))
        parts_txt += ["", text_table(compile_header, compile_rows)]
        tables_json.append({"header": compile_header, "rows": compile_rows})
    write_json(out / "models.json", {"env": env, "command": command, "intro": title, "tables": tables_json,
                                     "notes": "\n".join(notes), "config": asdict(config),
                                     "cells": [asdict(c) for c in cells]})
    (out / "models.md").write_text("\n\n".join(parts_md) + "\n")
    return "\n".join(parts_txt)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linmem bench models``."""
    add_common_arguments(parser, DEFAULT_MODELS, "auto", "runs/bench/models")
    parser.add_argument("--seq-lens", default=",".join(str(t) for t in DEFAULT_SEQ_LENS), help="T of the columns")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (B = tokens / T, at least 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--modes", default="eager", help=f"comma-separated, of {', '.join(MODES)}: compiled blocks "
                                                          "(with compile times) and CUDA-graph steps beside eager ones")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="set activation_checkpointing on linmem configs that have it (peers run without)")


def config_from_args(args: argparse.Namespace) -> TrainBenchConfig:
    models = parse_keys(args.models, ARCHITECTURES, "model")
    return TrainBenchConfig(models=models, peers=parse_peers(args.peers, models) if args.peers else (),
                            seq_lens=tuple(int(t) for t in args.seq_lens.split(",")), tokens_per_step=args.tokens,
                            shape=shape_from_args(args), dtype=args.dtype, warmup=args.warmup, steps=args.steps,
                            modes=tuple(args.modes.split(",")), activation_checkpointing=args.activation_checkpointing,
                            budget_s=args.budget_s, device=args.device)


def run(args: argparse.Namespace, command: str) -> int:
    """Time every cell, print one JSON line per cell and each row's elapsed time, then the table."""
    try:
        config = config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"linmem bench models: {error}")
    return main_with(config, Path(args.out), command)


def main_with(config: TrainBenchConfig, out: Path, command: str) -> int:
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise BenchError("linmem bench models: no CUDA device found (use --device cpu for a smoke run)")
    env = environment(config.device)
    print(json.dumps(env), flush=True)
    cells: list[TrainCell] = []

    def report(cell: TrainCell) -> None:
        cells.append(cell)
        print(json.dumps({k: v for k, v in asdict(cell).items() if k != "steps_ms"}), flush=True)
        write_outputs(out, config, env, cells, command)

    run_models(config, report, row_done=lambda label, s: print(f"# {label}: {s:.0f} s", flush=True))
    print("\n" + write_outputs(out, config, env, cells, command), flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="linmem bench models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv), command_line("linmem bench models", argv))


if __name__ == "__main__":
    raise SystemExit(main())
