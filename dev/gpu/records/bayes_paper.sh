#!/usr/bin/env bash
# Record: not yet run on a GPU. Run as `OUT=/tmp/out bash dev/gpu/records/bayes_paper.sh` (one device call of at most
# 10 minutes; the runs spread over every visible GPU, so a machine of 4 H200s gives each run about 4x the share of one).
# Memory by Design's experiments that the library had not run, with three seeds each and their spread
# (docs/bayes.md, "The paper's experiments"):
#   1. Update-MQAR with the additive baseline: the recipes update-mqar-{bayes,gated_deltanet,mamba2} (two layers of
#      width 128, 2 heads of 64, one state size), seeds 0,1,2, recall at the trained length (64, 8) and at 2x (128, 16)
#      every 250 of 4000 steps (linmem.eval.seeds);
#   2. Block-MQAR: block-mqar-{bayes,gated_deltanet,mamba2}, the same model, pool and schedule on two MQAR blocks
#      per sequence, evaluated at (64, 8) and 2x;
#   3. the distillation: dev/gpu/records/bayes_distill.sh (text and MQAR, three seeds each).
# Everything starts at once; at DEADLINE_S seconds the runs still training get SIGINT and keep the evaluations they
# reached: each table's "at step S" column compares the runs at the last evaluation all of them reached.
# Writes $OUT/{update,block}.{md,json,png,log} (linmem.eval.seeds' report), $OUT/distill-{text,mqar}.{md,json,log},
# $OUT/env.txt. Knobs (environment): DEADLINE_S=500, SEEDS=0,1,2, STEPS (default: the recipes' 4000).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
DEADLINE_S=${DEADLINE_S:-500} SEEDS=${SEEDS:-0,1,2} STEPS=${STEPS:-}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
GPUS=$(( GPUS > 0 ? GPUS : 1 ))
RUNS=$(mktemp -d)
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" | tee "$OUT/env.txt"
COMMON="run.device=cuda run.save_every=0 run.log_every=50 ${STEPS:+schedule.steps=$STEPS}"
for task in update block; do
  python3 -m linmem.eval.seeds --recipes "$task-mqar-bayes,$task-mqar-gated_deltanet,$task-mqar-mamba2" \
    --seeds "$SEEDS" --out "$RUNS/$task" --budget-s "$DEADLINE_S" --gpus "$GPUS" $COMMON > "$OUT/$task.log" 2>&1 &
done
OUT="$OUT" DEADLINE_S="$DEADLINE_S" SEEDS="$SEEDS" bash dev/gpu/records/bayes_distill.sh > "$OUT/distill.log" 2>&1 &
wait
rc=0
for task in update block; do
  for ext in md json png; do cp "$RUNS/$task/seeds.$ext" "$OUT/$task.$ext" || rc=1; done
  echo "== $task-MQAR" && cat "$OUT/$task.md" && grep -E "seed [0-9]+:" "$OUT/$task.log"
done
cat "$OUT/distill.log"
echo "# total: $SECONDS s"
exit $rc
