#!/usr/bin/env bash
# The seed papers' claims at small scale on one GPU: trains the claims-* recipes, evaluates them
# (perplexity, per-position loss, needle in a haystack) and writes tables, plots and claims.md into $OUT.
# Extra arguments go to dev/gpu/claims.py (e.g. --claims b --steps 600). All three claims take longer
# than one 600 s device call (on an H100 shared with two other jobs, --jobs 4: the 8 trainings 498 s, the
# MoM's alone 337 s, then 45-50 s per evaluation): run `--claims a,b --jobs 4` and `--claims c` as two calls.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/claims-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi: running where torch finds a device"
python dev/gpu/claims.py --out "$OUT" "$@" 2>&1 | tee "$OUT/claims.log"
