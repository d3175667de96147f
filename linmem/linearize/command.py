"""``linmem linearize``: convert a local checkpoint into a Liger model, and optionally fine-tune it with LoRA.

    linmem linearize --from checkpoints/llama --out checkpoints/liger --memory gla --window 64
    linmem linearize --from checkpoints/llama --out checkpoints/liger-h --keep-attention 4 \\
        --lora-rank 8 --data alpaca_data.json --steps 500

With ``--lora-rank`` the command writes ``OUT/finetune.yaml``, a ``linmem train`` config that tunes the
converted model with LoRA on prompt-masked instruction data (run directory ``OUT/finetune``: the
adapter in ``adapter/``, the merged model in ``model/``); with ``--data`` it also runs it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from ..layers.liger import LIGER_FEATURE_MAPS, LIGER_GATES, LIGER_MEMORIES
from ..train.config import TrainConfig
from ..train.trainer import Trainer
from .convert import LinearizeOptions, linearize

#: the fine-tuning config linearize writes beside the converted model
FINETUNE_CONFIG = "finetune.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True,
                        help="a local Llama / Mistral / Qwen2 / Qwen3 checkpoint folder (config.json + weights)")
    parser.add_argument("--out", required=True, help="the folder to write (new or empty)")
    parser.add_argument("--memory", default="gla", choices=LIGER_MEMORIES, help="the gated recurrence of Liger Attention")
    parser.add_argument("--window", type=int, default=64, help="keys the sliding-window branch sees")
    parser.add_argument("--keep-attention", type=int, default=0, metavar="EVERY_N",
                        help="keep every N-th layer as full attention (Liger-H); 0: convert every layer")
    parser.add_argument("--memory-weight", type=float, default=0.5,
                        help="weight of the recurrent read-out; the window's is 1 - it (1: no window)")
    parser.add_argument("--gate", default="pooled_key", choices=LIGER_GATES,
                        help="pooled_key (Liger), or projection: a new random gate map (ablation)")
    parser.add_argument("--feature-map", default="softmax", choices=LIGER_FEATURE_MAPS,
                        help="softmax over the head dim (Liger), or learnable (ablation)")
    parser.add_argument("--slots", type=int, help="--memory gsa: slots per head (default the head dim)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation of the parameters an ablation adds")
    lora = parser.add_argument_group("LoRA fine-tuning (writes OUT/finetune.yaml)")
    lora.add_argument("--lora-rank", type=int, help="LoRA rank r; writes the fine-tuning config")
    lora.add_argument("--lora-alpha", type=float, default=16.0, help="the adapters' update is alpha / r * B A")
    lora.add_argument("--lora-targets", default="q_proj,k_proj,v_proj", help="modules given adapters (comma-separated)")
    lora.add_argument("--data", help="an Alpaca-style JSON/JSONL file: also run the fine-tuning now")
    lora.add_argument("--steps", type=int, default=1000, help="optimiser steps of the fine-tuning")
    lora.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the fine-tuning")
    lora.add_argument("--tokens-per-batch", type=int, default=8192, help="tokens per packed micro-batch")


def finetune_config(out: Path, args: argparse.Namespace):
    """The ``linmem train`` config that LoRA-tunes the model in ``out`` (not validated: --data may be missing)."""
    config = TrainConfig()
    config.model.pretrained = str(out)
    config.lora.rank, config.lora.alpha = args.lora_rank, args.lora_alpha
    config.lora.targets = [t for t in args.lora_targets.split(",") if t]
    config.data.task = "instruct"
    config.data.tokens_per_batch = args.tokens_per_batch
    config.data.instruct.path = args.data
    config.data.instruct.tokenizer = str(out)
    config.optim.lr, config.optim.weight_decay = args.lr, 0.0
    config.schedule.steps, config.schedule.warmup_steps = args.steps, max(1, args.steps // 20)
    config.run.out_dir = str(out / "finetune")
    config.run.save_every = 0
    return config


def check_finetune_args(args: argparse.Namespace) -> None:
    """Refuse a fine-tuning option by its flag before the conversion runs (not when the config is trained)."""
    checks = (
        (args.lora_rank >= 1, f"--lora-rank must be >= 1, got {args.lora_rank}"),
        (args.lora_alpha > 0, f"--lora-alpha must be > 0, got {args.lora_alpha}"),
        (any(t for t in args.lora_targets.split(",")), f"--lora-targets must name a module, got {args.lora_targets!r}"),
        (args.steps >= 1, f"--steps must be >= 1, got {args.steps}"),
        (0 < args.lr < float("inf"), f"--lr must be a finite number > 0, got {args.lr}"),
        (args.tokens_per_batch >= 2, f"--tokens-per-batch must be >= 2, got {args.tokens_per_batch}"),
    )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def run_linearize_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    options = LinearizeOptions(memory=args.memory, window=args.window, keep_attention=args.keep_attention,
                               memory_weight=args.memory_weight, gate=args.gate, feature_map=args.feature_map,
                               slots=args.slots, seed=args.seed)
    if args.lora_rank is not None:
        check_finetune_args(args)
    if args.data is not None and args.lora_rank is None:
        raise ValueError("--data fine-tunes with LoRA: give --lora-rank too")
    if args.data is not None and not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data} not found")
    result = linearize(args.source, out, options)
    print(f"wrote {out}: {result.family} -> layer pattern {result.layer_pattern} (L: Liger Attention with "
          f"{args.memory}, N: full attention); {result.parameters:,} parameters, {result.pretrained_parameters:,} "
          f"pretrained" + (f", added by the ablation: {', '.join(result.new_parameters)}" if result.new_parameters else ""))
    if args.lora_rank is None:
        return 0
    config = finetune_config(out, args)
    (out / FINETUNE_CONFIG).write_text(config.to_yaml())
    if args.data is None:
        print(f"fine-tune with: linmem train --config {out / FINETUNE_CONFIG} data.instruct.path=YOUR_DATA.json")
        return 0
    trainer = Trainer(config.validate())
    print(f"fine-tuning: {trainer.task.describe()}", flush=True)
    outcome = trainer.train()
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in outcome.metrics.items()) or "none"
    print(f"done: {outcome.steps} steps; {metrics}; merged model in {config.run.out_dir}/model, adapter in "
          f"{config.run.out_dir}/adapter")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="linmem linearize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_linearize_command(parser.parse_args(argv))
