#!/usr/bin/env bash
# Record: run 2026-11-27 on one H100 80 GB (code 0cfdead) as `OUT=out bash dev/gpu/records/claims.sh --jobs 8`;
# result: benchmarks/results/claims.json (BENCHMARKS.md, the papers' claims) and docs/evaluation.md.
# The seed papers' claims at small scale on one GPU: trains the claims-* recipes, evaluates them
# (perplexity, per-position loss, needle in a haystack) and writes tables, plots and claims.md into $OUT.
# Extra arguments go to dev/gpu/records/claims.py (e.g. --claims b --steps 600). On an H100 shared with two other
# jobs, --jobs 4 trained the 8 models in 498 s (the MoM's alone 337 s), then took 45-50 s per evaluation;
# --jobs 8 runs every model at once, each evaluated when it is trained. `timeout -s INT` stops it with a
# report of what finished (tee ignores the interrupt so that the report still reaches the log).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-runs/claims-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi: running where torch finds a device"
python dev/gpu/records/claims.py --out "$OUT" "$@" 2>&1 | tee -i "$OUT/claims.log"
