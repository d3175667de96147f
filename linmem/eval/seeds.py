"""Train recipes over several seeds at once and tabulate every evaluated setting's mean and spread.

    python -m linmem.eval.seeds --recipes update-mqar-bayes,update-mqar-gated_deltanet --seeds 0,1,2 \\
        --out runs/seeds --jobs 6 --budget-s 540 run.device=cuda

Each (recipe, seed) is one ``linmem train --recipe R run.seed=S run.out_dir=OUT/runs/R-sS`` process (the overrides
after the options go to every run; ``run.seed`` is the model's initialisation and every RNG but the data, whose
examples and order ``data.seed`` fixes, so the seeds of a recipe see the same data). ``--jobs`` processes run at
once: small models share one GPU (with ``--gpus N`` run i sees only GPU i mod N). At ``--budget-s`` seconds after
the start the runs still training get SIGINT: the trainer ends its step, saves, and its metrics keep every
evaluation it reached; the runs not started by then are skipped. From each run's ``metrics.jsonl`` every
evaluation (``mqar_acc/*``, ``val_*``) is read, and per recipe and metric the table gives, over the seeds:

* ``final``: the value at each run's last evaluation;
* ``best``: the best value over its evaluations (highest accuracy, lowest loss);
* ``at step S``: the value at the last evaluation step that every run of the table reached (the fair comparison
  when the budget stopped some runs early);

each as ``mean ± std [min, max]``, std the sample standard deviation (ddof 1; 0 for one seed). Writes
``OUT/seeds.md`` (the table), ``OUT/seeds.json`` (the table, every run's status and evaluations), ``OUT/seeds.png``
(each metric against the step: per recipe the mean over seeds and its min-max band) and ``OUT/logs/<run>.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..train.config import recipe_text
from ..train.metrics import read_metrics

#: the prefixes of the evaluation metrics in a metrics.jsonl (MQAR recall; held-out loss and perplexity)
EVAL_PREFIXES = ("mqar_acc/", "val_")
#: seconds a run may take to stop after SIGINT (finish its step, save) before it is killed
STOP_GRACE_S = 30.0


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better: accuracies yes, losses and perplexities no.

    Example:
        >>> higher_is_better("mqar_acc/L64_kv8"), higher_is_better("val_loss")
        (True, False)
    """
    return metric.startswith("mqar_acc/")


@dataclass(frozen=True)
class SeedRun:
    """One training run of the table: a recipe at a seed, in its own folder."""

    recipe: str
    seed: int
    out_dir: Path

    @property
    def name(self) -> str:
        return f"{self.recipe}-s{self.seed}"


