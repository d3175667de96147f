"""``linmem bench decode``: milliseconds per generated token and memory versus context, linmem's models
beside HF Llama (dynamic and static cache) and fla's models of the same shape, in one run.

The models are those of ``linmem bench models`` (``linmem.bench.peers``: ~370M, 24 layers, width 1024;
by default linmem's transformer, GLA, Gated DeltaNet, ``"LLLN"*6`` hybrid and FoX; ``--peers`` adds
HF Llama and fla's GLA). Each row is a model and a cache: HF Llama once with its dynamic cache
(``DynamicCache``) and once with its static one (``StaticCache``; ``generate(...,
cache_implementation="static")``, which transformers compiles); every linmem model once with its own
cache and once through ``generate(..., cache_implementation="static")``, the static cache and CUDA-graph
decoding, when the model has it: a short probe call decides, and the row reads "not available" with the
reason otherwise.

Protocol, for every row and context C (1K .. 128K by default, ascending; after a row runs out of memory
its longer contexts are not run), batch B = 8, weights bf16, under ``torch.inference_mode()``:

1. free what the previous cell held; random prompt ids ``[B, C]`` (seed 0);
2. prefill: one forward of the prompt with ``use_cache=True, logits_to_keep=1`` (the static row of HF
   Llama passes a ``StaticCache`` of C + warmup + steps positions), timed by the wall clock after a
   synchronisation; its peak memory is ``prefill GB``;
3. decode through the model's own cache: the peak statistic is reset, ``warmup`` steps (default 2) run,
   then ``steps`` steps (default 16) run back to back between two CUDA events, each step one forward
   of the last token against the cache returned by the previous one and a greedy argmax kept on the
   device (no host synchronisation in the loop); ms/token is the elapsed time over ``steps``: one step
   makes one token for each of the B sequences. ``GB`` is the peak over these steps (weights, cache,
   one step's work);
4. through ``generate()`` (at the contexts of ``--generate-contexts``; the static linmem rows at every
   context): greedy, ``max_new_tokens = min_new_tokens = 1 + warmup + steps``, timed by a streamer that
   reads the clock at every token (transformers hands it each token on the host); ms/token is the time
   of the last ``steps`` tokens over ``steps``. Static rows run one untimed ``generate()`` of the same
   size first (compilation, graph capture).

``--prune-tolerance eps`` builds the FoX rows with adaptive computation pruning (``mixer.prune_tolerance``):
their prefill (one call over its own keys) skips the key tiles the forget gates make negligible, while the
decoding steps read the whole cache as before; the row's label says so.

Out of memory reads "out of memory"; other errors their message; a peer that is not installed is
skipped with the reason. The tables (ms/token (GB); prefill ms (GB); ``generate()`` ms/token) are
printed and written as JSON (``decode.json``) and Markdown (``decode.md``) to ``--out`` with two plots,
``decode_latency.png`` and ``decode_memory.png`` (ms/token and GB versus context). On CPU the wall clock
times every step and no memory is reported.

    linmem bench decode --peers
    linmem bench decode --models gla,hybrid --contexts 2048,32768 --peers llama
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from . import BenchError
from ..models.outputs import output_cache
from .models import error_text, free_memory, is_out_of_memory
from .peers import (ARCHITECTURES, ModelShape, add_common_arguments, build_model, model_spec, parse_keys, parse_peers,
                    row_keys, shape_from_args, unavailable_reason)
from .report import command_line, environment, environment_line, length_label, markdown_table, text_table, write_json

DEFAULT_MODELS = ("transformer", "gla", "gated_deltanet", "hybrid", "fox")
DEFAULT_PEERS = "llama,fla-gla"
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What ``linmem bench decode`` times."""

    models: tuple[str, ...] = DEFAULT_MODELS  # linmem architectures (peers.ARCHITECTURES)
    peers: tuple[str, ...] = ()  # peer keys (peers.PEERS) timed in the same run
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS  # prompt lengths C, ascending
    batch: int = 8  # sequences decoded together
    warmup: int = 2  # untimed decoding steps before the timed ones
    steps: int = 16  # timed decoding steps
    generate_contexts: Optional[tuple[int, ...]] = None  # contexts also timed through generate() (None: all)
    shape: ModelShape = ModelShape()  # width, depth and vocabulary of every model
    dtype: str = "bfloat16"  # weights
    budget_s: Optional[float] = None  # start no cell after this many seconds
    device: str = "cuda"
    prune_tolerance: Optional[float] = None  # FoX rows: adaptive computation pruning at this tolerance (None: off)

    def __post_init__(self) -> None:
        parse_keys(",".join(self.models), ARCHITECTURES, "model")
        if self.prune_tolerance is not None and ("fox" not in self.models or not 0 < self.prune_tolerance < 1):
            raise ValueError(f"prune_tolerance prunes the fox rows: a softmax mass in (0, 1) with fox among the "
                             f"models, got {self.prune_tolerance} with models {','.join(self.models)}")
        if self.warmup < 0 or self.steps < 1 or self.batch < 1:
            raise ValueError(f"warmup >= 0, steps >= 1 and batch >= 1 expected, got warmup={self.warmup}, "
                             f"steps={self.steps}, batch={self.batch}")
        if not self.contexts or list(self.contexts) != sorted(self.contexts) or self.contexts[0] < 1:
            raise ValueError(f"contexts must be ascending positive lengths, got {self.contexts}")

    def rows(self) -> list[tuple[str, str]]:
        """(model key, cache) in table order (peers.row_keys): HF and linmem models also with a static cache."""
        return [(key, cache) for key in row_keys(self.models, self.peers)
                for cache in (("dynamic", "static") if model_spec(key).family in ("hf", "linmem") else ("dynamic",))]

    def times_generate(self, cache: str, context: int) -> bool:
        return cache == "static" or self.generate_contexts is None or context in self.generate_contexts


