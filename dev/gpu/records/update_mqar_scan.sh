#!/usr/bin/env bash
# Record: run 2026-11-26/27 on one H100 80 GB as `OUT=/tmp/out bash dev/gpu/records/update_mqar_scan.sh`;
# result: docs/bayes.md, "Update-MQAR: the Bayesian layer against Gated DeltaNet".
# What the Update-MQAR recipes need to leave the ln(V) plateau on one GPU, in one device call (under 10
# minutes): the recipes' first model (two layers of width 256, 4 heads, bf16 autocast, lr 2e-3) with either
# memory, trained and scored at (L, kv) = (256, 32) and (512, 64), one change per row:
#   hard     the update variant on a pool of 8192 tokens (the recipes' first version)
#   base     as hard, on Zoology's MQAR (keys and values from disjoint halves of the vocabulary)
#   shared   as hard, on the shared pool without rebinding
#   v1024    a pool of 1024 tokens (the recipes' second version)
#   v256     a pool of 256 tokens
#   easy     as v1024, with Zoology's easy settings (64, 4), (128, 8), (256, 16) in the training mix
# Every run is a `linmem train` with overrides, all of one model started at once on the GPU for $BUDGET_S
# seconds (SIGINT stops a run after its step and keeps its last evaluation, every 100 steps); each prints
# its final metrics (the line starting "done:"), collected in $OUT/update_mqar_scan.log with the last
# logged training loss. A row has left the plateau when its loss is below ln(V) (9.01 for 8192, 6.93 for
# 1024, 5.55 for 256) and its accuracy above 1/V.
# Knobs (environment): BUDGET_S=260 per model.
set -uo pipefail -f  # -f: the [[L, kv]] lists below are not glob patterns
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-260}
RUNS=$(mktemp -d)
mkdir -p "$OUT"
COMMON="model.hidden_size=256 model.num_heads=4 optim.lr=0.002 data.mqar.settings=[[256,32],[512,64]]
  data.mqar.vocab_size=1024 schedule.steps=3000 run.save_every=0 run.device=cuda run.progress=false run.log_every=50
  run.tensorboard=false run.resume=false run.eval_every=100 data.mqar.eval_examples=300
  data.mqar.train_examples=50000 data.mqar.eval_settings=[[256,32],[512,64]]"
EASY="data.mqar.settings=[[64,4],[128,8],[256,16],[256,32],[512,64]]"
run() {  # model, name, overrides...
  local model=$1 name=$2; shift 2
  timeout -s INT -k 30 "$BUDGET_S" python3 -m linmem.cli train --recipe "update-mqar-$model" $COMMON "$@" \
    run.out_dir="$RUNS/$model-$name" 2>/dev/null | grep "^done:" | sed "s|^|$model $name |" >> "$OUT/update_mqar_scan.log"
  echo "$model $name last loss: $(grep '"loss"' "$RUNS/$model-$name/metrics.jsonl" | tail -n 1)" \
    >> "$OUT/update_mqar_scan.log"
}
for model in gated_deltanet bayes; do
  run "$model" hard data.mqar.vocab_size=8192 &
  run "$model" base data.mqar.vocab_size=8192 data.mqar.variant=base &
  run "$model" shared data.mqar.vocab_size=8192 data.mqar.variant=shared &
  run "$model" v1024 &
  run "$model" v256 data.mqar.vocab_size=256 &
  run "$model" easy "$EASY" &
  wait
done
sort "$OUT/update_mqar_scan.log"