def plan_runs(recipes: Sequence[str], seeds: Sequence[int], out: Path) -> list[SeedRun]:
    """Every (recipe, seed), recipe by recipe, each in ``out/runs/<recipe>-s<seed>``.

    Example:
        >>> [r.name for r in plan_runs(["a", "b"], [0, 1], Path("out"))]
        ['a-s0', 'a-s1', 'b-s0', 'b-s1']
    """
    if not recipes or not seeds:
        raise ValueError(f"plan_runs: `recipes` and `seeds` must not be empty, got {list(recipes)}, {list(seeds)}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"plan_runs: `seeds` must be distinct, got {list(seeds)}")
    return [SeedRun(recipe, seed, Path(out) / "runs" / f"{recipe}-s{seed}") for recipe in recipes for seed in seeds]


def train_command(run: SeedRun, overrides: Sequence[str] = ()) -> list[str]:
    """The ``linmem train`` command of ``run``: its recipe and seed, its folder, no progress bar, ``overrides``."""
    return [sys.executable, "-m", "linmem.cli", "train", "--recipe", run.recipe, f"run.seed={run.seed}",
            f"run.out_dir={run.out_dir}", "run.progress=false", "run.tensorboard=false", *overrides]


@dataclass
class ProcessResult:
    """How one command of :func:`run_processes` ended."""

    status: str  # ok, failed, stopped (SIGINT at the deadline) or skipped (not started before it)
    returncode: Optional[int] = None
    seconds: float = 0.0


def process_env(index: int, gpus: int, width: int, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of the ``index``-th process of ``width`` running at once: with ``gpus`` > 1 it sees GPU
    ``index mod gpus`` only; its CPU threads are the machine's cores shared out (unless OMP_NUM_THREADS is set).

    Example:
        >>> env = process_env(5, 4, 8, base={})
        >>> env["CUDA_VISIBLE_DEVICES"], int(env["OMP_NUM_THREADS"]) >= 1
        ('1', True)
    """
    env = dict(os.environ if base is None else base)
    if gpus > 1:
        env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(width, 1))))
    return env


def run_processes(
    commands: dict[str, list[str]], *, jobs: int, budget_s: float, logs: Path, gpus: int = 1,
    cwd: Optional[Path] = None,
) -> dict[str, ProcessResult]:
    """Run ``commands`` (name -> argv) ``jobs`` at a time, each writing ``logs/<name>.log``; at ``budget_s``
    seconds after the start send SIGINT to those still running (killed :data:`STOP_GRACE_S` later if they have
    not ended) and skip those not started. Returns name -> :class:`ProcessResult`, in the order of ``commands``.

    Example:
        >>> done = run_processes({"hi": ["echo", "hi"]}, jobs=1, budget_s=60, logs=Path("/tmp/logs"))  # doctest: +SKIP
        >>> done["hi"].status  # doctest: +SKIP
        'ok'
    """
    if jobs < 1:
        raise ValueError(f"run_processes: `jobs` must be >= 1, got {jobs}")
    if budget_s <= 0:
        raise ValueError(f"run_processes: `budget_s` must be > 0, got {budget_s}")
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    waiting = list(commands)
    running: dict[str, tuple[subprocess.Popen, float, object]] = {}
    done: dict[str, ProcessResult] = {}
    stopping: dict[str, float] = {}
    width = min(jobs, len(commands)) or 1
    started = 0
    while waiting or running:
        now = time.monotonic()
        while waiting and len(running) < jobs and now < deadline:
            name = waiting.pop(0)
            log = open(logs / f"{name}.log", "w")
            log.write(" ".join(commands[name]) + "\n")
            log.flush()
            process = subprocess.Popen(commands[name], stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                       env=process_env(started, gpus, width))
            running[name] = (process, now, log)
            started += 1
        if now >= deadline:
            for name in waiting:
                done[name] = ProcessResult("skipped")
            waiting.clear()
            for name, (process, _, _) in running.items():
                if name not in stopping:
                    process.send_signal(signal.SIGINT)
                    stopping[name] = now
                elif now - stopping[name] > STOP_GRACE_S:
                    process.kill()
        for name, (process, began, log) in list(running.items()):
            if process.poll() is None:
                continue
            log.close()
            status = "stopped" if name in stopping else ("ok" if process.returncode == 0 else "failed")
            done[name] = ProcessResult(status, process.returncode, time.monotonic() - began)
            del running[name]
        if running:
            time.sleep(0.5)
    return {name: done[name] for name in commands}


def read_evaluations(path: Path) -> tuple[int, dict[int, dict[str, float]]]:
    """A run's last logged step and its evaluations, step -> metric -> value, from its ``metrics.jsonl``
    (a missing file: step 0 and none).

    Example:
        >>> steps, evals = read_evaluations(Path("runs/update-mqar-bayes/metrics.jsonl"))  # doctest: +SKIP
        >>> evals[4000]["mqar_acc/L64_kv8"]  # doctest: +SKIP
        0.986
    """
    if not Path(path).is_file():
        return 0, {}
    rows = read_metrics(path)
    evals: dict[int, dict[str, float]] = {}
    for row in rows:
        found = {k: float(v) for k, v in row.items() if k.startswith(EVAL_PREFIXES)}
        if found:
            evals.setdefault(int(row["step"]), {}).update(found)
    return max((int(row["step"]) for row in rows), default=0), evals


@dataclass
class RunEvals:
    """One run's outcome and evaluations."""

    recipe: str
    seed: int
    status: str  # as ProcessResult.status
    steps: int  # the last step it logged
    evals: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> metric -> value


@dataclass
class Spread:
    """Mean, sample standard deviation (ddof 1; 0 for one value), min and max of one quantity over seeds."""

    mean: float
    std: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        """The spread of ``values`` (at least one).

        Example:
            >>> Spread.of([0.5, 0.7, 0.9]).n, Spread.of([0.5]).std
            (3, 0.0)
        """
        if not values:
            raise ValueError("Spread.of: no values")
        n = len(values)
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        return cls(mean, std, min(values), max(values), n)

    def text(self, digits: int = 3) -> str:
        """``mean ± std [min, max]``.

        Example:
            >>> Spread.of([0.5, 0.7, 0.9]).text()
            '0.700 ± 0.200 [0.500, 0.900]'
        """
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.mean)} ± {f.format(self.std)} [{f.format(self.min)}, {f.format(self.max)}]"


