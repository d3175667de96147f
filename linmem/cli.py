"""Command line: ``linmem train | eval | generate | data prepare | tokenizer train | linearize | bench | demo``.

    linmem train --recipe mqar-gated_deltanet schedule.steps=2000 run.out_dir=runs/gdn
    torchrun --nproc-per-node 4 -m linmem.cli train --recipe R parallel.dp=2 parallel.sp=2   # several GPUs
    linmem eval runs/gdn                            # the run's own metric
    linmem eval runs/text --suite niah,position-loss --lengths 1024,2048,4096
    linmem eval runs/text --harness my_task --include-path tasks/   # lm-evaluation-harness (linmem[eval])
    linmem tokenizer train --out tok --vocab-size 8192             # BPE on local text (stdlib by default)
    linmem generate runs/text --prompt "def main(" --max-new-tokens 200 --top-p 0.9 --stop "def "
    linmem data prepare data/stdlib                 # tokenize once into memory-mapped shards
    linmem linearize --from ckpt/llama --out ckpt/liger --memory gla --window 64   # Liger: no new parameters
    linmem train data.task=text data.text.prepared=data/stdlib
    linmem bench ops --peers         # kernel times beside SDPA, FlexAttention and flash-linear-attention (CUDA)
    linmem bench layers              # MoM, MoE and a Linear-MoE recipe's training tokens/s (CUDA)
    linmem bench models --peers      # whole models' training tokens/s and memory beside HF Llama and fla (CUDA)
    linmem bench decode --peers      # ms per generated token and memory versus context beside HF Llama and fla
    linmem bench report --check      # whether BENCHMARKS.md is what the result files of benchmarks/ render
    linmem demo                      # the built-in default job (CPU, ~10 minutes; --quick: 1 minute)

Errors in what was asked (a config key, a path, a device, a missing optional package) print
one line and exit with status 2; -v prints the traceback too. Only the subcommand that runs
imports torch, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Optional, Sequence

from . import __version__

USAGE_ERROR = 2  # exit status of a refused command (argparse's)


def _train(args: argparse.Namespace) -> int:
    from .distributed.config import world_size
    from .train.config import check_processes, load_config

    config = load_config(args.config, recipe=args.recipe, overrides=args.overrides)
    check_processes(config, world_size())  # before torch loads: what only the config decides answers at once
    from .train.rundir import check_run_directory
    from .train.trainer import Trainer, check_launch

    check_launch(config)
    say = print if os.environ.get("RANK", "0") == "0" else (lambda *a, **k: None)  # torchrun: rank 0 speaks
    finished = check_run_directory(config)
    if finished is not None:
        say(f"{config.run.out_dir} holds a finished run ({finished['step']} steps); nothing to do. "
            f"Final metrics: {_metrics_line(finished['metrics'])}. To train longer, raise schedule.steps.")
        return 0
    say(config.to_yaml())
    _quiet_transformers()
    trainer = Trainer(config)
    no_graph = f" (no CUDA graph: {trainer.no_graph_reason})" if trainer.device.type == "cuda" and \
        trainer.no_graph_reason else ""
    say(f"model: {trainer.parameter_count() / 1e6:.2f}M parameters; task: {trainer.task.describe()}; step: "
        f"{trainer.mode}{no_graph}", flush=True)
    result = trainer.train()
    if result.already_finished:  # another process finished it in the meantime
        say(f"{config.run.out_dir} holds a finished run ({result.steps} steps); nothing to do.")
        return 0
    say(f"done: {result.steps} steps, skipped {result.skipped_steps}; metrics: {_metrics_line(result.metrics)}")
    return 0


def _quiet_transformers() -> None:
    """No per-file progress bars of transformers' save/load between linmem's own lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _metrics_line(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.4f}" for name, value in metrics.items()) or "none"


def _existing_run_dir(path: str) -> Path:
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} not found")
    return run_dir


def _eval(args: argparse.Namespace) -> int:
    _existing_run_dir(args.run_dir)
    from .eval.command import run_eval_command

    _quiet_transformers()
    return run_eval_command(args)


def _tokenizer(args: argparse.Namespace) -> int:
    from .tokenizer import run_tokenizer_command

    return run_tokenizer_command(args)