@dataclass
class DecodeCell:
    """One (model, cache, context) of the tables."""

    model: str
    label: str
    cache: str  # dynamic (the model's own) or static
    B: int
    context: int
    status: str = "ok"  # ok, out of memory, skipped, not available, error, not run
    reason: str = ""
    prefill_ms: Optional[float] = None
    prefill_peak_GB: Optional[float] = None
    ms_per_token: Optional[float] = None  # own-cache loop, one step for B sequences
    decode_peak_GB: Optional[float] = None
    generate_ms_per_token: Optional[float] = None
    weights_GB: Optional[float] = None
    wall_s: float = 0.0


def row_label(key: str, cache: str, prune_tolerance: Optional[float] = None) -> str:
    spec = model_spec(key)
    if spec.family == "hf":
        return f"{spec.label}, {cache} cache"
    pruned = f", pruned at {prune_tolerance:g}" if key == "fox" and prune_tolerance is not None else ""
    return spec.label + pruned + (", static cache" if cache == "static" else "")


def cache_keyword(model: nn.Module) -> str:
    """The name ``model.forward`` takes its cache by: ``cache`` (transformers >= 5.x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _static_cache(model: nn.Module, max_len: int) -> object:
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


class _TokenClock:
    """A ``generate()`` streamer that reads the clock each time it is handed tokens (the prompt first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def static_cache_refusal(model: nn.Module, device: str) -> Optional[str]:
    """None when ``model.generate(..., cache_implementation="static")`` decodes with a static cache, else why not.

    A probe of 2 tokens after a 4-token prompt: the call must succeed, and the cache it returns must not be
    the dynamic :class:`~linmem.models.LinmemCache` (transformers ignores ``cache_implementation`` for a
    model that makes its own cache, with a warning).
    """
    from ..models import LinmemCache

    ids = torch.zeros(1, 4, dtype=torch.long, device=device)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                             cache_implementation="static", return_dict_in_generate=True)
    except Exception as error:  # the path is missing or broken: say how
        return error_text(error)
    cache = output_cache(out)
    if type(cache) is LinmemCache and not getattr(cache, "is_compileable", False):
        return "generate() ignores cache_implementation='static' (it decoded with the dynamic LinmemCache)"
    return None