def common_step(runs: Sequence[RunEvals]) -> Optional[int]:
    """The last evaluation step every run (with evaluations) reached; None when they share none.

    Example:
        >>> common_step([RunEvals("a", 0, "ok", 20, {10: {}, 20: {}}), RunEvals("b", 0, "stopped", 12, {10: {}})])
        10
    """
    steps = [set(r.evals) for r in runs if r.evals]
    shared = set.intersection(*steps) if steps else set()
    return max(shared) if shared else None


def seed_table(runs: Sequence[RunEvals]) -> list[dict]:
    """Per recipe (in order of appearance) and metric: the seeds, their steps, and the spread of the final, best
    and common-step values (:class:`Spread`). Runs that failed or were skipped, or have no evaluation, are left
    out (they stay in the JSON with their status)."""
    usable = [r for r in runs if r.status in ("ok", "stopped") and r.evals]
    shared = common_step(usable)
    rows = []
    for recipe in dict.fromkeys(r.recipe for r in usable):
        mine = [r for r in usable if r.recipe == recipe]
        metrics = sorted({m for r in mine for values in r.evals.values() for m in values}, key=metric_order)
        for metric in metrics:
            final, best, at_shared = [], [], []
            for r in mine:
                values = [(step, v[metric]) for step, v in sorted(r.evals.items()) if metric in v]
                if not values:
                    continue
                final.append(values[-1][1])
                best.append((max if higher_is_better(metric) else min)(v for _, v in values))
                if shared is not None and metric in r.evals.get(shared, {}):
                    at_shared.append(r.evals[shared][metric])
            rows.append({"recipe": recipe, "metric": metric, "seeds": [r.seed for r in mine],
                         "steps": [r.steps for r in mine], "final": asdict(Spread.of(final)),
                         "best": asdict(Spread.of(best)), "common_step": shared,
                         "at_common_step": asdict(Spread.of(at_shared)) if at_shared else None})
    return rows


def metric_order(metric: str) -> tuple:
    """The sort key of a metric: by its prefix, then the numbers in its name, so that ``mqar_acc/L64_kv8`` comes
    before ``mqar_acc/L128_kv16``.

    Example:
        >>> sorted(["mqar_acc/L128_kv16", "mqar_acc/L64_kv8"], key=metric_order)
        ['mqar_acc/L64_kv8', 'mqar_acc/L128_kv16']
    """
    digits = "".join(c if c.isdigit() else " " for c in metric).split()
    return (metric.split("/")[0], [int(d) for d in digits], metric)


