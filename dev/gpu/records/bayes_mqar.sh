#!/usr/bin/env bash
# Record: run 2026-11-27 on one H100 80 GB as `OUT=/tmp/out bash dev/gpu/records/bayes_mqar.sh`;
# result: docs/bayes.md, "Update-MQAR: the Bayesian layer against Gated DeltaNet".
# The Bayesian memory layer on one GPU, in under 10 minutes on an H100:
#  1. its checks on CUDA: the layer's and the compiled path's tests (tests/layers/test_bayes.py,
#     tests/ops/test_bayes_compile.py: kernels against the token loop, decoding, torch.compile, the custom ops'
#     fake implementations), then `dev/gpu/tools/bayes_models.py --checks` (the bf16 layer against the token loop on
#     packed sequences, every gradient; a model decoding through its cached mean and covariance; inductor);
#  2. Update-MQAR: the recipes update-mqar-bayes and update-mqar-gated_deltanet as shipped (two layers of width
#     128, 2 heads, short convolutions, bf16 autocast, the same data, seed and steps; keys and values from one
#     pool of 128 tokens, half of the keys rebound to fresh values, every key must recall its latest value;
#     trained on (L, kv) = (16, 1) ... (64, 8) mixed, evaluated at (64, 8) and (128, 16) every 250 steps).
#     At width 256 with pools of 8192 and 1024 tokens both stayed at the loss ln(V) and chance accuracy in
#     this budget (docs/bayes.md); dev/gpu/records/update_mqar_scan.sh measures what the pool and other changes do.
#     Each model gets half of the time left before $DEADLINE_S; a run past it stops after its step (SIGINT)
#     and keeps its last evaluation.
# Prints a table (also $OUT/summary.md): per model the steps run, the median tokens/s, the accuracy at the
# last evaluation both runs reached (the fair comparison) and at each run's own last one.
# Outputs: $OUT/env.txt, $OUT/tests.log, $OUT/checks.log, $OUT/bayes_models.json, $OUT/<model>.log,
# $OUT/<model>/{config.yaml,metrics.jsonl}, $OUT/summary.md. Exit status 1 when a check failed.
# Knobs (environment): DEADLINE_S=560; STEPS (default: the recipes' 4000).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-4000} DEADLINE_S=${DEADLINE_S:-560}
RUNS=$(mktemp -d)  # checkpoints stay here; only the logs and metrics go to $OUT
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())" | tee "$OUT/env.txt"

echo "== 1. checks on CUDA"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/layers/test_bayes.py tests/ops/test_bayes_compile.py \
  2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 150 python3 dev/gpu/tools/bayes_models.py --checks 2>&1 | tee "$OUT/checks.log"
checks_rc=${PIPESTATUS[0]}
echo "# checks: $SECONDS s" | tee -a "$OUT/checks.log"

echo "== 2. Update-MQAR, Bayesian memory against Gated DeltaNet"
budget=$(( (DEADLINE_S - SECONDS) / 2 - 10 ))
budget=$(( budget < 60 ? 60 : budget ))
for model in bayes gated_deltanet; do
  start=$SECONDS
  timeout -s INT -k 30 "$budget" python3 -m linmem.cli train --recipe "update-mqar-$model" \
    schedule.steps="$STEPS" run.save_every=0 run.device=cuda run.progress=false run.log_every=50 \
    run.tensorboard=false run.out_dir="$RUNS/$model" 2>&1 | tee "$OUT/$model.log"
  echo "# $model: $((SECONDS - start)) s of $budget s" | tee -a "$OUT/$model.log"
  mkdir -p "$OUT/$model" && cp "$RUNS/$model/config.yaml" "$RUNS/$model/metrics.jsonl" "$OUT/$model/"
done

python3 - "$OUT" "$tests_rc" "$checks_rc" <<'EOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path

out, tests_rc, checks_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
models = ("bayes", "gated_deltanet")


def read(model):
    path = out / model / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def accuracies(row):
    return ", ".join(f"{k[len('mqar_acc/'):]} {v:.3f}" for k, v in row.items() if k.startswith("mqar_acc"))


runs = {m: read(m) for m in models}
evals = {m: {x["step"]: x for x in rows if any(k.startswith("mqar_acc") for k in x)} for m, rows in runs.items()}
common = set.intersection(*(set(e) for e in evals.values()))
shared = max(common) if common else None
print(f"checks on CUDA: tests {'passed' if tests_rc == 0 else f'FAILED (rc {tests_rc})'}, "
      f"layer checks {'passed' if checks_rc == 0 else f'FAILED (rc {checks_rc})'}\n")
print(f"| model | steps | tok/s | accuracy at step {shared} (both reached) | accuracy at its last evaluation |")
print("|---|---|---|---|---|")
for m in models:
    rows = runs[m]
    tok_s = sorted(x["tok_s"] for x in rows if "tok_s" in x)
    steps = max((x["step"] for x in rows), default=0)
    last = evals[m][max(evals[m])] if evals[m] else {}
    at_shared = accuracies(evals[m][shared]) if shared is not None else "-"
    print(f"| {m} | {steps} | {tok_s[len(tok_s) // 2] if tok_s else 0:,.0f} | {at_shared} | "
          f"step {last.get('step', '-')}: {accuracies(last)} |")
sys.exit(1 if tests_rc or checks_rc else 0)
EOF
