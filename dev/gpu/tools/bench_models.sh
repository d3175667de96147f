#!/usr/bin/env bash
# The model-level benchmarks of record on one GPU, in one device call (about 8 minutes on an H100):
#   1. linmem bench models --peers: training tokens/s and peak memory at T = 2K..32K, 16K tokens a step,
#      linmem's transformer, GLA, DeltaNet, Gated DeltaNet, hybrid and FoX beside HF Llama and fla's models;
#   2. linmem bench decode --peers: ms/token and memory versus context, batch 8, beside HF Llama (dynamic
#      and static cache) and fla's GLA, with plots.
# Each bench prints one JSON line per cell and each row's elapsed seconds, and rewrites its JSON after every
# cell, so a run cut short keeps what it measured; --budget-s stops starting cells past that many seconds.
# Outputs: $OUT/env.txt, $OUT/models/{models.json,models.md}, $OUT/decode/{decode.json,decode.md,*.png},
# $OUT/models.log, $OUT/decode.log. Extra arguments: MODELS_ARGS="..." and DECODE_ARGS="..." (appended, so
# they override), e.g. MODELS_ARGS="--modes eager,graph --warmup 2 --models deltanet --seq-lens 2048,8192".
# fla autotunes its kernels on first use (minutes a model); Triton keeps the choices as *.autotune.json files in
# TRITON_CACHE_DIR. They are saved to $OUT/autotune.tgz at the end, and AUTOTUNE=<that archive, carried with the
# working tree> restores them first, so that a later call on the same image compiles only the chosen configs.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$SECONDS
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [[ -n ${AUTOTUNE:-} ]]; then
  tar xzf "$AUTOTUNE" -C "$TRITON_CACHE_DIR" && echo "restored $(tar tzf "$AUTOTUNE" | wc -l) autotuning choices"
fi
save_autotune() { (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -); }
trap save_autotune EXIT
if compgen -G ".whl/*.whl" > /dev/null; then  # fla's wheels, carried with the working tree
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"

# 12 rows x 5 lengths, one warm-up step (Triton compilation, autotuning, AdamW's states) and 3 timed steps
python3 -m linmem.bench.models --peers --warmup 1 --steps 3 --budget-s 270 --out "$OUT/models" ${MODELS_ARGS:-} \
  2>&1 | grep -v "deprecated\|Writing\|Loading" | tee "$OUT/models.log"
echo "# models: $((SECONDS - start)) s since the start" | tee -a "$OUT/models.log"

# 13 rows (Llama dynamic + static, linmem dynamic + static probe, fla GLA) x 5 contexts; generate() at 2K and 32K
python3 -m linmem.bench.decode --peers --contexts 1024,2048,8192,32768,131072 --generate-contexts 2048,32768 \
  --warmup 2 --steps 10 --budget-s 170 --out "$OUT/decode" ${DECODE_ARGS:-} \
  2>&1 | grep -v "deprecated\|Writing\|Loading" | tee "$OUT/decode.log"
echo "# total: $((SECONDS - start)) s" | tee -a "$OUT/decode.log"
