#!/usr/bin/env bash
# The static cache and CUDA-graph decoding on one GPU, in one device call (about 8 minutes on an H100):
#   1. the GPU tests of tests/generation: a graph replay equals the eager step and never synchronises with the
#      host, generate(cache_implementation="static") gives the dynamic cache's tokens, a long prompt prefills in
#      chunks (about a minute, most of it Triton compiling);
#   2. linmem bench decode --peers: ms/token and memory versus context, batch 8, every linmem model with its own
#      (dynamic) cache and through generate(cache_implementation="static"), beside HF Llama (dynamic and static
#      cache) and fla's GLA, with plots. The static rows are timed through generate() at every context.
# The bench prints one JSON line per cell and rewrites its JSON after every cell, so a run cut short keeps what it
# measured; --budget-s stops starting cells past that many seconds. Outputs: $OUT/env.txt, $OUT/tests.log,
# $OUT/decode/{decode.json,decode.md,*.png}, $OUT/decode.log. DECODE_ARGS="..." is appended (so it overrides),
# e.g. DECODE_ARGS="--models gla,hybrid --peers llama".
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$SECONDS
if compgen -G ".whl/*.whl" > /dev/null; then  # fla's wheels, carried with the working tree
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"

python3 -m pytest -q -m gpu tests/generation -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/tests.log"
echo "# tests: $((SECONDS - start)) s since the start" | tee -a "$OUT/tests.log"

# 13 rows (Llama dynamic + static, 5 linmem models dynamic + static, fla GLA) x 5 contexts; the dynamic rows also
# through generate() at 2K and 32K
python3 -m linmem.cli bench decode --peers --contexts 1024,2048,8192,32768,131072 --generate-contexts 2048,32768 \
  --warmup 2 --steps 10 --budget-s 300 --out "$OUT/decode" ${DECODE_ARGS:-} \
  2>&1 | grep -v "deprecated\|Writing\|Loading" | tee "$OUT/decode.log"
echo "# total: $((SECONDS - start)) s" | tee -a "$OUT/decode.log"