def _generate(args: argparse.Namespace) -> int:
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = args.prompt[err.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"--prompt is not valid UTF-8 (byte {byte!r} at character {err.start})") from None
    run_dir = _existing_run_dir(args.run_dir)
    from .train.runs import check_generation_args, load_run

    check_generation_args(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p)
    _quiet_transformers()
    run = load_run(run_dir, overrides=args.overrides)
    print(args.prompt, end="", flush=True)
    run.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, stop=args.stop, seed=args.seed,
                 stream=lambda piece: print(piece, end="", flush=True))
    print()
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from .data.config import TextSection
    from .data.prepared import prepare_corpus

    text = TextSection(paths=list(args.paths), dataset=args.dataset, text_field=args.text_field,
                       tokenizer=args.tokenizer, max_files=args.max_files, val_fraction=args.val_fraction,
                       errors=args.errors)
    manifest = prepare_corpus(text, Path(args.out), seed=args.seed, shard_tokens=args.shard_tokens)
    for name, split in manifest["splits"].items():
        print(f"{name:<11}{split['documents']:>10,} documents {split['tokens']:>14,} tokens in "
              f"{len(split['shards'])} shard(s); {split['empty']} empty skipped")
    print(f"wrote {args.out} ({manifest['dtype']}, vocab {manifest['vocab_size']}, validation "
          f"{manifest['validation']}); train on it with: linmem train data.task=text data.text.prepared={args.out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import mom_study, print_table, run_demo

    _quiet_transformers()
    if args.mom:
        print_table(mom_study(Path(args.out), device=args.device, width=args.width, quick=args.quick))
    else:
        run_demo(Path(args.out), quick=args.quick)
    return 0


def _linearize(args: argparse.Namespace) -> int:
    from .linearize.command import main

    _quiet_transformers()
    return main(args.passed_on)


def _bench_ops(args: argparse.Namespace) -> int:
    from .bench.ops import main_argv

    return main_argv(args.passed_on)


def _bench_layers(args: argparse.Namespace) -> int:
    from .bench.layers import main

    return main(args.passed_on)


def _bench_models(args: argparse.Namespace) -> int:
    from .bench.models import main

    return main(args.passed_on)


def _bench_decode(args: argparse.Namespace) -> int:
    from .bench.decode import main

    return main(args.passed_on)


def _bench_report(args: argparse.Namespace) -> int:
    from .bench.reference import main

    return main(args.passed_on)


def _config_sections() -> str:
    """The epilog of ``linmem train --help``: the config's sections, and where every key is described."""
    from .train.config_reference import section_lines

    return "config sections (every key, its type, default and meaning: docs/config.md):\n" + "\n".join(
        f"  {line}" for line in section_lines())


def build_parser() -> argparse.ArgumentParser:
    from .eval.command import add_eval_arguments
    from .tokenizer import add_tokenizer_arguments

    parser = argparse.ArgumentParser(prog="linmem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks of errors")
    parser.add_argument("--version", action="version", version=f"linmem {__version__}")
    common = argparse.ArgumentParser(add_help=False)  # -v after the subcommand too
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", parents=[common], help="train a model from a config file or recipe",
                           epilog=_config_sections(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", help="a YAML config file")
    train.add_argument("--recipe", help="a named recipe shipped in linmem/recipes/")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. data.task=text "
                                                    "data.text.paths=[my.txt] schedule.steps=200")
    train.set_defaults(func=_train)

    evaluate = sub.add_parser("eval", parents=[common], help="evaluate a run directory or a model folder (its own "
                                                             "metric, NIAH, per-position loss, lm-eval)")
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=_eval)

    tokenizer = sub.add_parser("tokenizer", parents=[common], help="train a byte-level BPE tokenizer on local text")
    add_tokenizer_arguments(tokenizer)
    tokenizer.set_defaults(func=_tokenizer)

    generate = sub.add_parser("generate", parents=[common],
                              help="sample text from a run directory or a model folder (streamed)")
    generate.add_argument("run_dir", help="a run directory (linmem train) or a model folder (linmem linearize --out, "
                                          "save_pretrained): its tokenizer, else UTF-8 bytes")
    generate.add_argument("--prompt", default="")
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    generate.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    generate.add_argument("--top-p", type=float, help="sample from the smallest set of tokens holding this probability")
    generate.add_argument("--stop", help="stop before this string (e.g. $'\\n\\n')")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("overrides", nargs="*")
    generate.set_defaults(func=_generate)

    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", parents=[common],
                                  help="tokenize local text or a local dataset once into memory-mapped token shards")
    prepare.add_argument("out", help="the folder to write (new or empty)")
    prepare.add_argument("paths", nargs="*", help="text files and folders (default: the Python standard library)")
    prepare.add_argument("--dataset", help="a local Hugging Face dataset folder or json/jsonl/parquet file(s)")
    prepare.add_argument("--text-field", default="text", help="the dataset column holding the text")
    prepare.add_argument("--tokenizer", help="a local tokenizer folder (default: UTF-8 bytes)")
    prepare.add_argument("--max-files", type=int, help="read at most this many files")
    prepare.add_argument("--val-fraction", type=float, default=0.02,
                         help="documents held out for validation (unless the dataset has a validation split)")
    prepare.add_argument("--seed", type=int, default=0, help="which documents are held out (as data.seed does)")
    prepare.add_argument("--errors", default="replace", choices=["replace", "strict"], help="invalid UTF-8 in files")
    prepare.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (about)")
    prepare.set_defaults(func=_data_prepare)

    linearize = sub.add_parser("linearize", parents=[common], add_help=False,  # its options: linmem.linearize.command
                               help="convert a local Llama / Mistral / Qwen2 / Qwen3 checkpoint into a Liger model")
    linearize.set_defaults(func=_linearize, passes_on=True)

    bench = sub.add_parser("bench", help="benchmarks beside peers, measured in one run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    ops = bench_sub.add_parser("ops", add_help=False,  # its options and --help: linmem.bench.ops
                               help="forward and forward+backward time of every op and backend (CUDA)")
    ops.set_defaults(func=_bench_ops, passes_on=True)
    layers = bench_sub.add_parser("layers", add_help=False,  # its options and --help: linmem.bench.layers
                                  help="MoM vs one memory, MoE grouped GEMM vs loop, a recipe's tokens/s (CUDA)")
    layers.set_defaults(func=_bench_layers, passes_on=True)
    models = bench_sub.add_parser("models", add_help=False,  # its options and --help: linmem.bench.models
                                  help="whole models' training tokens/s and peak memory beside HF Llama and fla (CUDA)")
    models.set_defaults(func=_bench_models, passes_on=True)
    decode = bench_sub.add_parser("decode", add_help=False,  # its options and --help: linmem.bench.decode
                                  help="ms per generated token and memory versus context beside HF Llama and fla")
    decode.set_defaults(func=_bench_decode, passes_on=True)
    report = bench_sub.add_parser("report", add_help=False,  # its options and --help: linmem.bench.reference
                                  help="BENCHMARKS.md rendered from the result files of benchmarks/ (--check: in sync)")
    report.set_defaults(func=_bench_report, passes_on=True)

    demo = sub.add_parser("demo", parents=[common],
                          help="the built-in default job: MQAR study + a small hybrid on text (CPU)")
    demo.add_argument("--out", default="runs/demo", help="where runs, table and plots go")
    demo.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")
    demo.add_argument("--mom", action="store_true",
                      help="instead: MoM (4 Gated DeltaNet memories, top-2) vs one Gated DeltaNet memory on MQAR")
    demo.add_argument("--device", default="auto", help="device of the --mom study (auto, cpu, cuda)")
    demo.add_argument("--width", type=int, default=64, help="model width of the --mom study")
    demo.set_defaults(func=_demo)
    return parser


