"""``linmem eval``: the command-line arguments of the evaluation suites and the command itself.

This module imports nothing heavy, so building the parser stays instant; the suites load when
the command runs.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

SUITE_NAMES = ("mqar", "perplexity", "niah", "position-loss", "harness")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


MAX_DEPTH_COUNT = 101  # niah: evenly spaced depths, at most one a percent


def _depths(text: str):
    """``10`` (that many evenly spaced depths, 1 to 101) or ``0,25,50.5`` / ``75.0`` (percentages in [0, 100])."""
    try:
        value = int(text) if "," not in text and "." not in text else [float(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a count or comma-separated percentages, got {text!r}") from err
    if isinstance(value, int) and not 1 <= value <= MAX_DEPTH_COUNT:
        raise argparse.ArgumentTypeError(
            f"a count of evenly spaced depths must lie in [1, {MAX_DEPTH_COUNT}], got {value} (percentages are "
            "written with a comma or a point: 0,50,100 or 75.0)")
    if isinstance(value, list) and (not value or not all(0 <= d <= 100 for d in value)):
        raise argparse.ArgumentTypeError(f"depths are percentages in [0, 100], got {text!r}")
    return value


def _limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from err
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--limit must be > 0, got {text!r}")
    return int(value) if value >= 1 and value.is_integer() else value


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``linmem eval RUN_DIR [overrides] [--suite ...] [--harness TASKS] ...``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_eval_arguments(parser)
        >>> args = parser.parse_args(["runs/x", "--suite", "niah,position-loss", "--lengths", "512,1024"])
        >>> args.suite, args.lengths
        (['niah', 'position-loss'], [512, 1024])
    """
    parser.add_argument("run_dir", help="a run directory written by `linmem train`, or a model folder (linmem "
                                        "linearize --out, save_pretrained): a text model on the default corpus, "
                                        "data.text.* overrides choose other text")
    parser.add_argument("overrides", nargs="*",
                        help="section.key=value config overrides (e.g. data.mqar.eval_settings=...)")
    parser.add_argument("--suite", type=_names, action="extend", default=[],
                        help=f"suites to run, comma-separated or repeated: {', '.join(SUITE_NAMES)} "
                             "(default: the run's own metric, mqar or perplexity; a model folder's: perplexity)")
    parser.add_argument("--lengths", type=_int_list, default=None,
                        help="niah / position-loss lengths in tokens, e.g. 1024,2048,4096 "
                             "(default: 1, 2 and 4 times the training length)")
    parser.add_argument("--depths", type=_depths, default=None,
                        help="niah: a number of evenly spaced depths (1 to 101), or comma-separated percentages "
                             "(default: 10 on a GPU, 3 on a CPU)")
    parser.add_argument("--samples", type=int, default=None,
                        help="niah: prompts per (task, length, depth) (default: 10 on a GPU, 2 on a CPU)")
    parser.add_argument("--niah-tasks", type=_names, default=None,
                        help="niah: RULER tasks, comma-separated (default: all eight)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="niah: tokens generated per prompt")
    parser.add_argument("--haystack", action="append", default=None,
                        help="niah: a file or folder of haystack text (repeatable; default: the Python stdlib sources)")
    parser.add_argument("--bins", type=int, default=32, help="position-loss: position bins per length")
    parser.add_argument("--max-windows", type=int, default=64, help="position-loss: held-out windows per length")
    parser.add_argument("--concat", action="store_true",
                        help="position-loss: cut windows across document boundaries (for short documents)")
    parser.add_argument("--harness", type=_names, default=None, metavar="TASKS",
                        help="also run these lm-evaluation-harness tasks (comma-separated; needs linmem[eval])")
    parser.add_argument("--include-path", default=None, help="harness: a folder of local task YAMLs")
    parser.add_argument("--local-tasks-only", action="store_true",
                        help="harness: index only --include-path, not lm-eval's built-in tasks (starts much faster)")
    parser.add_argument("--limit", type=_limit, default=None,
                        help="harness: examples per task; niah: prompts per task, spread over its (length, depth) "
                             "cells (a fraction of them when < 1)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="harness: few-shot examples per prompt")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--seed", type=int, default=0, help="niah: seed of the prompts")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: the run's device)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_eval_command(args: argparse.Namespace) -> int:
    """Run ``linmem eval`` with the arguments of :func:`add_eval_arguments`; prints the summary table.

    Example:
        >>> parser = argparse.ArgumentParser(); add_eval_arguments(parser)
        >>> run_eval_command(parser.parse_args(["runs/x", "--suite", "niah"]))  # doctest: +SKIP
    """
    from .niah import NIAH_TASKS
    from .suites import EvalOptions, evaluate_run, format_summary

    options = EvalOptions(
        lengths=args.lengths, depths=args.depths, samples=args.samples,
        niah_tasks=args.niah_tasks or list(NIAH_TASKS), max_new_tokens=args.max_new_tokens, haystack=args.haystack,
        bins=args.bins, max_windows=args.max_windows, concat=args.concat, harness_tasks=args.harness or [],
        include_path=args.include_path, local_tasks_only=args.local_tasks_only, limit=args.limit,
        num_fewshot=args.num_fewshot, batch_size=args.batch_size,
        seed=args.seed, device=args.device, progress=not args.no_progress,
    )
    out = evaluate_run(args.run_dir, args.suite, options, overrides=args.overrides)
    print(format_summary(out["summary"]))
    print(f"written to {out['run_dir']}/eval/")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m linmem.eval.command RUN_DIR ...``: the same command without the ``linmem`` entry point."""
    parser = argparse.ArgumentParser(prog="linmem eval", description=__doc__)
    add_eval_arguments(parser)
    return run_eval_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