def markdown(rows: Sequence[dict]) -> str:
    """The table of :func:`seed_table` in Markdown: one line per recipe and metric."""
    if not rows:
        return "no run reached an evaluation\n"
    shared = rows[0]["common_step"]
    head = ["recipe", "metric", "seeds", "steps", "final", "best", f"at step {shared}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        low, high = min(row["steps"]), max(row["steps"])
        steps = str(low) if low == high else f"{low}-{high}"
        at = Spread(**row["at_common_step"]).text() if row["at_common_step"] else "-"
        lines.append(f"| {row['recipe']} | {row['metric']} | {len(row['seeds'])} | {steps} | "
                     f"{Spread(**row['final']).text()} | {Spread(**row['best']).text()} | {at} |")
    note = ("\nmean ± std [min, max] over seeds; std: the sample standard deviation (ddof 1). final: each run's last "
            f"evaluation; best: its best one; at step {shared}: the last evaluation step every run reached.\n")
    return "\n".join(lines) + "\n" + note


def plot_seed_curves(runs: Sequence[RunEvals], out: Path) -> Path:
    """One panel per evaluation metric against the step: per recipe the mean over its seeds at the steps all of
    them evaluated, and the band between their min and max."""
    metrics = sorted({m for r in runs for v in r.evals.values() for m in v}, key=metric_order)
    from .plots import plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for recipe in dict.fromkeys(r.recipe for r in runs):
            mine = [r for r in runs if r.recipe == recipe and r.evals]
            steps = sorted(set.intersection(*(set(s for s, v in r.evals.items() if metric in v) for r in mine))) \
                if mine else []
            if not steps:
                continue
            values = [[r.evals[s][metric] for r in mine] for s in steps]
            line, = ax.plot(steps, [sum(v) / len(v) for v in values], label=f"{recipe} ({len(mine)})")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                            alpha=0.2)
        ax.set(xlabel="step", ylabel=metric.split("/")[0], title=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_report(runs: Sequence[RunEvals], out: Path) -> dict[str, Path]:
    """``out/seeds.md``, ``out/seeds.json`` and ``out/seeds.png`` (see the module docstring); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = seed_table(runs)
    paths = {"md": out / "seeds.md", "json": out / "seeds.json", "png": out / "seeds.png"}
    paths["md"].write_text(markdown(rows))
    record = {"spread": "mean, sample std (ddof 1), min, max over seeds", "table": rows,
              "runs": [{**asdict(r), "evals": {str(s): v for s, v in r.evals.items()}} for r in runs]}
    paths["json"].write_text(json.dumps(record, indent=2) + "\n")
    if any(r.evals for r in runs):
        plot_seed_curves(runs, paths["png"])
    else:
        del paths["png"]
    return paths


def train_seeds(
    recipes: Sequence[str], seeds: Sequence[int], out: Path, *, overrides: Sequence[str] = (), jobs: int = 1,
    budget_s: float = 540.0, gpus: int = 1,
) -> list[RunEvals]:
    """Train every (recipe, seed) as :func:`run_processes` runs them and read back their evaluations.

    Example:
        >>> runs = train_seeds(["update-mqar-bayes"], [0, 1], Path("out"), jobs=2)  # doctest: +SKIP
        >>> print(markdown(seed_table(runs)))  # doctest: +SKIP
    """
    for recipe in recipes:
        recipe_text(recipe)  # an unknown name is refused before anything starts
    planned = plan_runs(recipes, seeds, out)
    commands = {run.name: train_command(run, overrides) for run in planned}
    results = run_processes(commands, jobs=jobs, budget_s=budget_s, logs=Path(out) / "logs", gpus=gpus)
    runs = []
    for run in planned:
        steps, evals = read_evaluations(run.out_dir / "metrics.jsonl")
        runs.append(RunEvals(run.recipe, run.seed, results[run.name].status, steps, evals))
    return runs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m linmem.eval.seeds --recipes A,B --seeds 0,1,2 --out DIR [--jobs N] [--budget-s S] [--gpus G]
    [overrides...]``: prints the table; exit status 1 when a run failed."""
    parser = argparse.ArgumentParser(prog="python -m linmem.eval.seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", required=True, help="recipe names, comma-separated")
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="run.seed values, comma-separated (0,1,2)")
    parser.add_argument("--out", required=True, type=Path, help="folder of the runs, logs and report")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default: all)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds until running runs are stopped")
    parser.add_argument("--gpus", type=int, default=1, help="spread the runs over this many GPUs (round robin)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    args = parser.parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    jobs = args.jobs or len(recipes) * len(args.seeds)
    runs = train_seeds(recipes, args.seeds, args.out, overrides=args.overrides, jobs=jobs, budget_s=args.budget_s,
                       gpus=args.gpus)
    paths = write_report(runs, args.out)
    print(paths["md"].read_text())
    for r in runs:
        print(f"{r.recipe} seed {r.seed}: {r.status}, {r.steps} steps, {len(r.evals)} evaluations")
    print("written:", ", ".join(str(p) for p in paths.values()))
    return 1 if any(r.status == "failed" for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
