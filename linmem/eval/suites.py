"""Evaluation suites of a run directory or a model folder: each writes ``<run_dir>/eval/<suite>.json`` (and plots).

    suite           runs on                      measures
    mqar            MQAR runs                    recall accuracy per (seq_len, kv pairs) setting
    perplexity      text, instruct, folders      held-out loss and perplexity (instruction runs: of the answers)
    niah            text, instruct, folders      RULER needle-in-a-haystack accuracy per (task, length, depth)
    position-loss   text runs, folders           held-out loss by token position, up to and past the training length
    harness         text, instruct, folders      lm-evaluation-harness tasks (needs the [eval] extra)

A model folder (``save_pretrained`` output, such as ``linmem linearize`` writes) has no training config:
it is evaluated as a text run on the default corpus (the Python standard library; ``data.text.*``
overrides choose other text) through its own tokenizer, or bytes; MQAR needs a run's task and is refused.

:func:`evaluate_run` runs the asked suites one after another and returns (and writes to
``eval/summary.csv`` / ``.md``) one summary table: rows of ``suite, metric, value``. A suite is a
function ``(run, out_dir, options) -> rows`` in :data:`SUITES`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from ..data.codec import Codec
from ..data.corpus import describe_source
from ..data.sources import text_files
from .niah import NIAH_DEFAULTS, NIAH_TASKS, depth_grid, plot_niah, run_niah
from .position_loss import (extrapolation_rows, plot_position_loss, position_loss, window_tokens,
                            write_position_loss)
from .runs import EvalRun, open_run
from .tables import write_table

PathLike = Union[str, Path]
logger = logging.getLogger("linmem.eval")
#: the suites that score held-out text of the run's data (a model folder's: the default corpus or data.text.*)
NEEDS_VALIDATION = ("perplexity", "position-loss")


class EvalError(ValueError):
    """A suite, option or run that cannot be evaluated as asked."""


@dataclass
class EvalOptions:
    """Settings of the suites (each suite reads the fields it needs)."""

    lengths: Optional[list[int]] = None  # niah / position-loss lengths; None: 1, 2 and 4 times the training length
    depths: Union[int, list[float], None] = None  # niah: evenly spaced depths, or the percentages; None: by device
    samples: Optional[int] = None  # niah: prompts per (task, length, depth); None: by device (NIAH_DEFAULTS)
    niah_tasks: list[str] = field(default_factory=lambda: list(NIAH_TASKS))  # niah: RULER tasks to run
    max_new_tokens: int = 128  # niah: generation budget per prompt (counted in the length)
    haystack: Optional[list[str]] = None  # niah: files/folders of haystack text; None: the Python stdlib sources
    bins: int = 32  # position-loss: position bins per length
    max_windows: int = 64  # position-loss: windows per length
    concat: bool = False  # position-loss: cut windows across document boundaries
    harness_tasks: list[str] = field(default_factory=list)  # harness: lm-eval task names
    include_path: Optional[str] = None  # harness: folder of local task YAMLs
    local_tasks_only: bool = False  # harness: index only include_path, not lm-eval's built-in tasks (faster start)
    limit: Optional[float] = None  # harness: examples per task; niah: prompts per task (a fraction when < 1)
    num_fewshot: Optional[int] = None  # harness: few-shot examples (None: each task's default)
    batch_size: int = 8  # sequences per forward pass
    seed: int = 0  # niah prompts
    device: Optional[str] = None  # None: the run's device
    progress: bool = True  # progress bars


def _text_run(run: EvalRun, suite: str) -> Codec:
    if run.codec is None:
        raise EvalError(f"suite {suite} needs a run trained on text; {run.run_dir} was trained on {run.task_kind}")
    return run.codec


def validation_documents(run: EvalRun, suite: str):
    """The held-out documents of a text run (None for an instruction run's perplexity, which scores its held-out
    answers); an :class:`EvalError` that says so when it has none."""
    _text_run(run, suite)
    if run.task_kind == "instruct":
        if suite == "perplexity":
            return None
        raise EvalError(f"suite {suite} needs held-out text documents; {run.run_dir} was trained on instruction "
                        f"examples (suite perplexity scores its held-out answers). For the loss by position on text, "
                        f"evaluate its model folder: linmem eval {run.loaded.model_dir} --suite {suite}")
    documents = run.task.val_docs
    if len(documents) == 0:
        raise EvalError(f"{run.run_dir} has no validation data (validation: {run.task.split}), and suite {suite} "
                        "scores held-out text: train with data.text.val_fraction > 0 (or prepare the data with "
                        "--val-fraction > 0); suites niah and harness, and linmem generate, need none")
    return documents


def _lengths(run: EvalRun, options: EvalOptions) -> list[int]:
    return list(options.lengths) if options.lengths else [run.train_length * k for k in (1, 2, 4)]


def _write_json(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _task_metrics(run: EvalRun, out_dir: Path, name: str) -> list[dict]:
    metrics = run.task.evaluate(run.model, run.device)
    _write_json({"metrics": metrics}, out_dir / f"{name}.json")
    return [{"suite": name, "metric": key, "value": float(value)} for key, value in metrics.items()]


def mqar_suite(run: EvalRun, out_dir: Path, options: EvalOptions) -> list[dict]:
    """MQAR recall accuracy of an MQAR run on its evaluation settings (``data.mqar.eval_settings``)."""
    if run.loaded.model_folder:
        raise EvalError(f"suite mqar needs a run trained on MQAR (its vocabulary and settings); {run.run_dir} is a "
                        "model folder without a training config")
    if run.task_kind != "mqar":
        raise EvalError(f"suite mqar needs a run trained on MQAR; {run.run_dir} was trained on {run.task_kind}")
    return _task_metrics(run, out_dir, "mqar")


def perplexity_suite(run: EvalRun, out_dir: Path, options: EvalOptions) -> list[dict]:
    """Held-out loss and perplexity: of a text run's validation documents (a model folder's: those of the
    default corpus, or of ``data.text.*``), of an instruction run's held-out answers."""
    validation_documents(run, "perplexity")
    return _task_metrics(run, out_dir, "perplexity")


