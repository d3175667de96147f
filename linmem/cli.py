"""Command line: ``linmem train | eval | generate | bench | demo``.

    linmem train --recipe mqar-gated_deltanet schedule.steps=2000 run.out_dir=runs/gdn
    linmem eval runs/gdn
    linmem generate runs/text --prompt "def main(" --max-new-tokens 200
    linmem bench ops --peers         # kernel times beside SDPA and flash-linear-attention (CUDA)
    linmem bench layers              # MoM, MoE and a Linear-MoE recipe's training tokens/s (CUDA)
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
    from .demo import mom_study, print_table, run_demo

    if args.mom:
        print_table(mom_study(Path(args.out), device=args.device, width=args.width, quick=args.quick))
    else:
        run_demo(Path(args.out), quick=args.quick)
    return 0


def _bench_ops(args: argparse.Namespace) -> int:
    from .bench.ops import BenchConfig, main

    shapes = tuple(tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(","))
    config = BenchConfig(shapes=shapes, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                         ops=tuple(args.ops.split(",")), backends=tuple(args.backends.split(",")),
                         peers=tuple(p for p in args.peers.split(",") if p),
                         decode_batch=args.decode_batch, gates=args.gates, breakdown=args.breakdown,
                         accuracy=args.accuracy)
    return main(config, json_path=args.json)


def _bench_layers(args: argparse.Namespace) -> int:
    from .bench.layers import run

    return run(args)


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

    bench = sub.add_parser("bench", help="benchmarks beside peers, measured in one run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    ops = bench_sub.add_parser("ops", help="forward and forward+backward time of every op and backend (CUDA)")
    ops.add_argument("--shapes", default="8x2048,4x4096,2x8192,1x16384", help="BxT pairs, comma-separated")
    ops.add_argument("--heads", type=int, default=16)
    ops.add_argument("--head-dim", type=int, default=128)
    ops.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ops.add_argument("--ops", default="linear_attention,retention,mamba2,gla,rwkv6,deltanet,gated_deltanet,kda,attention",
                     help="memory ops of the unified recurrence, 'attention' (causal) and 'fox' (forgetting)")
    ops.add_argument("--backends", default="triton,chunk", help="linear_recurrence backends to time")
    ops.add_argument("--peers", nargs="?", const="sdpa,fla", default="",
                     help="add peers measured in the same run: sdpa (PyTorch SDPA, causal), fla (flash-linear-attention)")
    ops.add_argument("--decode-batch", type=int, default=64, help="batch of the decoding-step rows (0: none)")
    ops.add_argument("--gates", type=float, default=1.0,
                     help="log decays this many times the default: 10 and 100 send per-channel decays down the "
                          "kernels' block and pairwise paths, as fast-forgetting channels of a trained model do")
    ops.add_argument("--json", help="also write the rows to this JSON file")
    ops.add_argument("--breakdown", action="store_true",
                     help="also print the GPU time of every kernel of each memory op (and fla peer) at the first shape")
    ops.add_argument("--accuracy", action="store_true",
                     help="also print the error ratios of each memory op (and fla peer) against float64 at the first shape")
    ops.set_defaults(func=_bench_ops)
    layers = bench_sub.add_parser("layers", help="MoM vs one memory, MoE grouped GEMM vs loop, a recipe's tokens/s (CUDA)")
    from .bench.layers import add_arguments

    add_arguments(layers)
    layers.set_defaults(func=_bench_layers)

    demo = sub.add_parser("demo", help="the built-in default job: MQAR study + a small hybrid on text (CPU)")
    demo.add_argument("--out", default="runs/demo", help="where runs, table and plots go")
    demo.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    demo.add_argument("--mom", action="store_true",
                      help="instead: MoM (4 Gated DeltaNet memories, top-2) vs one Gated DeltaNet memory on MQAR")
    demo.add_argument("--device", default="auto", help="device of the --mom study (auto, cpu, cuda)")
    demo.add_argument("--width", type=int, default=64, help="model width of the --mom study")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
