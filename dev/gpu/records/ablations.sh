#!/usr/bin/env bash
# Record: not run on a GPU yet. Meant for one call on 4 H200s: `OUT=out bash dev/gpu/records/ablations.sh --jobs 10`;
# results go to docs/evaluation.md ("Ablations at small scale") when measured.
# The seed papers' ablations at the claims recipes' size (dev/gpu/records/ablations.py: FoX's forget gates, FoX Table
# 3's rows, MoM's memories and shared memory; 3 seeds each, 30 runs), and Linear-MoE Table 3's sweep of training
# throughput over every memory kind: `linmem bench layers --parts mixers --mixers all` at T = 2K..16K with 16K
# tokens a step (one layer each, D 1024, 8 heads, forward+backward, bf16 autocast).
# With several GPUs the bench runs alone on the last one while the ablations' runs share the others (--jobs runs
# on each: 10 on each of 3 GPUs starts all 30 at once); on one GPU the bench runs first, alone, then the runs.
# LIMIT (seconds, default 540) stops the ablations with `timeout -s INT`, so that the report covers what finished;
# a second call reuses the finished runs. Extra arguments go to ablations.py (e.g. --ablations mom --steps 300).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/ablations-out}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi: running where torch finds a device"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
BENCH=(python -m linmem.cli bench layers --parts mixers --mixers all --mixer-seq-lens 2048,4096,8192,16384)
if [ "$GPUS" -gt 1 ]; then
  CUDA_VISIBLE_DEVICES=$((GPUS - 1)) timeout "$LIMIT" "${BENCH[@]}" > "$OUT/bench_layers.log" 2>&1 &
  bench=$!
  timeout -s INT "$LIMIT" python dev/gpu/records/ablations.py --out "$OUT" --gpus "$(seq -s, 0 $((GPUS - 2)))" "$@" \
    2>&1 | tee -i "$OUT/ablations.log"
  echo "ablations: exit ${PIPESTATUS[0]}"
  wait "$bench"
  echo "bench: exit $?"
else
  timeout 200 "${BENCH[@]}" > "$OUT/bench_layers.log" 2>&1
  echo "bench: exit $?"
  timeout -s INT $((LIMIT - 200)) python dev/gpu/records/ablations.py --out "$OUT" "$@" 2>&1 | tee -i "$OUT/ablations.log"
  echo "ablations: exit ${PIPESTATUS[0]}"
fi
tail -n 40 "$OUT/bench_layers.log"
python dev/gpu/records/ablations.py --out "$OUT" --throughput "$OUT/bench_layers.log"
