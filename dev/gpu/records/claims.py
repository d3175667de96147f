"""The seed papers' claims at a scale one GPU affords: train, evaluate, tabulate, plot.

Record: run by ``dev/gpu/records/claims.sh`` (its header has the date, command and result).

    OUT=out bash dev/gpu/records/claims.sh --jobs 8                # all three claims: about one 600 s call on an H100
    python dev/gpu/records/claims.py --out out --smoke             # the whole pipeline, tiny settings (CPU, minutes)

(a) hybrid vs pure vs Transformer on the same token budget (Linear-MoE, Table 5's question);
(b) FoX vs Transformer, with and without the Pro block: per-position loss, extrapolation to 2x and
    4x the training length, needle in a haystack (FoX, Tables 1 and 3, Figs. 2 and 4);
(c) MoM vs one memory of the same width and one of the same total state, on NIAH multi-key and
    multi-query after language-model pretraining (MoM, Tables 2 and 5's question).

Every model is a recipe ``linmem/recipes/claims-<name>.yaml`` (width 384, 8 layers, 20-29M
parameters) trained with ``python -m linmem.cli train`` on the Python standard library's sources
with a BPE of 8192 tokens trained first (``linmem.tokenizer.train_tokenizer``), documents cut to
512 tokens, the same tokens for every model. ``--jobs`` models at a time share the one GPU, each
evaluated (``python -m linmem.eval.command``: perplexity, position-loss, niah) as soon as it is
trained. Stopped by SIGINT (``timeout -s INT``), it writes the report from the runs that finished.
Writes into ``--out``: ``runs/<model>/`` (weights, metrics, eval/), ``claims_<x>.csv/.md``,
``claims_<x>_*.png``, ``claims.md`` (tables, whether each agrees with the paper's direction) and
``logs/``. One seed per model: differences smaller than the seed-to-seed spread (not measured
here) say nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from linmem.eval.plots import plot_loss_curves, plt, read_metrics  # noqa: E402
from linmem.eval.position_loss import PositionCurve, plot_position_loss  # noqa: E402
from linmem.eval.tables import write_table  # noqa: E402
from linmem.models.config import nest_flat_fields  # noqa: E402

RECIPES = REPO / "linmem" / "recipes"
NIAH_TASKS = ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multiquery"]


@dataclass(frozen=True)
class Claim:
    title: str  # the question, and where the paper asks it
    models: tuple[str, ...]  # recipe names (claims-<name>.yaml)


CLAIMS = {
    "a": Claim("hybrid vs pure vs Transformer, same tokens (Linear-MoE Table 5)", ("hybrid", "gdn", "transformer")),
    "b": Claim("FoX vs Transformer, with and without the Pro block (FoX Tables 1/3, Figs. 2/4)",
               ("fox", "fox-pro", "transformer", "transformer-pro")),
    "c": Claim("MoM vs one memory of the same width and of the same total state (MoM Tables 2/5)",
               ("mom", "gdn", "gdn-state")),
}

# --smoke: the same pipeline, small enough for a CPU
SMOKE_TRAIN = ["model.hidden_size=32", "model.num_heads=2", "data.tokens_per_batch=512", "data.max_document_tokens=64",
               "data.text.max_files=60", "schedule.steps=4", "schedule.warmup_steps=1", "schedule.grad_accum=1",
               "run.device=cpu"]


def log(message: str) -> None:
    print(f"[claims {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_pipelines(jobs: dict[str, list[tuple[str, list[str]]]], logs: Path, width: int,
                  env: dict[str, str], devices: Sequence[str] = ()) -> dict[str, tuple[int, float]]:
    """Run the pipelines ``width`` at a time (with ``env`` added to the environment): each is a list of
    (stage name, command) run in order, the next stage starting as soon as one succeeds, none after a
    failure. With ``devices`` (CUDA device ids), each pipeline runs on the one that runs the fewest
    pipelines when it starts (``CUDA_VISIBLE_DEVICES``), all its stages there. Returns stage name ->
    (exit status, seconds); output goes to logs/<stage>.log. On KeyboardInterrupt (``timeout -s INT``)
    the running stages are stopped and recorded with status -2, and what finished is returned, so that
    the report is written from it."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    waiting = [list(stages) for stages in jobs.values() if stages]
    running, done = {}, {}

    def start(stages: list[tuple[str, list[str]]], device: Optional[str] = None) -> None:
        if device is None and devices:
            busy = [entry[4] for entry in running.values()]
            device = min(devices, key=busy.count)
        name, command = stages.pop(0)
        out = open(logs / f"{name}.log", "w")
        out.write(" ".join(command) + "\n")
        out.flush()
        stage_env = env if device is None else {**env, "CUDA_VISIBLE_DEVICES": device}
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=stage_env)
        running[name] = (process, time.perf_counter(), out, stages, device)
        log(f"started {name}{'' if device is None else f' on GPU {device}'}")

    try:
        while waiting or running:
            while waiting and len(running) < width:
                start(waiting.pop(0))
            time.sleep(1.0)
            for name, (process, started, out, rest, device) in list(running.items()):
                if process.poll() is None:
                    continue
                out.close()
                done[name] = (process.returncode, time.perf_counter() - started)
                del running[name]
                status = "ok" if process.returncode == 0 else f"FAILED (exit {process.returncode})"
                log(f"{name}: {status} in {done[name][1]:.0f} s")
                if process.returncode != 0:
                    tail = (logs / f"{name}.log").read_text().splitlines()[-15:]
                    print("\n".join("    " + line for line in tail), flush=True)
                elif rest:
                    start(rest, device)
    except KeyboardInterrupt:
        log(f"interrupted: stopping {sorted(running)}; the report covers what finished")
        for name, (process, started, out, *_) in running.items():
            process.terminate()
            process.wait()
            out.close()
            done[name] = (-2, time.perf_counter() - started)
    return done


