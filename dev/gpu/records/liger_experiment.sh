#!/usr/bin/env bash
# Record: run 2026-11-26 on one H100 80 GB as `OUT=out bash dev/gpu/records/liger_experiment.sh`;
# result: docs/liger.md, "Results" (its liger_results.json stayed on the GPU machine).
# Liger at small scale on one GPU (under 10 minutes on an H100): a ~30M Llama trained on the stdlib,
# linearized to Liger-GLA, LoRA-tuned through linmem train, decode latency and memory versus context
# beside the base model, and the Table 6 ablations while the budget lasts. Nothing is downloaded: the
# tokenizer, the base model and the data are made here. Writes liger_results.{json,md}, liger_quality.png,
# liger_decode.png and liger_experiment.log into $OUT and prints the results table. Extra arguments go to
# dev/gpu/records/liger_experiment.py (e.g. --budget-s 400, or --smoke for a tiny CPU run).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/liger-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi: running where torch finds a device"
python3 -c "import peft" 2>/dev/null || { echo "peft is missing: pip install 'peft>=0.11' (or carry its wheel)"; exit 2; }
status=0
# the script keeps to its budget; the timeout only guards the 600 s limit of one command
timeout --kill-after=5 570 python3 dev/gpu/records/liger_experiment.py --out "$OUT" "$@" 2>&1 \
    | grep --line-buffered -v "Writing\|Loading weights" | tee "$OUT/liger_experiment.log" || status=$?
if [ "$status" -ne 0 ]; then
    echo "liger_experiment.py stopped with status $status; the results written so far:"
    cat "$OUT/liger_results.md" 2>/dev/null || echo "(none)"
fi
exit "$status"