def _own_cache(model: nn.Module, cell: DecodeCell, config: DecodeBenchConfig, ids: torch.Tensor) -> None:
    """Prefill, then time ``steps`` greedy decoding steps through the cache the model returns."""
    cuda = torch.device(config.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    keyword = cache_keyword(model)
    first = {}
    if cell.cache == "static":
        first[keyword] = _static_cache(model, ids.shape[1] + config.warmup + config.steps + 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **first)
    sync()
    cell.prefill_ms = (time.perf_counter() - start) * 1e3
    cell.prefill_peak_GB = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    state = {"cache": output_cache(out), "token": out.logits[:, -1:].argmax(-1)}
    del out
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        out = model(input_ids=state["token"], use_cache=True, **{keyword: state["cache"]})
        state["cache"], state["token"] = output_cache(out), out.logits[:, -1:].argmax(-1)

    for _ in range(config.warmup):
        step()
    sync()
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(config.steps):
            step()
        end.record()
        end.synchronize()
        cell.ms_per_token = begin.elapsed_time(end) / config.steps
        cell.decode_peak_GB = torch.cuda.max_memory_allocated() / 1e9
    else:
        start = time.perf_counter()
        for _ in range(config.steps):
            step()
        cell.ms_per_token = (time.perf_counter() - start) * 1e3 / config.steps


def _through_generate(model: nn.Module, cell: DecodeCell, config: DecodeBenchConfig, ids: torch.Tensor) -> None:
    """ms/token of the last ``steps`` tokens of one greedy ``generate()`` call (module docstring, step 4)."""
    new = 1 + config.warmup + config.steps
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if cell.cache == "static":
        kwargs["cache_implementation"] = "static"
        model.generate(ids, **kwargs)  # compilation / graph capture, untimed
    clock = _TokenClock()
    model.generate(ids, streamer=clock, **kwargs)
    if len(clock.times) < config.steps + 2:  # the prompt, the prefill's token, then one per step
        raise RuntimeError(f"generate() handed its streamer {len(clock.times)} times for {new} tokens")
    cell.generate_ms_per_token = (clock.times[-1] - clock.times[-1 - config.steps]) * 1e3 / config.steps


def decode_cell(model: nn.Module, cell: DecodeCell, config: DecodeBenchConfig) -> DecodeCell:
    """Time one cell on a built model; out of memory and other errors land in the cell."""
    free_memory(config.device)
    start = time.perf_counter()
    generator = torch.Generator(device=config.device).manual_seed(0)
    ids = torch.randint(0, config.shape.vocab_size, (config.batch, cell.context), device=config.device,
                        generator=generator)
    try:
        if not (cell.cache == "static" and model_spec(cell.model).family == "linmem"):
            with torch.inference_mode():
                _own_cache(model, cell, config, ids)
        free_memory(config.device)
        if config.times_generate(cell.cache, cell.context):
            _through_generate(model, cell, config, ids)
    except Exception as error:  # a model that fails at this context says so in its cell
        cell.status, cell.reason = ("out of memory", "") if is_out_of_memory(error) else ("error", error_text(error))
    cell.wall_s = time.perf_counter() - start
    free_memory(config.device)
    return cell


def _prepare_row(key: str, cache: str, config: DecodeBenchConfig) -> tuple[Optional[nn.Module], Optional[tuple]]:
    """``(model, stop)``: the row's model in eval mode, or None and ``(status, reason)`` for all its cells."""
    try:
        pruned = {"prune_tolerance": config.prune_tolerance} if key == "fox" and config.prune_tolerance else None
        model, _ = build_model(key, config.shape, device=config.device, dtype=getattr(torch, config.dtype),
                               mixer=pruned)
    except ImportError as error:
        return None, ("skipped", unavailable_reason(error))
    except Exception as error:  # a model that cannot be built says so in its row
        oom = is_out_of_memory(error)
        return None, ("out of memory", "building the model") if oom else ("error", error_text(error))
    model.eval()
    if cache == "static" and model_spec(key).family == "linmem":
        refusal = static_cache_refusal(model, config.device)
        if refusal:
            return None, ("not available", refusal)
    return model, None


def run_decode(config: DecodeBenchConfig, report: Callable[[DecodeCell], None] = lambda cell: None,
               row_done: Callable[[str, float], None] = lambda label, seconds: None) -> list[DecodeCell]:
    """Every cell of the tables, in order; ``report`` sees each cell, ``row_done`` each row's label and seconds.
    A row stops at its first out of memory (its longer contexts read "not run")."""
    started = time.perf_counter()
    over_budget = lambda: config.budget_s is not None and time.perf_counter() - started > config.budget_s  # noqa: E731
    budget_stop = ("not run", f"time budget of {config.budget_s} s spent")
    cells = []
    for key, cache in config.rows():
        row_start = time.perf_counter()
        model, stop = (None, budget_stop) if over_budget() else _prepare_row(key, cache, config)
        for context in config.contexts:
            stop = stop or (budget_stop if over_budget() else None)
            cell = DecodeCell(key, row_label(key, cache, config.prune_tolerance), cache, config.batch, context)
            if stop:
                cell.status, cell.reason = stop
            else:
                decode_cell(model, cell, config)
                if cell.status == "out of memory":
                    stop = ("not run", f"out of memory at context {length_label(context)}")
                elif cell.status == "ok":
                    cell.weights_GB = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
            cells.append(cell)
            report(cell)
        del model
        if cache == "static":
            torch._dynamo.reset()  # transformers compiles the static decoding step: its graphs hold the model
        free_memory(config.device)
        row_done(row_label(key, cache, config.prune_tolerance), time.perf_counter() - row_start)
    return cells


def tables(cells: list[DecodeCell], config: DecodeBenchConfig
           ) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[str]]:
    """``([(title, header, rows)], notes)``: own-cache ms/token (GB), prefill ms (GB) and ``generate()``
    ms/token, one row per (model, cache), one column per context; reasons as numbered notes."""
    notes: list[str] = []

    def text(c: DecodeCell, value: Optional[float], gb: Optional[float]) -> str:
        if c.status == "ok":
            if value is None:
                return "-"
            return f"{value:.2f} ({gb:.1f})" if gb is not None else f"{value:.2f}"
        if not c.reason:
            return c.status
        note = f"{c.status}: {c.reason}"
        notes.extend([note] if note not in notes else [])
        return f"{c.status} [{notes.index(note) + 1}]"

    header = ["model"] + [length_label(c) for c in config.contexts]
    by_row = [(row_label(*row, config.prune_tolerance), [c for c in cells if (c.model, c.cache) == row])
              for row in config.rows()]
    by_row = [(label, row) for label, row in by_row if row]
    pad = lambda texts: texts + [""] * (len(config.contexts) - len(texts))  # noqa: E731
    parts = [
        (f"ms per token through each model's own cache, batch {config.batch} (peak GB)", header,
         [[label] + pad([text(c, c.ms_per_token, c.decode_peak_GB) for c in row]) for label, row in by_row]),
        ("prefill ms (peak GB)", header,
         [[label] + pad([text(c, c.prefill_ms, c.prefill_peak_GB) for c in row]) for label, row in by_row]),
        ("generate() ms per token", header,
         [[label] + pad([text(c, c.generate_ms_per_token, None) for c in row]) for label, row in by_row]),
    ]
    return parts, [f"[{i + 1}] {n}" for i, n in enumerate(notes)]


