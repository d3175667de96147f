"""Liger on one GPU, at small scale, in under 10 minutes on an H100 (``--budget-s``, 470 s by default).

Record: run by ``dev/gpu/records/liger_experiment.sh`` (its header has the date, command and result).

1. a BPE tokenizer and a ~30M-parameter Llama (GQA, transformers' LlamaForCausalLM) trained on the
   Python standard library's sources for a fixed time;
2. its perplexity on held-out sources and NIAH (single needle) at a short length;
3. ``linmem.linearize`` into Liger-GLA (window 64, no new parameter): perplexity and NIAH again;
4. LoRA (rank 8 on q/k/v) through the trainer (``model.pretrained`` + ``lora``): perplexity and NIAH;
5. decode latency and memory versus context, the base model (transformers' dynamic cache) beside the
   converted one (recurrent state + a 64-slot window ring);
6. Liger Table 6's ablations at reduced steps: random gate projection, no SWA, no LoRA (full
   fine-tuning), learnable feature map; then Liger-H and other memories. Each of these runs only
   when the time it would take (the pace of the runs before it) is left in the budget.

Writes to ``--out`` (at most 8 files): liger_results.json, liger_results.md, liger_quality.png,
liger_decode.png. ``--smoke`` runs a tiny version on the CPU (a minute) to check the script.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from linmem.linearize import LinearizeOptions, linearize  # noqa: E402
from linmem.models import LinmemForCausalLM  # noqa: E402
from linmem.models.outputs import CACHE_NAME, output_cache  # noqa: E402


@dataclass
class Settings:
    vocab_size: int = 4096  # BPE vocabulary
    tokenizer_files: int = 400  # stdlib files the tokenizer is trained on
    seq_len: int = 1024  # training and evaluation length of the base model
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1408
    base_batch: int = 32  # sequences per step of the base model
    base_seconds: float = 120.0  # training time of the base model
    base_max_steps: int = 4000
    base_lr: float = 1.5e-3
    tokens_per_batch: int = 16384  # fine-tuning: tokens per packed step
    lora_steps: int = 250
    ablation_steps: int = 100
    lora_lr: float = 1e-3
    full_lr: float = 2e-4  # the "no LoRA" ablation: every parameter trains
    eval_windows: int = 96  # held-out windows of seq_len tokens for perplexity
    niah_lengths: tuple = (512,)
    niah_samples: int = 4
    niah_depths: int = 3
    decode_contexts: tuple = (1024, 4096, 16384)
    decode_batch: int = 4
    decode_steps: int = 32
    device: str = "cuda"


SMOKE = Settings(vocab_size=300, tokenizer_files=20, seq_len=128, hidden=64, layers=2, heads=4, kv_heads=2,
                 intermediate=128, base_batch=4, base_seconds=15.0, base_max_steps=30, tokens_per_batch=512,
                 lora_steps=4, ablation_steps=2, eval_windows=4, niah_lengths=(384,), niah_samples=1, niah_depths=1,
                 decode_contexts=(64, 128), decode_batch=2, decode_steps=3, device="cpu")


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.start, self.budget = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()


def log(clock: Clock, message: str) -> None:
    print(f"[{clock.elapsed():6.1f}s] {message}", flush=True)


def autocast(device: str):
    return torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")


# ---------------------------------------------------------------- data


def build_data(s: Settings, work: Path, clock: Clock):
    """Tokenizer, train/val token streams, the training documents on disk and their prepared folder."""
    from linmem.tokenizer import train_tokenizer
    from linmem.data.codec import load_tokenizer
    from linmem.data.config import TextSection
    from linmem.data.prepared import prepare_corpus
    from linmem.data.sources import stdlib_corpus

    tok_dir = train_tokenizer(work / "tokenizer", vocab_size=s.vocab_size, max_files=s.tokenizer_files,
                              show_progress=False)
    tokenizer = load_tokenizer(tok_dir)
    docs = stdlib_corpus(max_files=None if s.device == "cuda" else 60)
    order = np.random.default_rng(0).permutation(len(docs))
    held = max(2, len(docs) // 50)
    val_docs, train_docs = [docs[i] for i in order[:held]], [docs[i] for i in order[held:]]
    eos = tokenizer.eos_token_id

    def stream(texts):
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return np.concatenate([np.asarray(x + [eos], dtype=np.int64) for x in ids])

    train_stream, val_stream = stream(train_docs), stream(val_docs)
    folder = work / "train_docs"
    folder.mkdir()
    for i, text in enumerate(train_docs):
        (folder / f"doc{i:05d}.txt").write_text(text)
    prepare_corpus(TextSection(paths=[str(folder)], tokenizer=str(tok_dir), val_fraction=0.01), work / "prepared")
    log(clock, f"data: {len(train_docs)} training documents ({len(train_stream):,} tokens), {len(val_docs)} held out "
               f"({len(val_stream):,} tokens), vocab {len(tokenizer)}")
    return tok_dir, tokenizer, train_stream, val_stream


# ---------------------------------------------------------------- the base model


def train_base(s: Settings, train_stream: np.ndarray, tokenizer, clock: Clock):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=max(s.seq_len, max(s.decode_contexts)) * 2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(s.device)  # transformers' default attention: SDPA
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=s.base_lr, betas=(0.9, 0.95), fused=s.device == "cuda")
    rng = np.random.default_rng(1)
    starts_max = len(train_stream) - s.seq_len - 1

    def batch():
        starts = rng.integers(0, starts_max, s.base_batch)
        ids = np.stack([train_stream[a:a + s.seq_len] for a in starts])
        return torch.from_numpy(ids).to(s.device)

    warmup, planned, step, began = 50, s.base_max_steps, 0, time.perf_counter()
    model.train()
    while step < planned:
        frac = step / max(1, planned)
        lr = s.base_lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = batch()
        with autocast(s.device):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == 20:  # the pace of the first steps fixes the schedule's length to the time budget
            if s.device == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - began) / step
            planned = int(min(s.base_max_steps, max(40, s.base_seconds / per_step)))
            log(clock, f"base: {params / 1e6:.1f}M parameters, {per_step * 1000:.0f} ms/step -> {planned} steps")
        if step % 200 == 0:
            log(clock, f"base step {step}/{planned}: loss {loss.item():.3f}")
    log(clock, f"base trained: {step} steps, {step * s.base_batch * s.seq_len / 1e6:.1f}M tokens, "
               f"last loss {loss.item():.3f}")
    return model.eval(), {"parameters": params, "steps": step, "tokens": step * s.base_batch * s.seq_len}


# ---------------------------------------------------------------- evaluations


@torch.no_grad()
def perplexity(model, val_stream: np.ndarray, s: Settings) -> float:
    model.eval()
    windows = min(s.eval_windows, len(val_stream) // s.seq_len)
    total = 0.0
    for i in range(0, windows, 8):
        rows = [val_stream[j * s.seq_len:(j + 1) * s.seq_len] for j in range(i, min(windows, i + 8))]
        ids = torch.from_numpy(np.stack(rows)).to(s.device)
        with autocast(s.device):
            total += float(model(input_ids=ids, labels=ids, use_cache=False).loss) * len(rows)
    return math.exp(total / windows)


def niah(model, tokenizer, s: Settings) -> Optional[float]:
    from linmem.eval.niah import run_niah

    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    result = run_niah(model, encode, lambda ids: tokenizer.decode(list(ids)), tasks=["niah_single_1"],
                      lengths=list(s.niah_lengths), depths=s.niah_depths, samples=s.niah_samples,
                      max_new_tokens=16, eos_token_id=tokenizer.eos_token_id, progress=False, batch_size=4)
    return result.accuracy("niah_single_1")


def load(folder: Path, s: Settings) -> LinmemForCausalLM:
    return LinmemForCausalLM.from_pretrained(folder).to(s.device).eval()


def finetune(source: Path, run_dir: Path, s: Settings, steps: int, lora_rank: int, lr: float, clock: Clock,
             work: Path) -> tuple[Path, dict]:
    """``linmem train`` from the converted folder: LoRA (or every parameter when lora_rank is 0)."""
    from linmem.train import Trainer, load_config

    overrides = [f"model.pretrained={source}", "data.task=text", f"data.text.prepared={work / 'prepared'}",
                 f"data.tokens_per_batch={s.tokens_per_batch}", f"data.max_document_tokens={s.seq_len}",
                 f"optim.lr={lr}", "optim.weight_decay=0.0", f"schedule.steps={steps}",
                 f"schedule.warmup_steps={max(1, steps // 10)}", f"run.out_dir={run_dir}", "run.save_every=0",
                 "run.progress=false", "run.tensorboard=false", f"run.device={s.device}", f"lora.rank={lora_rank}",
                 "lora.alpha=16"]
    trainer = Trainer(load_config(overrides=overrides))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    began = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - began
    log(clock, f"fine-tuned {source.name}: {steps} steps, {trainable:,} trainable parameters, {seconds:.0f} s, "
               f"trainer's metrics {result.metrics}")
    return run_dir / "model", {"trainable": trainable, "seconds": seconds, "steps": steps,
                               "last_loss": result.losses.get(steps)}


# ---------------------------------------------------------------- decoding


@torch.no_grad()
def decode_cost(model, s: Settings, context: int) -> dict:
    """ms per generated token (batch ``decode_batch``) after a prefill of ``context`` tokens; the cache's bytes,
    the memory allocated after the prefill (less before; the prefill keeps only the last logits) and the peak."""
    cuda = s.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids = torch.randint(3, model.config.vocab_size, (s.decode_batch, context), device=s.device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    with autocast(s.device):
        sync()
        t = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync()
        prefill = time.perf_counter() - t
        cache = output_cache(out)
        held = (torch.cuda.memory_allocated() - before) if cuda else 0
        size = cache_bytes(cache)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for step in range(s.decode_steps + 3):
            sync()
            t = time.perf_counter()
            out = model(input_ids=token, use_cache=True, **{CACHE_NAME: cache})
            cache = output_cache(out)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            if step >= 3:
                times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() - before) if cuda else 0
    del cache, out
    return {"context": context, "ms_per_token": 1000 * float(np.median(times)), "prefill_s": prefill,
            "cache_mib": size / 2 ** 20, "held_mib": held / 2 ** 20, "peak_mib": peak / 2 ** 20}


def cache_bytes(cache) -> int:
    """Bytes of the tensors a decoding cache holds (linmem's LinmemCache, or transformers' layered caches)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    tensors = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ---------------------------------------------------------------- report