def niah_grid(run: EvalRun, options: EvalOptions) -> tuple[Union[int, list[float]], int]:
    """The depths and the prompts per (task, length, depth) of a NIAH suite: the options', else the
    device's defaults (:data:`NIAH_DEFAULTS`), with ``options.limit`` capping the prompts of each task."""
    depths, samples = NIAH_DEFAULTS["cuda" if run.device.type == "cuda" else "cpu"]
    depths = depths if options.depths is None else options.depths
    samples = samples if options.samples is None else options.samples
    if options.limit is None:
        return depths, samples
    if options.limit < 1:
        return depths, max(1, round(samples * options.limit))
    cells = len(_lengths(run, options)) * len(depth_grid(depths))
    if options.limit < cells:
        raise EvalError(f"--limit {options.limit:g} is fewer prompts than the {cells} (length, depth) cells of a niah "
                        "task: raise it, or lower --depths or --lengths")
    return depths, min(samples, int(options.limit) // cells)


def niah_suite(run: EvalRun, out_dir: Path, options: EvalOptions) -> list[dict]:
    """RULER needle-in-a-haystack: ``eval/niah.json`` and one heat map per task ``eval/<task>.png``."""
    codec = _text_run(run, "niah")
    haystack = None
    if options.haystack:
        haystack = text_files(options.haystack)
    depths, samples = niah_grid(run, options)
    result = run_niah(run.model, codec.encode, codec.decode, tasks=options.niah_tasks, lengths=_lengths(run, options),
                      depths=depths, samples=samples, max_new_tokens=options.max_new_tokens,
                      seed=options.seed, haystack=haystack, batch_size=options.batch_size,
                      eos_token_id=codec.eos_token_id, progress=options.progress)
    result.write(out_dir / "niah.json")
    plot_niah(result, out_dir)
    rows = [{"suite": "niah", "metric": f"{r['task']}/L{r['length']}", "value": r["accuracy"]}
            for r in result.summary_rows()]
    return rows + [{"suite": "niah", "metric": f"{task}/mean", "value": result.accuracy(task)}
                   for task in options.niah_tasks]


def position_loss_suite(run: EvalRun, out_dir: Path, options: EvalOptions) -> list[dict]:
    """Held-out loss by position: ``eval/position_loss.json``, ``position_loss_bins.csv/.md``, ``position_loss.png``."""
    documents = validation_documents(run, "position-loss")
    lengths = _lengths(run, options)
    available = window_tokens(documents, options.concat)
    if max(lengths) + 1 > available:
        within = ("in the validation documents together" if options.concat else
                  f"in the longest validation document ({window_tokens(documents, True):,} in all: --concat cuts "
                  "windows across documents)")
        raise EvalError(f"position-loss: a window of --lengths {max(lengths)} needs {max(lengths) + 1} tokens, there "
                        f"are {available:,} {within}; give shorter --lengths")
    curves = position_loss(run.model, documents, lengths=lengths, bins=options.bins,
                           max_windows=options.max_windows, batch_size=options.batch_size, concat=options.concat,
                           progress=options.progress)
    write_position_loss(curves, out_dir / "position_loss.json", train_length=run.train_length)
    plot_position_loss({run.run_dir.name: curves}, out_dir / "position_loss.png", train_length=run.train_length)
    rows = []
    for row in extrapolation_rows(curves, run.train_length):
        rows.append({"suite": "position-loss", "metric": f"loss/L{row['length']}", "value": row["loss"]})
        if row["length"] > run.train_length:
            rows.append({"suite": "position-loss", "metric": f"loss_past_train/L{row['length']}",
                         "value": row["loss_past_train"]})
    return rows


def harness_suite(run: EvalRun, out_dir: Path, options: EvalOptions) -> list[dict]:
    """lm-evaluation-harness tasks (``options.harness_tasks``): ``eval/harness.json``."""
    codec = _text_run(run, "harness")
    if not options.harness_tasks:
        raise EvalError("suite harness needs task names (--harness TASK[,TASK...])")
    from .harness import LinmemLM, run_harness

    lm = LinmemLM(run.model, codec, batch_size=options.batch_size, max_length=run.train_length)
    out = run_harness(run.run_dir, options.harness_tasks, include_path=options.include_path, limit=options.limit,
                      num_fewshot=options.num_fewshot, include_defaults=not options.local_tasks_only, lm=lm)
    _write_json(out, out_dir / "harness.json")
    return [{"suite": "harness", "metric": f"{task}/{metric}", "value": float(value)}
            for task, metrics in out["results"].items() for metric, value in metrics.items()
            if isinstance(value, (int, float)) and "stderr" not in metric]


Suite = Callable[[EvalRun, Path, EvalOptions], list[dict]]

SUITES: dict[str, Suite] = {
    "mqar": mqar_suite,
    "perplexity": perplexity_suite,
    "niah": niah_suite,
    "position-loss": position_loss_suite,
    "harness": harness_suite,
}


def evaluate_run(
    run_dir: PathLike,
    suites: Sequence[str] = (),
    options: Optional[EvalOptions] = None,
    *,
    overrides: Sequence[str] = (),
) -> dict:
    """Run ``suites`` on a run directory; writes ``<run_dir>/eval/`` and returns its summary.

    No suite given: the run's own metric (``mqar`` or ``perplexity``), plus ``harness`` when
    ``options.harness_tasks`` is set. Returns ``{"run_dir", "files": {suite: json path},
    "summary": [{"suite", "metric", "value"}, ...]}``; the summary is also written to
    ``eval/summary.csv`` and ``eval/summary.md``.

    Example:
        >>> out = evaluate_run("runs/text-hybrid-tiny", ["niah", "position-loss"],
        ...                    EvalOptions(lengths=[256, 512], depths=5, samples=4))  # doctest: +SKIP
        >>> print(format_summary(out["summary"]))  # doctest: +SKIP
    """
    options = options or EvalOptions()
    names = list(suites)
    if options.harness_tasks and "harness" not in names:
        names.append("harness")
    unknown = [s for s in names if s not in SUITES]
    if unknown:
        raise EvalError(f"unknown suite(s) {unknown}; valid: {', '.join(SUITES)}")
    if options.batch_size < 1:
        raise EvalError(f"batch_size must be >= 1, got {options.batch_size}")
    run = open_run(run_dir, overrides, device=options.device)
    if not names:
        names = ["mqar" if run.task_kind == "mqar" else "perplexity"]
    for name in names:  # before any suite runs: a run without validation data is named at once
        if name in NEEDS_VALIDATION:
            validation_documents(run, name)
    if run.loaded.model_folder and set(names) & set(NEEDS_VALIDATION):
        logger.info("%s has no data of its own: %s read the held-out documents of %s (data.text.* chooses other "
                    "text)", run.run_dir, " and ".join(n for n in names if n in NEEDS_VALIDATION),
                    describe_source(run.config.data.text))
    out_dir = run.run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, files = [], {}
    for name in names:
        summary += SUITES[name](run, out_dir, options)
        files[name] = str(out_dir / f"{name.replace('-', '_')}.json")
    write_table(summary, out_dir / "summary")
    _write_json({"options": asdict(options), "summary": summary}, out_dir / "summary.json")
    return {"run_dir": str(run.run_dir), "files": files, "summary": summary}


def format_summary(rows: Sequence[dict]) -> str:
    """The summary rows as an aligned text table.

    Example:
        >>> print(format_summary([{"suite": "niah", "metric": "niah_single_1/L512", "value": 0.75}]))
        suite  metric              value
        niah   niah_single_1/L512  0.7500
    """
    cells = [("suite", "metric", "value")] + [(r["suite"], r["metric"], f"{r['value']:.4f}") for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
