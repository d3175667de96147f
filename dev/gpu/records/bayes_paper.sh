#!/usr/bin/env bash
# Record: not yet run on a GPU. Run as `OUT=/tmp/out bash dev/gpu/records/bayes_paper.sh` (one device call of at most
# 10 minutes; on a machine of 4 GPUs each experiment has a GPU of its own, on one GPU they share it).
# Memory by Design's experiments that the library had not run, with three seeds each and their spread
# (docs/bayes.md, "The paper's experiments"):
#   1. Update-MQAR with the additive baseline: the recipes update-mqar-{bayes,gated_deltanet,mamba2} (two layers of
#      width 128, 2 heads of 64, one state size), seeds 0,1,2, recall at the trained length (64, 8) and at 2x
#      (128, 16) every 250 of 4000 steps (linmem.eval.seeds; first GPU);
#   2. Block-MQAR: block-mqar-{bayes,gated_deltanet,mamba2}, the same model, pool and schedule on two MQAR blocks per
#      sequence, evaluated at (64, 8) and 2x (second GPU);
#   3. the distillation: dev/gpu/records/bayes_distill.sh, text and MQAR, three seeds each (third and fourth GPU).
# Everything starts at once (GPU i mod the visible GPUs); at DEADLINE_S seconds the runs still training get SIGINT and
# keep the evaluations they reached: each MQAR table's "at step S" column compares the runs at the last evaluation
# all of them reached; a distillation seed keeps the models it scored.
# Writes $OUT/{update,block}.{md,json,png,log} (linmem.eval.seeds' report), $OUT/distill-{text,mqar}.{md,json,log},
# $OUT/env.txt. Knobs (environment): DEADLINE_S=500, SEEDS=0,1,2, STEPS (default: the recipes' 4000).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${OUT:-/tmp/out}
DEADLINE_S=${DEADLINE_S:-500} SEEDS=${SEEDS:-0,1,2} STEPS=${STEPS:-}
RUNS=$(mktemp -d)
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" | tee "$OUT/env.txt"
GPUS=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
IFS=, read -ra IDS <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}"
gpu() { echo "${IDS[$(($1 % ${#IDS[@]}))]}"; }
COMMON="run.device=cuda run.save_every=0 run.log_every=50 ${STEPS:+schedule.steps=$STEPS}"
i=0
for task in update block; do
  CUDA_VISIBLE_DEVICES=$(gpu $i) python3 -m linmem.eval.seeds --seeds "$SEEDS" --out "$RUNS/$task" \
    --recipes "$task-mqar-bayes,$task-mqar-gated_deltanet,$task-mqar-mamba2" --budget-s "$DEADLINE_S" \
    $COMMON > "$OUT/$task.log" 2>&1 &
  i=$((i + 1))
done
DISTILL_GPUS=$(gpu 2)
[ "${#IDS[@]}" -gt 1 ] && DISTILL_GPUS="$(gpu 2),$(gpu 3)"
[ "$(gpu 2)" = "$(gpu 3)" ] && DISTILL_GPUS=$(gpu 2)
CUDA_VISIBLE_DEVICES=$DISTILL_GPUS OUT="$OUT" DEADLINE_S="$DEADLINE_S" SEEDS="$SEEDS" \
  bash dev/gpu/records/bayes_distill.sh > "$OUT/distill.log" 2>&1 &
wait
rc=0
for task in update block; do
  for ext in md json png; do cp "$RUNS/$task/seeds.$ext" "$OUT/$task.$ext" || rc=1; done
  echo "== $task-MQAR" && cat "$OUT/$task.md" && grep -E "seed [0-9]+:" "$OUT/$task.log"
done
cat "$OUT/distill.log"
echo "# total: $SECONDS s"
exit $rc