def train_args(recipe: str, run_dir: Path, tokenizer: Path, overrides: Sequence[str] = ()) -> list[str]:
    """The arguments of ``linmem train`` of the recipe ``claims-<recipe>.yaml`` into ``run_dir`` with the BPE
    ``tokenizer``, without progress bar or TensorBoard, then ``overrides`` (``section.key=value``)."""
    return ["train", "--config", str(RECIPES / f"claims-{recipe}.yaml"), f"data.text.tokenizer={tokenizer}",
            f"run.out_dir={run_dir}", "run.progress=false", "run.tensorboard=false", *overrides]


def eval_args(run_dir: Path, suites: str, lengths: str, options: Sequence[str] = ()) -> list[str]:
    """The arguments of ``linmem eval`` of ``run_dir``: ``suites`` at window lengths ``lengths`` (comma-separated),
    no progress bars, then ``options`` (its other flags)."""
    return ["eval", str(run_dir), "--suite", suites, "--lengths", lengths, "--no-progress", *options]


def linmem_command(*commands: Sequence[str]) -> list[str]:
    """One process that runs the ``linmem`` commands (each a list of arguments) one after another and stops at
    the first that fails: a train and an eval in one process import torch and transformers once."""
    if len(commands) == 1:
        return [sys.executable, "-m", "linmem.cli", *commands[0]]
    chain = ("import json, sys; from linmem.cli import main; "
             "sys.exit(next((rc for rc in map(main, json.loads(sys.argv[1])) if rc), 0))")
    return [sys.executable, "-c", chain, json.dumps([list(c) for c in commands])]