def write_report(out: Path, results: dict) -> None:
    (out / "liger_results.json").write_text(json.dumps(results, indent=2) + "\n")
    base_ppl = results["quality"][0]["ppl"]
    lines = ["# Liger at small scale (one GPU)", "",
             f"Base: {results['base']['parameters'] / 1e6:.1f}M-parameter Llama (GQA {results['settings']['heads']}/"
             f"{results['settings']['kv_heads']}), {results['base']['tokens'] / 1e6:.0f}M training tokens of the "
             f"Python standard library; perplexity on held-out sources at {results['settings']['seq_len']} tokens.",
             "", "| model | fine-tuning | ppl | base ppl / ppl | NIAH single-1 |", "|---|---|---|---|---|"]
    for row in results["quality"]:
        niah_cell = "-" if row.get("niah") is None else f"{row['niah']:.2f}"
        lines.append(f"| {row['name']} | {row['finetune']} | {row['ppl']:.2f} | {base_ppl / row['ppl']:.3f} | "
                     f"{niah_cell} |")
    lines += ["", "Ablations (Liger Table 6), each fine-tuned for "
              f"{results['settings']['ablation_steps']} steps of {results['settings']['tokens_per_batch']} tokens:", "",
              "| variant | ppl after conversion | ppl after fine-tuning | base ppl / ppl |", "|---|---|---|---|"]
    for row in results["ablations"]:
        lines.append(f"| {row['name']} | {row['ppl_converted']:.2f} | {row['ppl']:.2f} | {base_ppl / row['ppl']:.3f} |")
    lines += ["", f"Decoding, batch {results['settings']['decode_batch']} (median ms per token, cache memory):", "",
              "| model | context | ms/token | prefill s | cache MiB | allocated after prefill MiB | peak MiB |",
              "|---|---|---|---|---|---|---|"]
    for row in results["decode"]:
        lines.append(f"| {row['model']} | {row['context']} | {row['ms_per_token']:.2f} | {row['prefill_s']:.3f} | "
                     f"{row['cache_mib']:.1f} | {row['held_mib']:.1f} | {row['peak_mib']:.1f} |")
    lines += ["", f"Device: {results['device']}; {results['seconds']:.0f} s so far."]
    (out / "liger_results.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["quality"] + [{"name": r["name"], "ppl": r["ppl"]} for r in results["ablations"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh([r["name"] for r in rows][::-1], [r["ppl"] for r in rows][::-1], color="tab:blue")
    ax.axvline(results["quality"][0]["ppl"], color="k", ls="--", lw=1, label="base")
    ax.set_xlabel("held-out perplexity (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "liger_quality.png", dpi=120)
    if results["decode"]:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for name in dict.fromkeys(r["model"] for r in results["decode"]):
            mine = [r for r in results["decode"] if r["model"] == name]
            axes[0].plot([r["context"] for r in mine], [r["ms_per_token"] for r in mine], "o-", label=name)
            axes[1].plot([r["context"] for r in mine], [r["cache_mib"] for r in mine], "o-", label=name)
        for ax, label in zip(axes, ("ms per generated token", "cache memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(label)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "liger_decode.png", dpi=120)


# ---------------------------------------------------------------- the experiment


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/liger-work", help="scratch folder (emptied first)")
    parser.add_argument("--budget-s", type=float, default=470.0,
                        help="seconds for the whole run: NIAH, ablations and decoding are skipped when they would "
                             "pass it (the base model, its conversion and the LoRA run always run)")
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run that checks the script")
    args = parser.parse_args()
    s = SMOKE if args.smoke else Settings()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    clock = Clock(args.budget_s)
    device_name = torch.cuda.get_device_name() if s.device == "cuda" else "cpu"
    log(clock, f"device {device_name}, torch {torch.__version__}")
    tok_dir, tokenizer, train_stream, val_stream = build_data(s, work, clock)
    base, base_info = train_base(s, train_stream, tokenizer, clock)
    base.save_pretrained(work / "base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, work / "base" / name)
    results = {"settings": asdict(s), "base": base_info, "device": device_name, "quality": [], "ablations": [],
               "decode": []}

    def quality(name: str, finetune_note: str, model, niah_model=None) -> dict:
        row = {"name": name, "finetune": finetune_note, "ppl": perplexity(model, val_stream, s)}
        row["niah"] = niah(niah_model or model, tokenizer, s) if clock.left() > 60 or args.smoke else None
        results["quality"].append(row)
        log(clock, f"{name} ({finetune_note}): ppl {row['ppl']:.3f}, NIAH {row['niah']}")
        return row

    # NIAH generates with linmem's loop: the base model in linmem's form (every layer llama_attention, the same logits)
    linearize(work / "base", work / "base-linmem", LinearizeOptions(keep_attention=1))
    quality("Llama (base)", "-", base, niah_model=load(work / "base-linmem", s))
    liger_dir = work / "liger-gla"
    linearize(work / "base", liger_dir, LinearizeOptions(memory="gla", window=64))
    quality("Liger-GLA", "none", load(liger_dir, s))
    merged, info = finetune(liger_dir, work / "runs" / "lora", s, s.lora_steps, 8, s.lora_lr, clock, work)
    tuned = load(merged, s)
    row = quality("Liger-GLA", f"LoRA r8, {s.lora_steps} steps", tuned)
    row.update(info)

    def save() -> None:
        results["seconds"] = clock.elapsed()
        write_report(out, results)

    save()

    # a conversion fine-tuned for ablation_steps: the LoRA run's pace, plus conversion and evaluations
    cost = {"ablation": 20.0 + info["seconds"] * s.ablation_steps / s.lora_steps}

    def ablation(i: int, name: str, options: LinearizeOptions, rank: int, lr: float) -> None:
        if clock.left() < cost["ablation"] and not args.smoke:
            log(clock, f"skipping {name}: {clock.left():.0f} s left, about {cost['ablation']:.0f} s needed")
            return
        began = clock.elapsed()
        folder = work / f"ablation{i}"
        linearize(work / "base", folder, options)
        converted = perplexity(load(folder, s), val_stream, s)
        merged, info = finetune(folder, work / "runs" / f"ablation{i}", s, s.ablation_steps, rank, lr, clock, work)
        results["ablations"].append({"name": name, "options": asdict(options), "lora_rank": rank, "lr": lr,
                                     "ppl_converted": converted, "ppl": perplexity(load(merged, s), val_stream, s),
                                     **info})
        log(clock, f"ablation {name}: ppl {converted:.2f} -> {results['ablations'][-1]['ppl']:.2f}")
        cost["ablation"] = max(cost["ablation"], clock.elapsed() - began)
        save()

    for name, model in (("Llama (base), dynamic KV cache", base), ("Liger-GLA (state + 64-slot ring)", tuned)):
        for context in s.decode_contexts:
            if clock.left() < 15 and not args.smoke:
                log(clock, f"skipping decode {name} at {context}: {clock.left():.0f} s left")
                continue
            try:
                cell = {"model": name, **decode_cost(model, s, context)}
            except torch.cuda.OutOfMemoryError:
                cell = {"model": name, "context": context, **dict.fromkeys(
                    ("ms_per_token", "prefill_s", "cache_mib", "held_mib", "peak_mib"), float("nan"))}
            results["decode"].append(cell)
            log(clock, f"decode {name} @ {context}: {cell['ms_per_token']:.2f} ms/token, cache {cell['cache_mib']:.1f} MiB")
    save()
    plot(out, results)

    table6 = [  # Liger Table 6, at reduced steps
        ("Liger-GLA", LinearizeOptions(), 8, s.lora_lr),
        ("random gate projection", LinearizeOptions(gate="projection"), 8, s.lora_lr),
        ("no SWA", LinearizeOptions(memory_weight=1.0), 8, s.lora_lr),
        ("no LoRA (full fine-tuning)", LinearizeOptions(), 0, s.full_lr),
        ("learnable feature map", LinearizeOptions(feature_map="learnable"), 8, s.lora_lr),
    ]
    for i, spec in enumerate(table6):
        ablation(i, *spec)

    extras = [  # while time remains: the hybrid and other memories
        ("Liger-H (1 attention layer in 4)", LinearizeOptions(keep_attention=4), 8, s.lora_lr),
        ("Liger-GSA", LinearizeOptions(memory="gsa"), 8, s.lora_lr),
        ("Liger-Mamba2", LinearizeOptions(memory="mamba2"), 8, s.lora_lr),
        ("Liger-HGRN2", LinearizeOptions(memory="hgrn2"), 8, s.lora_lr),
    ]
    for i, spec in enumerate(extras, start=len(table6)):
        ablation(i, *spec)
    save()
    plot(out, results)
    print((out / "liger_results.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