def plot(cells: list[DecodeCell], config: DecodeBenchConfig, env: dict, out: Path) -> list[Path]:
    """decode_latency.png and decode_memory.png: ms/token and GB versus context, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, ylabel, value in (
        ("decode_latency.png", "ms per token (batch step)",
         lambda c: c.ms_per_token if c.ms_per_token is not None else c.generate_ms_per_token),
        ("decode_memory.png", "peak GB while decoding", lambda c: c.decode_peak_GB),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in config.rows():
            points = [(c.context, value(c)) for c in cells if (c.model, c.cache) == row and c.status == "ok"
                      and value(c) is not None]
            if points:
                generate_only = any(c.ms_per_token is None for c in cells if (c.model, c.cache) == row)
                label = row_label(*row, config.prune_tolerance) + (" (generate)" if generate_only else "")
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(config.contexts), [length_label(c) for c in config.contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"batch {config.batch}, {env['device']}, {env['date']}", fontsize=9)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths


def write_outputs(out: Path, config: DecodeBenchConfig, env: dict, cells: list[DecodeCell], command: str) -> str:
    """Write decode.json (a result file of ``linmem bench report``: env, command, tables, and every cell) and
    decode.md to ``out``; return the text of the tables."""
    title = (f"Decoding, batch {config.batch}, {config.dtype} weights, D = {config.shape.hidden_size}, "
             f"{config.shape.num_layers} layers, vocab {config.shape.vocab_size}; {config.steps} timed steps "
             f"after {config.warmup}")
    parts, notes = tables(cells, config)
    write_json(out / "decode.json", {"env": env, "command": command, "intro": title,
                                     "tables": [{"title": t, "header": h, "rows": r} for t, h, r in parts],
                                     "notes": "\n".join(notes), "config": asdict(config),
                                     "cells": [asdict(c) for c in cells]})
    md = [title, environment_line(env)] + [f"{t}\n\n{markdown_table(h, r)}" for t, h, r in parts]
    (out / "decode.md").write_text("\n\n".join(md + (["\n".join(notes)] if notes else [])) + "\n")
    return "\n".join([title, environment_line(env)] + [f"\n{t}\n{text_table(h, r)}" for t, h, r in parts] + notes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linmem bench decode``."""
    add_common_arguments(parser, DEFAULT_MODELS, DEFAULT_PEERS, "runs/bench/decode")
    parser.add_argument("--contexts", default=",".join(str(c) for c in DEFAULT_CONTEXTS),
                        help="prompt lengths, ascending (a row stops at its first out of memory)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed decoding steps")
    parser.add_argument("--steps", type=int, default=16, help="timed decoding steps")
    parser.add_argument("--generate-contexts", default="all",
                        help="contexts also timed through generate(): 'all', 'none' or a comma list")
    parser.add_argument("--prune-tolerance", type=float, default=None,
                        help="build the fox rows with adaptive computation pruning at this tolerance (mixer."
                             "prune_tolerance): it prunes their prefill")


