#!/usr/bin/env bash
# Record: not yet run on a GPU; the CPU smoke sizes were measured 2026-12-02 (docs/bayes.md, "The paper's
# experiments"). Run as `OUT=/tmp/out bash dev/gpu/records/bayes_distill.sh`.
# Memory by Design's distillation at a size one GPU affords (dev/gpu/records/bayes_distill.py has the pipeline):
# per seed a Gated DeltaNet trained from scratch, the same weights as Bayesian layers (linmem.linearize.
# gated_deltanet_to_bayes), the source trained on for the fine-tuning steps (the matched-compute control) and the
# converted model fine-tuned for the same steps; all four scored on the same held-out data. Two tasks, each at three
# seeds, all six pipelines at once; with several visible GPUs the text task runs on the first, MQAR on the second:
#   text  bytes of the Python standard library, 4 layers of width 256 (4 heads of 64), documents of 512 bytes,
#         16K tokens a step, 1500 steps from scratch at lr 2e-3, then 300 at 5e-4; held-out loss and NIAH
#         (niah_single_1, niah_single_2) at 512 and 1024 bytes, 5 depths x 4 prompts
#   mqar  the recipe update-mqar-gated_deltanet for 2000 steps, then 400 at lr 1e-3; recall at (64, 8) and at twice
#         the length, (128, 16)
# Writes $OUT/distill-{text,mqar}.{md,json} (per model and metric: mean ± sample std [min, max] over seeds) and
# $OUT/distill-{text,mqar}.log. Knobs (environment): DEADLINE_S=540 (running seeds get SIGINT then), SEEDS=0,1,2.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
DEADLINE_S=${DEADLINE_S:-540} SEEDS=${SEEDS:-0,1,2}
GPUS=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
IFS=, read -ra IDS <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}"
RUNS=$(mktemp -d)  # weights stay here; the tables and logs go to $OUT
mkdir -p "$OUT"
i=0
for task in text mqar; do
  CUDA_VISIBLE_DEVICES=${IDS[$((i % ${#IDS[@]}))]} python3 dev/gpu/records/bayes_distill.py --task "$task" \
    --out "$RUNS/distill-$task" --seeds "$SEEDS" --budget-s "$DEADLINE_S" > "$OUT/distill-$task.log" 2>&1 &
  i=$((i + 1))
done
wait
rc=0
for task in text mqar; do
  cp "$RUNS/distill-$task/distill.md" "$OUT/distill-$task.md" && cp "$RUNS/distill-$task/distill.json" \
    "$OUT/distill-$task.json" || rc=1
  cat "$RUNS"/distill-"$task"/logs/*.log >> "$OUT/distill-$task.log"
  echo "== distillation on $task" && cat "$OUT/distill-$task.md"
done
exit $rc
