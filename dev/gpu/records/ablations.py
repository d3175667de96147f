"""The seed papers' ablations at small scale: config variants x seeds, trained, evaluated, tabulated, plotted.

Record: run by ``dev/gpu/records/ablations.sh`` on a GPU (its header has the date, command and result); the CPU
size's results are in docs/evaluation.md ("Ablations at small scale").

    OUT=out bash dev/gpu/records/ablations.sh                        # GPU size, and the mixers' throughput sweep
    python dev/gpu/records/ablations.py --out out --size cpu         # CPU size, two runs at a time, one thread each
    python dev/gpu/records/ablations.py --out out --smoke            # the whole pipeline, tiny settings (CPU)

The sets (``--ablations``, default all three):

* ``fox-gate``: FoX's forget gate (FoX, Fig. 7): data-dependent (the default), data-independent (a learnt
  per-head bias), fixed (the per-head decays FoX's constants start at), none (= a Transformer without RoPE);
* ``fox-rope``: FoX Table 3's rows: FoX, FoX + RoPE, Transformer (RoPE), Transformer without RoPE;
* ``mom``: MoM Table 6: 2, 4 and 8 memories (top-2, with the shared memory) and 4 without the shared memory,
  all of the same width.

Every variant is a recipe ``linmem/recipes/claims-<name>.yaml`` plus ``section.key=value`` overrides (the sizes
below add theirs); a variant in two sets (``fox``, ``transformer-norope``) is trained once per seed. Seeds set
``run.seed`` (the model's initialisation and every RNG but the data's): ``data.seed`` stays the recipe's, so every
run sees the same batches and is scored on the same held-out documents. Measured per run: the held-out loss at the
end of training (the trainer's evaluation of the validation documents) and, by ``linmem eval --suite
position-loss``, the loss by position in windows of 1, 2 and 4 times the training length (the FoX paper's Fig. 2
measurement): its last bin at the training length (the end of the context) and past the training length.

Writes into ``--out``: ``runs/<variant>/seed<s>/`` (weights, metrics, eval/), per set ``ablation_<set>.md`` and
``.csv`` (mean ± sample std [min, max] over seeds, :class:`linmem.eval.seeds.Spread`), ``ablation_<set>.json``
(every seed's value, mean, sample std, min and max, the paper's direction and the verdicts) and
``ablation_<set>.png``, ``ablations.md`` (everything) and ``logs/``. A comparison goes "beyond the seed spread"
only when the seeds' ranges (min-max) of the two variants do not overlap. Runs that finished are reused when the
script runs again; ``timeout -s INT`` stops it with a report of what finished. ``--throughput FILE`` instead
renders the JSON lines of ``linmem bench layers --parts mixers`` (the Linear-MoE Table 3 sweep, GPU only) as
``throughput.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from claims import (  # noqa: E402
    RECIPES,
    ensure_tokenizer,
    eval_args,
    linmem_command,
    run_pipelines,
    run_summary,
    stage_rows,
    train_args,
)

from linmem.eval.plots import plt  # noqa: E402
from linmem.eval.seeds import Spread  # noqa: E402
from linmem.eval.tables import write_table  # noqa: E402


@dataclass(frozen=True)
class Variant:
    recipe: str  # claims-<recipe>.yaml
    label: str  # the row's name in the paper
    overrides: tuple[str, ...] = ()  # section.key=value on top of the recipe


VARIANTS = {
    "fox": Variant("fox", "FoX (data-dependent gate, no RoPE)"),
    "fox-data-independent": Variant("fox", "FoX, data-independent gate (learnt per head)",
                                    ("model.options.mixer.forget_gate=data_independent",)),
    "fox-fixed": Variant("fox", "FoX, fixed gate per head", ("model.options.mixer.forget_gate=fixed",)),
    "transformer-norope": Variant("transformer", "no gate: Transformer without RoPE",
                                  ("model.options.mixer.rope=false",)),
    "fox-rope": Variant("fox", "FoX + RoPE", ("model.options.mixer.rope=true",)),
    "transformer": Variant("transformer", "Transformer (RoPE)"),
    "mom-2": Variant("mom", "2 memories, top-2, shared", ("model.options.mom.num_memories=2",)),
    "mom-4": Variant("mom", "4 memories, top-2, shared", ("model.options.mom.num_memories=4",)),
    "mom-8": Variant("mom", "8 memories, top-2, shared", ("model.options.mom.num_memories=8",)),
    "mom-4-noshared": Variant("mom", "4 memories, top-2, no shared memory",
                              ("model.options.mom.num_memories=4", "model.options.mom.shared_memory=false")),
}


@dataclass(frozen=True)
class Expectation:
    better: str  # the variant the paper finds better (lower held-out loss)
    worse: str
    claim: str  # the paper's statement, in words
    kind: str = "lower"  # lower: `better` below `worse`; level: at most level with it; none: no paper direction


@dataclass(frozen=True)
class Ablation:
    title: str  # the question, and where the paper asks it
    paper: str  # what the paper finds, in words
    variants: tuple[str, ...]  # names in VARIANTS
    expectations: tuple[Expectation, ...]


ABLATIONS = {
    "fox-gate": Ablation(
        "FoX's forget gate: data-dependent, data-independent, fixed, none (FoX Fig. 7)",
        "the data-dependent forget gate gives the lowest loss",
        ("fox", "fox-data-independent", "fox-fixed", "transformer-norope"),
        (Expectation("fox", "fox-data-independent", "the data-dependent gate beats the data-independent one"),
         Expectation("fox", "fox-fixed", "the data-dependent gate beats the fixed one"),
         Expectation("fox", "transformer-norope", "the data-dependent gate beats no gate"))),
    "fox-rope": Ablation(
        "FoX and the Transformer with and without RoPE (FoX Table 3)",
        "FoX without RoPE is competitive with the Transformer with RoPE; the Transformer needs its RoPE",
        ("fox", "fox-rope", "transformer", "transformer-norope"),
        (Expectation("fox", "transformer", "FoX without RoPE is competitive with the Transformer with RoPE",
                     kind="level"),
         Expectation("transformer", "transformer-norope", "the Transformer is better with RoPE than without"),
         Expectation("fox-rope", "fox", "RoPE added to FoX (no direction stated here)", kind="none"))),
    "mom": Ablation(
        "MoM: the number of memories and the shared memory, same width (MoM Table 6)",
        "more memories help up to a point; the shared memory helps",
        ("mom-2", "mom-4", "mom-8", "mom-4-noshared"),
        (Expectation("mom-4", "mom-2", "4 memories beat 2"),
         Expectation("mom-8", "mom-4", "8 memories against 4 (where the gain stops is not stated here)", kind="none"),
         Expectation("mom-4", "mom-4-noshared", "the shared memory helps (4 memories with it beat 4 without)"))),
}


@dataclass(frozen=True)
class Size:
    description: str
    overrides: tuple[str, ...]  # on top of every recipe
    layers: Optional[int]  # the recipe's layer letter this many times; None: the recipe's pattern
    vocab: int  # BPE vocabulary
    tokenizer_files: Optional[int]  # stdlib files the BPE is trained on (None: all)
    lengths: tuple[int, ...]  # position-loss windows: the training length, then longer ones
    max_windows: int  # position-loss windows per length
    bins: int  # position-loss bins per length
    batch_size: int  # position-loss windows per forward pass
    threads: Optional[int]  # OMP threads of each run (None: the machine's cores shared among the runs)


SIZES = {
    # the claims recipes' models and batches; 200 of their 300 steps, so that 30 runs fit one GPU call
    "gpu": Size("the claims recipes (width 384, 8 layers, 6 heads, BPE 8192, documents of 512 tokens, 16384 tokens "
                "a step), 200 steps", ("schedule.steps=200", "schedule.warmup_steps=20"), None, 8192, None,
                (512, 1024, 2048), 48, 16, 16, None),
    "cpu": Size("width 128, 2 layers, 2 heads of 64, BPE 1024 on 120 stdlib files (6 held out), documents of 256 "
                "tokens, 1024 tokens a step (2 x 512), 150 steps, fp32, one thread a run",
                ("model.hidden_size=128", "model.num_heads=2", "data.tokens_per_batch=512", "schedule.grad_accum=2",
                 "data.max_document_tokens=256", "data.text.max_files=120", "data.text.val_fraction=0.05",
                 "schedule.steps=150",
                 "schedule.warmup_steps=15", "run.device=cpu", "run.log_every=10"), 2, 1024, 120,
                (256, 512), 16, 8, 4, 1),
    "smoke": Size("width 32, 1 layer, BPE 512, 3 steps of 256 tokens (checks the pipeline only)",
                  ("model.hidden_size=32", "model.num_heads=2", "data.tokens_per_batch=256", "schedule.grad_accum=1",
                   "data.max_document_tokens=64", "data.text.max_files=30", "schedule.steps=3",
                   "schedule.warmup_steps=1", "run.device=cpu", "run.log_every=1"), 1, 512, 30,
                  (64, 128), 2, 4, 2, 1),
}
#: variants are started heaviest first (MoM's routing is the slowest step), so the slow ones do not finish last
COST = {"mom": 3, "fox": 2, "transformer": 1}


def log(message: str) -> None:
    print(f"[ablations {time.strftime('%H:%M:%S')}] {message}", flush=True)


def recipe_pattern(recipe: str, layers: Optional[int]) -> list[str]:
    """The ``model.layer_pattern`` override of a size with ``layers`` layers (none for the recipe's own depth)."""
    if layers is None:
        return []
    pattern = yaml.safe_load((RECIPES / f"claims-{recipe}.yaml").read_text())["model"]["layer_pattern"]
    if len(set(pattern)) != 1:
        raise ValueError(f"claims-{recipe}: layer_pattern {pattern!r} mixes layer kinds; a size with `layers` "
                         f"repeats one letter")
    return [f"model.layer_pattern={pattern[0] * layers}"]


def run_dir(out: Path, variant: str, seed: int) -> Path:
    return out / "runs" / variant / f"seed{seed}"


def evaluated(run: Path) -> bool:
    return (run / "eval" / "summary.json").exists() and (run / "eval" / "position_loss.json").exists()


def pipelines(variants: Sequence[str], seeds: Sequence[int], out: Path, tokenizer: Path, size: Size,
              steps: Optional[int]) -> dict[str, list[tuple[str, list[str]]]]:
    """Per (variant, seed) one stage, one process: train (unless trained) then evaluate (unless evaluated);
    heaviest variants first."""
    order = sorted(variants, key=lambda v: -COST[VARIANTS[v].recipe])
    lengths = ",".join(str(n) for n in size.lengths)
    options = ["--bins", str(size.bins), "--max-windows", str(size.max_windows), "--batch-size", str(size.batch_size)]
    jobs = {}
    for name in order:
        variant = VARIANTS[name]
        overrides = [*size.overrides, *recipe_pattern(variant.recipe, size.layers), *variant.overrides]
        if steps is not None:  # and a tenth of them to warm up, as every size does
            overrides += [f"schedule.steps={steps}", f"schedule.warmup_steps={max(1, steps // 10)}"]
        for seed in seeds:
            run = run_dir(out, name, seed)
            commands = []
            if not (run / "model" / "config.json").exists():
                commands.append(train_args(variant.recipe, run, tokenizer, [*overrides, f"run.seed={seed}"]))
            if not evaluated(run):
                commands.append(eval_args(run, "position-loss", lengths, options))
            jobs[f"{name}-s{seed}"] = [(f"{name}-s{seed}", linmem_command(*commands))] if commands else []
    return jobs


def run_metrics(run: Path) -> dict:
    """One run's measurements: parameters, held-out loss, loss at the end of the context, loss past it."""
    summary = run_summary(run)
    curves = {c.length: c for c in summary["curves"]}
    train_length, longest = summary["train_length"], max(curves)
    at_train = curves.get(train_length, curves[min(curves)])
    return {"params_m": summary["params_m"], "val_loss": summary["final_val_loss"],
            "end_loss": at_train.loss[-1], "end_length": at_train.length,
            "past_loss": summary["metrics"].get(f"position-loss:loss_past_train/L{longest}", float("nan")),
            "past_length": longest, "train_length": train_length, "curves": summary["curves"],
            "tok_s": summary["tok_s"], "tokens": summary["tokens"]}


def spread(values: Sequence[float]) -> dict:
    """:class:`~linmem.eval.seeds.Spread`'s mean, sample standard deviation (n - 1; 0 for one value), min, max and
    n, and the values themselves.

    Example:
        >>> spread([1.0, 2.0, 3.0])["std"]
        1.0
    """
    values = [float(v) for v in values]
    return {**asdict(Spread.of(values)), "values": values}


METRICS = ("val_loss", "end_loss", "past_loss")


def aggregate(results: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """Per variant: the mean and spread over its seeds of every metric in :data:`METRICS`."""
    table = {}
    for name, seeds in results.items():
        runs = list(seeds.values())
        table[name] = {"label": VARIANTS[name].label, "recipe": VARIANTS[name].recipe,
                       "overrides": list(VARIANTS[name].overrides), "params_m": runs[0]["params_m"],
                       "seeds": {seed: {m: r[m] for m in METRICS} for seed, r in seeds.items()},
                       **{m: spread([r[m] for r in runs]) for m in METRICS}}
    return table


def _cell(stats: dict) -> str:
    """``mean ± std [min, max]`` of a :func:`spread`; the mean alone for one seed."""
    if stats["n"] < 2:
        return f"{stats['mean']:.4f}"
    return Spread(**{k: stats[k] for k in ("mean", "std", "min", "max", "n")}).text(digits=4)


def verdict(table: dict[str, dict], expectation: Expectation) -> str:
    """Whether the measured held-out losses go the paper's way, whether the seeds' spread allows a conclusion, and at
    how many seeds the one is lower than the other (the same seed: the same batches, and the same initial weights
    where the two models create the same parameters)."""
    if expectation.better not in table or expectation.worse not in table:
        return f"- {expectation.claim}: not measured"
    a, b = table[expectation.better]["val_loss"], table[expectation.worse]["val_loss"]
    first, second = table[expectation.better]["seeds"], table[expectation.worse]["seeds"]
    paired = [seed for seed in first if seed in second]
    lower = sum(first[seed]["val_loss"] < second[seed]["val_loss"] for seed in paired)
    measured = (f"{a['mean']:.4f} ± {a['std']:.4f} vs {b['mean']:.4f} ± {b['std']:.4f} ({expectation.better} lower "
                f"at {lower} of {len(paired)} seeds)")
    measured_spread = min(a["n"], b["n"]) >= 2
    separated = measured_spread and (a["max"] < b["min"] or b["max"] < a["min"])
    if not measured_spread:
        spread_words = "one seed, so the seed-to-seed spread is not measured"
    elif separated:
        spread_words = "beyond the seed spread (the seeds' ranges do not overlap)"
    else:
        spread_words = "within the seed spread (the seeds' ranges overlap): no conclusion"
    if expectation.kind == "none":
        lower = expectation.better if a["mean"] < b["mean"] else expectation.worse
        return f"- {expectation.claim}: {measured}: {lower} lower, {spread_words}"
    # level: level within the spread counts as the paper's way; a difference only when the spread is measured
    level = expectation.kind == "level" and measured_spread and not separated
    way = "the paper's way" if a["mean"] < b["mean"] or level else "the other way"
    return f"- {expectation.claim}: {measured}: goes {way}, {spread_words}"


def markdown_rows(table: dict[str, dict], end: int, past: int) -> list[dict]:
    """One row per variant: each metric's mean ± sample std [min, max]; ``end``, ``past``: their window lengths."""
    return [{"variant": name, "paper's row": row["label"], "params": f"{row['params_m']:.2f}M",
             "seeds": row["val_loss"]["n"], "held-out loss": _cell(row["val_loss"]),
             f"loss at the end of L={end}": _cell(row["end_loss"]),
             f"loss past the training length, L={past}": _cell(row["past_loss"])} for name, row in table.items()]


def plot_ablation(title: str, table: dict[str, dict], results: dict[str, dict[int, dict]], out: Path) -> Path:
    """Left: every seed's held-out loss per variant, the mean with the sample std; right: the loss by position at
    the longest window, averaged over seeds, a dashed line at the training length."""
    fig, (points, positions) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(table)
    for i, name in enumerate(names):
        stats = table[name]["val_loss"]
        points.scatter([i] * stats["n"], stats["values"], color="gray", s=14, zorder=2)
        points.errorbar([i], [stats["mean"]], yerr=[stats["std"]], fmt="o", color="C0", capsize=5, zorder=3)
    points.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    points.set(ylabel="held-out loss", title="held-out loss: seeds (gray), mean ± sample std")
    points.grid(alpha=0.3)
    train_length = None
    for name in names:
        runs = list(results[name].values())
        curves = [max(r["curves"], key=lambda c: c.length) for r in runs]
        train_length = runs[0]["train_length"]
        centers = [(s + e) / 2 for s, e in zip(curves[0].bin_starts, curves[0].bin_ends)]
        mean = [statistics.fmean(values) for values in zip(*(c.loss for c in curves))]
        positions.plot(centers, mean, marker="o", markersize=3, label=name)
    if train_length is not None:
        positions.axvline(train_length, color="gray", linestyle="--", linewidth=1)
    positions.set(xlabel="position (tokens)", ylabel="held-out loss", title="loss by position, mean over seeds")
    positions.legend(fontsize=8)
    positions.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def report_ablation(key: str, results: dict[str, dict[int, dict]], out: Path, context: dict) -> list[str]:
    """Table (Markdown, CSV, JSON), verdicts and plot of one set; returns its section of the report."""
    ablation = ABLATIONS[key]
    lines = [f"## {key}: {ablation.title}", "", f"The paper: {ablation.paper}.", ""]
    mine = {name: results[name] for name in ablation.variants if results.get(name)}
    if not mine:
        return lines + ["no run finished", ""]
    table = aggregate(mine)
    first = next(iter(next(iter(mine.values())).values()))
    lengths = {"end_length": first["end_length"], "past_length": first["past_length"]}
    verdicts = [verdict(table, e) for e in ablation.expectations]
    _, md = write_table(markdown_rows(table, *lengths.values()), out / f"ablation_{key}")
    plot = plot_ablation(ablation.title, table, mine, out / f"ablation_{key}.png")
    (out / f"ablation_{key}.json").write_text(json.dumps(
        {"ablation": key, "title": ablation.title, "paper": ablation.paper, **context, **lengths,
         "spread": "std: sample standard deviation over seeds (n - 1); min, max: the seeds' range",
         "variants": table, "verdicts": verdicts}, indent=2) + "\n")
    return lines + [md.read_text(), "Cells: mean ± sample std [min, max] over seeds.", "", *verdicts, "",
                    f"![{key}]({plot.name})", ""]


def throughput_rows(path: Path) -> list[dict]:
    """The mixer rows of ``linmem bench layers --parts mixers`` (its JSON lines, among other output) as a table:
    one row per mixer, thousand tokens/s and peak GB at each sequence length."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    rows = [r for r in rows if r.get("part") == "mixers"]
    if not rows:
        raise ValueError(f"{path}: no JSON rows of part 'mixers' (the output of linmem bench layers --parts mixers)")
    lengths = sorted({r["T"] for r in rows})
    table = {}
    for r in rows:
        row = table.setdefault(r["name"], {"mixer": r["name"]})
        row[f"T={r['T']} ktok/s"] = f"{r['ktok_s']:.1f}" if "ktok_s" in r else r.get("error", "")[:30]
        row[f"T={r['T']} GB"] = f"{r['peak_GB']:.1f}" if "peak_GB" in r else ""
    keys = ["mixer"] + [f"T={t} {unit}" for t in lengths for unit in ("ktok/s", "GB")]
    return [{k: row.get(k, "") for k in keys} for row in table.values()]


def device_name(size: str) -> str:
    """The GPU's name for the GPU size (where CUDA is there), else the CPU's core count."""
    import torch

    if size == "gpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores)"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/ablations-out"), help="where everything goes")
    parser.add_argument("--ablations", default=",".join(ABLATIONS), help=f"sets: {', '.join(ABLATIONS)}")
    parser.add_argument("--variants", default=None, help="only these variants of the sets (comma-separated)")
    parser.add_argument("--seeds", default="0,1,2", help="run.seed values, comma-separated")
    parser.add_argument("--size", choices=sorted(SIZES), default="gpu", help="model and data size (default: gpu)")
    parser.add_argument("--smoke", action="store_true", help="the same as --size smoke")
    parser.add_argument("--steps", type=int, default=None, help="training steps, a tenth of them warm-up (default: "
                                                                "the size's)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (per GPU with --gpus; default: 2 on "
                                                                  "the CPU sizes, 8 on the GPU)")
    parser.add_argument("--gpus", default="", help="CUDA device ids to spread the runs over, e.g. 0,1,2")
    parser.add_argument("--throughput", default=None, help="render this output of linmem bench layers --parts "
                                                           "mixers as throughput.md in --out, and train nothing")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.throughput is not None:
        _, md = write_table(throughput_rows(Path(args.throughput)), out / "throughput")
        print(md.read_text())
        return 0
    size_name = "smoke" if args.smoke else args.size
    size = SIZES[size_name]
    keys = [k.strip() for k in args.ablations.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ABLATIONS]
    if unknown:
        parser.error(f"--ablations: unknown sets {unknown}; valid: {', '.join(ABLATIONS)}")
    variants = list(dict.fromkeys(v for k in keys for v in ABLATIONS[k].variants))
    if args.variants is not None:
        chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in variants]
        if unknown:
            parser.error(f"--variants: {unknown} are not in the sets {keys}; valid: {', '.join(variants)}")
        variants = [v for v in variants if v in chosen]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    devices = [d.strip() for d in args.gpus.split(",") if d.strip()]
    width = (args.jobs or (8 if size_name == "gpu" else 2)) * max(1, len(devices))
    threads = size.threads or max(1, (os.cpu_count() or 1) // width)
    started = time.perf_counter()
    log(f"size {size_name} ({size.description}); sets {keys}; variants {variants}; seeds {seeds}; {width} runs at "
        f"once, {threads} thread(s) each; output in {out}")

    tokenizer = ensure_tokenizer(out, size.vocab, size.tokenizer_files)
    jobs = pipelines(variants, seeds, out, tokenizer, size, args.steps)
    reused = [name for name, stages in jobs.items() if not stages]
    if reused:
        log(f"reusing the finished runs {reused} (delete runs/<variant>/seed<s> to run one again)")
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    stages = run_pipelines(jobs, out / "logs", width, env, devices)
    for stage, _ in (s for pipeline in jobs.values() for s in pipeline):
        stages.setdefault(stage, (None, float("nan")))  # never started: a stage before it failed, or time ran out
    results: dict[str, dict[int, dict]] = {v: {} for v in variants}
    for v in variants:
        for seed in seeds:
            if evaluated(run_dir(out, v, seed)):
                results[v][seed] = run_metrics(run_dir(out, v, seed))
    finished = sum(len(r) for r in results.values())
    wall = time.perf_counter() - started
    log(f"training and evaluation done at {wall:.0f} s: {finished} of {len(variants) * len(seeds)} runs")

    any_run = next((r for seeds_ in results.values() for r in seeds_.values()), None)
    steps = args.steps or next(int(o.split("=")[1]) for o in size.overrides if o.startswith("schedule.steps="))
    context = {"size": size_name, "size_description": size.description, "steps": steps, "seeds": seeds,
               "device": device_name(size_name), "tokens_per_run": any_run["tokens"] if any_run else None,
               "date": time.strftime("%Y-%m-%d"), "wall_s_this_call": round(wall), "reused_runs": len(reused)}
    report = ["# Ablations at small scale", "",
              f"Size {size_name}: {size.description}; seeds {seeds}; {finished} runs ({len(reused)} reused from an "
              f"earlier call); device {context['device']}; this call's wall time {wall:.0f} s.", ""]
    for key in keys:
        report += report_ablation(key, results, out, context)
    report += ["## Runs", "", *stage_rows(stages)]
    (out / "ablations.md").write_text("\n".join(report) + "\n")
    print("\n".join(report), flush=True)
    log(f"all done in {time.perf_counter() - started:.0f} s; report: {out / 'ablations.md'}")
    return 0 if finished == len(variants) * len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
