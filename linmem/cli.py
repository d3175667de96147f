"""Command line: ``linmem train | eval | generate | demo``.

    linmem train --recipe mqar-gated_deltanet schedule.steps=2000 run.out_dir=runs/gdn
    linmem eval runs/gdn
    linmem generate runs/text --prompt "def main(" --max-new-tokens 200
    linmem demo                      # the built-in default job (CPU, ~10 minutes)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence



def _train(args: argparse.Namespace) -> int:
    from .train import Trainer, load_config

    config = load_config(args.config, recipe=args.recipe, overrides=args.overrides)
    print(config.to_yaml())
    trainer = Trainer(config)
    print(f"model: {trainer.parameter_count() / 1e6:.2f}M parameters; task: {trainer.task.describe()}")
    result = trainer.train()
    print(f"done: {result.steps} steps, skipped {result.skipped_steps}; metrics: {result.metrics}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .train.runs import load_run

    run = load_run(Path(args.run_dir), overrides=args.overrides)
    metrics = run.task.evaluate(run.model, run.device)
    for name, value in metrics.items():
        print(f"{name:<28}{value:.4f}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .train.runs import load_run

    run = load_run(Path(args.run_dir), overrides=args.overrides)
    if not hasattr(run.task, "encode"):
        raise SystemExit(f"{args.run_dir} was trained on {run.task.describe()}, which has no text to generate")
    print(run.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(Path(args.out), quick=args.quick)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linmem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a config file or recipe")
    train.add_argument("--config", help="a YAML config file")
    train.add_argument("--recipe", help="a named recipe in recipes/")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    train.set_defaults(func=_train)

    evaluate = sub.add_parser("eval", help="evaluate a saved run directory")
    evaluate.add_argument("run_dir")
    evaluate.add_argument("overrides", nargs="*", help="section.key=value overrides (e.g. data.mqar.eval_settings=...)")
    evaluate.set_defaults(func=_eval)

    generate = sub.add_parser("generate", help="sample text from a saved run directory")
    generate.add_argument("run_dir")
    generate.add_argument("--prompt", default="")
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("overrides", nargs="*")
    generate.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="the built-in default job: MQAR study + a small hybrid on text (CPU)")
    demo.add_argument("--out", default="runs/demo", help="where runs, table and plots go")
    demo.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
