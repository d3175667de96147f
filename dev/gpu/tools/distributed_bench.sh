#!/usr/bin/env bash
# Parallel training on one host: checks, sequence-parallel weak scaling, data-, expert- and tensor-parallel
# (x FSDP2) throughput on 1, 2 and 4 GPUs (as many as the host has), one table at the end.
#   OUT=/path/to/logs dev/gpu/tools/distributed_bench.sh            (defaults: OUT=out, STEPS=3, COUNTS="1 2 4")
# COUNTS picks the GPU counts to launch; the table joins every distributed_bench_N.json in $OUT, so the
# one-GPU rows of an earlier run (about 200 s on an H100) can be copied into $OUT and COUNTS="2 4" run.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
STEPS="${STEPS:-3}"
COUNTS="${COUNTS:-1 2 4}"
mkdir -p "$OUT"
GPUS=$(nvidia-smi -L | wc -l)
for n in $COUNTS; do
    rm -f "$OUT/distributed_bench_$n.json"
    if [ "$n" -gt "$GPUS" ]; then
        echo "skipping $n GPUs: the host has $GPUS" | tee -a "$OUT/distributed_bench.log"
        continue
    fi
    torchrun --standalone --nproc-per-node "$n" dev/gpu/tools/distributed_bench.py --out "$OUT" --steps "$STEPS" \
        2>&1 | tee -a "$OUT/distributed_bench.log"
done
python dev/gpu/tools/distributed_bench.py --out "$OUT" --modes table | tee "$OUT/distributed_bench_table.txt"
