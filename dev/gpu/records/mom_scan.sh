#!/usr/bin/env bash
# Record: run 2026-11-21 on one H200 as `OUT=/tmp/out bash dev/gpu/records/mom_scan.sh`;
# result: benchmarks/results/mqar-mom.json (BENCHMARKS.md, MQAR: mixture of memories against one memory).
# The MoM vs one-memory MQAR scan of BENCHMARKS.md in one device call: every run is a
# `linmem train` with overrides, all started at once on the one GPU; each prints its final
# metrics (the line starting "done:"), collected in $OUT/mom_scan.log.
set -uo pipefail -f  # -f: the [[L, kv]] lists below are not glob patterns
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
COMMON="data.task=mqar data.mqar.train_examples=20000 data.mqar.eval_examples=500 data.batch_size=64
  schedule.warmup_steps=50 optim.weight_decay=0.1 optim.lr=2e-3 run.log_every=50 run.save_every=0
  run.progress=false run.device=cuda run.dtype=fp32 run.resume=false model.layer_pattern=LL model.hidden_size=64"
GDN="model.memory=gated_deltanet"
MOM="model.memory=mom model.options.mom.memory=gated_deltanet model.options.mom.num_memories=4 model.options.mom.top_k=2"
L128="data.mqar.settings=[[128,8],[128,16],[128,32]] data.mqar.vocab_size=128"
L64="data.mqar.settings=[[64,4],[64,8],[64,16]] data.mqar.vocab_size=64"
SMALL="model.options.mixer.head_dim=8 model.options.mixer.expand_v=4"
run() {  # name, overrides...
  local name=$1; shift
  python3 -m linmem.cli train $COMMON "$@" run.out_dir=/tmp/mom_scan/$name 2>/dev/null \
    | grep "^done:" | sed "s|^|$name |" >> "$OUT/mom_scan.log"
}
run gdn-h2-1500 $GDN $L128 model.num_heads=2 schedule.steps=1500 &
run mom-h2-1500 $MOM $L128 model.num_heads=2 schedule.steps=1500 &
run gdn-h2-2500 $GDN $L128 model.num_heads=2 schedule.steps=2500 &
run mom-h2-2500 $MOM $L128 model.num_heads=2 schedule.steps=2500 &
run mom-h2-lr1e-3 $MOM $L128 model.num_heads=2 schedule.steps=1500 optim.lr=1e-3 &
run mom-h2-noaux $MOM $L128 model.num_heads=2 schedule.steps=1500 model.options.mom.aux_loss_coef=0 &
run gdn-h4 $GDN $L128 model.num_heads=4 schedule.steps=1500 &
run mom-h4 $MOM $L128 model.num_heads=4 schedule.steps=1500 &
run gdn-hd8 $GDN $L128 model.num_heads=2 $SMALL schedule.steps=1500 &
run mom-hd8 $MOM $L128 model.num_heads=2 $SMALL schedule.steps=1500 &
run gdn-L64-hd8 $GDN $L64 model.num_heads=2 $SMALL schedule.steps=1000 &
run mom-L64-hd8 $MOM $L64 model.num_heads=2 $SMALL schedule.steps=1000 &
wait
sort "$OUT/mom_scan.log"