def train_commands(models: list[str], out: Path, tokenizer: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    overrides = [f"schedule.steps={args.steps}"] if args.steps is not None else []
    overrides += SMOKE_TRAIN if args.smoke else []
    return {f"train-{name}": linmem_command(train_args(name, out / "runs" / name, tokenizer, overrides))
            for name in models}


def eval_commands(models: list[str], out: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    lengths = "512,768" if args.smoke else args.lengths  # the smoke tokenizer (512 tokens) spells English long
    samples, depths = ("1", "2") if args.smoke else (str(args.samples), str(args.depths))
    tasks = "niah_single_1,niah_multikey_1" if args.smoke else ",".join(NIAH_TASKS)
    options = ["--depths", depths, "--samples", samples, "--niah-tasks", tasks, "--max-new-tokens", "24", "--bins",
               "16", "--max-windows", "48", "--batch-size", "16", *(["--concat"] if args.smoke else [])]
    return {f"eval-{name}": linmem_command(eval_args(out / "runs" / name, "perplexity,position-loss,niah", lengths,
                                                     options))
            for name in models}


def ensure_tokenizer(out: Path, vocab_size: int, max_files: Optional[int]) -> Path:
    """``out/tokenizer``: a BPE of ``vocab_size`` tokens on the stdlib sources (the first ``max_files`` files;
    None: all), trained unless it is there already."""
    from linmem.tokenizer import train_tokenizer

    tokenizer = out / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        t0 = time.perf_counter()
        train_tokenizer(tokenizer, vocab_size=vocab_size, max_files=max_files, show_progress=False)
        log(f"tokenizer trained in {time.perf_counter() - t0:.0f} s -> {tokenizer}")
    return tokenizer


def stage_rows(stages: dict[str, tuple[Optional[int], float]]) -> list[str]:
    """The report's table of stages (Markdown lines): each one's status and seconds."""
    status = {0: "ok", -2: "stopped at the time limit", None: "not started"}
    return ["| stage | status | seconds |", "|---|---|---|"] + [
        f"| {name} | {status.get(code, f'exit {code}')} | "
        f"{'' if code is None else 'reused' if math.isnan(seconds) else f'{seconds:.0f}'} |"
        for name, (code, seconds) in stages.items()]


def run_summary(run: Path) -> dict:
    """What one run measured: params, state, training, and every eval metric."""
    config = nest_flat_fields(json.loads((run / "model" / "config.json").read_text()))
    metrics = read_metrics(run / "metrics.jsonl")
    train_rows = [m for m in metrics if "loss" in m]
    held_out = [m["val_loss"] for m in metrics if "val_loss" in m]
    summary = {f"{r['suite']}:{r['metric']}": r["value"]
               for r in json.loads((run / "eval" / "summary.json").read_text())["summary"]}
    position = json.loads((run / "eval" / "position_loss.json").read_text())
    mixer, mom = config["mixer"], config["mom"]
    head_dim = mixer["head_dim"] or config["hidden_size"] // config["num_heads"]
    memories = (mom["num_memories"] + int(mom["shared_memory"])) if config["memory"] == "mom" else 1
    import torch

    from linmem.models import LinmemConfig, LinmemForCausalLM

    with torch.device("meta"):
        model = LinmemForCausalLM(LinmemConfig.from_pretrained(run / "model"))
    return {
        "params_m": model.num_all_parameters() / 1e6,
        "state_per_layer": config["num_heads"] * head_dim * int(head_dim * mixer["expand_v"]) * memories,
        "tokens": train_rows[-1]["tokens"], "tok_s": train_rows[-1]["tok_s_cumulative"],
        "final_train_loss": train_rows[-1]["loss"],
        "final_val_loss": held_out[-1] if held_out else float("nan"),  # the trainer's at the last step
        "train_length": position["train_length"],
        "curves": [PositionCurve(**c) for c in position["curves"]],
        "metrics": summary,
    }


def niah_mean(result: dict, task: str) -> float:
    values = [v for k, v in result["metrics"].items() if k == f"niah:{task}/mean"]
    return values[0] if values else float("nan")


def verdict(name: str, better: float, worse: float, claim: str, lower_is_better: bool = True) -> str:
    if math.isnan(better) or math.isnan(worse):
        return f"- {claim}: not measured"
    if better == worse:
        return f"- {claim}: {better:.4f} vs {worse:.4f}: no difference ({name})"
    agrees = better < worse if lower_is_better else better > worse
    return f"- {claim}: {better:.4f} vs {worse:.4f}: {'agrees' if agrees else 'does not agree'} ({name})"


def table_a(results: dict) -> tuple[list[dict], list[str]]:
    rows = [{"model": m, "params_M": r["params_m"], "tokens": r["tokens"],
             "val_loss": r["metrics"]["perplexity:val_loss"], "val_ppl": r["metrics"]["perplexity:val_ppl"],
             "niah_single_2": niah_mean(r, "niah_single_2"), "tok_s": r["tok_s"]} for m, r in results.items()]
    get = {row["model"]: row for row in rows}
    verdicts = []
    if {"hybrid", "gdn"} <= set(get):
        verdicts.append(verdict("val_loss", get["hybrid"]["val_loss"], get["gdn"]["val_loss"],
                                "a hybrid has a lower loss than the pure memory model"))
    if {"hybrid", "transformer"} <= set(get):
        verdicts.append(verdict("val_loss", get["hybrid"]["val_loss"], get["transformer"]["val_loss"],
                                "a hybrid has a lower loss than the Transformer"))
    return rows, verdicts


def table_b(results: dict) -> tuple[list[dict], list[str]]:
    rows = []
    for m, r in results.items():
        first, *longer = [c.length for c in r["curves"]]
        row = {"model": m, "params_M": r["params_m"], "val_loss": r["metrics"]["perplexity:val_loss"],
               f"loss_L{first}": r["metrics"][f"position-loss:loss/L{first}"]}
        row.update({f"past_train_L{n}": r["metrics"].get(f"position-loss:loss_past_train/L{n}", float("nan"))
                    for n in longer})
        row.update({t.replace("niah_", ""): niah_mean(r, t) for t in NIAH_TASKS})
        rows.append(row)
    get = {row["model"]: row for row in rows}
    longest = max(c.length for r in results.values() for c in r["curves"])
    past = f"past_train_L{longest}"
    verdicts = []
    for base, other in (("fox", "transformer"), ("fox-pro", "transformer-pro")):
        if {base, other} <= set(get) and past in get[base]:
            verdicts.append(verdict(past, get[base][past], get[other][past],
                                    f"{base} predicts positions past the training length (windows of {longest}) "
                                    f"better than {other}"))
            verdicts.append(verdict("val_loss", get[base]["val_loss"], get[other]["val_loss"],
                                    f"{base} has a lower loss than {other}"))
    for pro, plain in (("fox-pro", "fox"), ("transformer-pro", "transformer")):
        if {pro, plain} <= set(get):
            verdicts.append(verdict("val_loss", get[pro]["val_loss"], get[plain]["val_loss"],
                                    f"the Pro block lowers the loss ({plain})"))
            if get[pro]["params_M"] == get[plain]["params_M"]:
                verdicts.append(f"- WARNING: {pro} has as many parameters as {plain}: the Pro options had no effect")
    return rows, verdicts


def table_c(results: dict) -> tuple[list[dict], list[str]]:
    rows = []
    for m, r in results.items():
        row = {"model": m, "params_M": r["params_m"], "state_per_layer": r["state_per_layer"],
               "val_loss": r["metrics"]["perplexity:val_loss"]}
        for task in ("niah_multikey_1", "niah_multiquery", "niah_single_2"):
            row[task.replace("niah_", "")] = niah_mean(r, task)
        rows.append(row)
    get = {row["model"]: row for row in rows}
    verdicts = []
    for other in ("gdn", "gdn-state"):
        if {"mom", other} <= set(get):
            for task in ("multikey_1", "multiquery"):
                verdicts.append(verdict(task, get["mom"][task], get[other][task],
                                        f"MoM recalls better than {other} on NIAH {task}", lower_is_better=False))
            verdicts.append(verdict("val_loss", get["mom"]["val_loss"], get[other]["val_loss"],
                                    f"MoM has a lower loss than {other}"))
    return rows, verdicts


def plot_niah_by_length(results: dict, tasks: list[str], out: Path) -> Path:
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for model, r in results.items():
            points = sorted((int(k.split("/L")[1]), v) for k, v in r["metrics"].items()
                            if k.startswith(f"niah:{task}/L"))
            if points:
                ax.plot(*zip(*points), marker="o", label=model)
        ax.axvline(next(iter(results.values()))["train_length"], color="gray", linestyle="--", linewidth=1)
        ax.set(title=task, xlabel="context length (tokens)", ylabel="accuracy", ylim=(-0.02, 1.02), xscale="log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/claims-out"), help="where everything is written")
    parser.add_argument("--claims", default="a,b,c", help="which claims: a, b, c (comma-separated)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipes' 300)")
    parser.add_argument("--jobs", type=int, default=3, help="trainings / evaluations at once on the GPU")
    parser.add_argument("--lengths", default="512,1024,2048", help="evaluation lengths (training length: 512)")
    parser.add_argument("--depths", type=int, default=5, help="niah depths")
    parser.add_argument("--samples", type=int, default=4, help="niah prompts per (task, length, depth)")
    parser.add_argument("--smoke", action="store_true", help="tiny settings on the CPU: checks the pipeline only")
    args = parser.parse_args()
    claims = [c.strip() for c in args.claims.split(",") if c.strip()]
    unknown = [c for c in claims if c not in CLAIMS]
    if unknown:
        parser.error(f"unknown claims {unknown}; valid: {', '.join(CLAIMS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    models = list(dict.fromkeys(m for c in claims for m in CLAIMS[c].models))
    log(f"claims {claims}: models {models}; output in {out}")

    tokenizer = ensure_tokenizer(out, 512 if args.smoke else 8192, 60 if args.smoke else None)
    width = 1 if args.smoke else args.jobs
    env = {"OMP_NUM_THREADS": "1"} if args.smoke else {}  # tiny CPU models: one thread each
    done_before = [m for m in models if (out / "runs" / m / "model" / "config.json").exists()]
    if done_before:
        log(f"reusing the finished runs {done_before} in {out / 'runs'} (delete them to train again)")
    train = train_commands([m for m in models if m not in done_before], out, tokenizer, args)
    evaluate = eval_commands(models, out, args)
    pipelines = {m: [(f"train-{m}", train[f"train-{m}"])] * (m not in done_before)
                 + [(f"eval-{m}", evaluate[f"eval-{m}"])] for m in models}  # each evaluated as soon as it is trained
    stages = {f"train-{m}": (0, float("nan")) for m in done_before}
    stages.update(run_pipelines(pipelines, out / "logs", width, env))
    for name, _ in (stage for pipeline in pipelines.values() for stage in pipeline):
        stages.setdefault(name, (None, float("nan")))  # never started: a stage before it failed, or the time ran out
    ok = [m for m in models if stages.get(f"eval-{m}", (None,))[0] == 0]
    log(f"training and evaluation done at {time.perf_counter() - started:.0f} s: {len(ok)} of {len(models)} runs")

    results = {m: run_summary(out / "runs" / m) for m in ok}
    builders = {"a": table_a, "b": table_b, "c": table_c}
    report = ["# Small-scale claims", "",
              f"One seed per model; {len(ok)} runs; wall time {time.perf_counter() - started:.0f} s"
              f"{' (smoke settings)' if args.smoke else ''}.", ""]
    for c in claims:
        mine = {m: results[m] for m in CLAIMS[c].models if m in results}
        if not mine:
            report += [f"## ({c}) {CLAIMS[c].title}", "", "no run finished", ""]
            continue
        rows, verdicts = builders[c](mine)
        _, md = write_table(rows, out / f"claims_{c}")
        report += [f"## ({c}) {CLAIMS[c].title}", "", md.read_text(), *verdicts, ""]
        if c == "a":
            plot_loss_curves({m: out / "runs" / m / "metrics.jsonl" for m in mine}, out / "claims_a_loss.png")
        if c == "b":
            plot_position_loss({m: r["curves"] for m, r in mine.items()}, out / "claims_b_position_loss.png",
                               train_length=next(iter(mine.values()))["train_length"])
            plot_niah_by_length(mine, ["niah_single_1", "niah_single_2"], out / "claims_b_niah.png")
        if c == "c":
            plot_niah_by_length(mine, ["niah_multikey_1", "niah_multiquery"], out / "claims_c_niah.png")
    report += ["## Runs", "", *stage_rows(stages)]
    (out / "claims.md").write_text("\n".join(report) + "\n")
    print("\n".join(report), flush=True)
    log(f"all done in {time.perf_counter() - started:.0f} s; report: {out / 'claims.md'}")
    return 0 if len(ok) == len(models) else 1


if __name__ == "__main__":
    sys.exit(main())