#: linmem.train's errors that the command line reports, and the modules that define them.
_TRAIN_ERRORS = {"CheckpointError": "linmem.train.checkpoint", "RunError": "linmem.train.rundir",
                 "Interrupted": "linmem.train.trainer"}


def _train_error(err: BaseException, *names: str) -> bool:
    """Whether ``err`` is one of linmem.train's errors ``names`` (only a subcommand that imported
    their module can raise them, so nothing is imported here)."""
    modules = [sys.modules.get(_TRAIN_ERRORS[name]) for name in names]
    return isinstance(err, tuple(getattr(module, name) for module, name in zip(modules, names) if module))


def _is_usage_error(err: BaseException) -> bool:
    """Errors in what the user asked for (printed as one line), as opposed to faults of linmem."""
    path_errors = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
    return isinstance(err, (ValueError, ImportError, *path_errors)) or _train_error(
        err, "CheckpointError", "RunError")


def main(argv: Optional[Sequence[str]] = None) -> int:
    # OpenMP threads that sleep between parallel regions: spinning ones collapse CPU training on a shared
    # machine (read once, when a subcommand first imports torch)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args, passed_on = parser.parse_known_args(argv)
    if passed_on and not getattr(args, "passes_on", False):
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    args.passed_on = passed_on
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nlinmem: interrupted; nothing was saved since the last checkpoint", file=sys.stderr)
        return 130
    except Exception as err:
        if _train_error(err, "Interrupted"):  # a checkpoint was saved
            print(f"linmem: {err}", file=sys.stderr)
            return err.exit_code
        if not _is_usage_error(err):
            raise
        if args.verbose:
            traceback.print_exc()
        message = " ".join(str(err).split())
        hint = "" if args.verbose else " (-v for the traceback)"
        print(f"linmem: error: {message}{hint}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