def config_from_args(args: argparse.Namespace) -> DecodeBenchConfig:
    models = parse_keys(args.models, ARCHITECTURES, "model")
    generate = {"all": None, "none": ()}.get(args.generate_contexts)
    if args.generate_contexts not in ("all", "none"):
        generate = tuple(int(c) for c in args.generate_contexts.split(","))
    return DecodeBenchConfig(models=models, peers=parse_peers(args.peers, models) if args.peers else (),
                             contexts=tuple(int(c) for c in args.contexts.split(",")), batch=args.batch,
                             warmup=args.warmup, steps=args.steps, generate_contexts=generate,
                             shape=shape_from_args(args), dtype=args.dtype, budget_s=args.budget_s,
                             device=args.device, prune_tolerance=args.prune_tolerance)


def run(args: argparse.Namespace, command: str) -> int:
    """Time every cell, print one JSON line per cell and each row's elapsed time, then the tables."""
    try:
        config = config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"linmem bench decode: {error}")
    return main_with(config, Path(args.out), command)


def main_with(config: DecodeBenchConfig, out: Path, command: str) -> int:
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise BenchError("linmem bench decode: no CUDA device found (use --device cpu for a smoke run)")
    env = environment(config.device)
    print(json.dumps(env), flush=True)
    cells: list[DecodeCell] = []

    def report(cell: DecodeCell) -> None:
        cells.append(cell)
        print(json.dumps(asdict(cell)), flush=True)
        write_outputs(out, config, env, cells, command)

    run_decode(config, report, row_done=lambda label, s: print(f"# {label}: {s:.0f} s", flush=True))
    print("\n" + write_outputs(out, config, env, cells, command), flush=True)
    for path in plot(cells, config, env, out):
        print(f"wrote {path}", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="linmem bench decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv), command_line("linmem bench decode", argv))


if __name__ == "__main__":
    raise SystemExit(main())
