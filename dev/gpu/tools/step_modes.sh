#!/usr/bin/env bash
# The training step's modes on one GPU, in one device call (about 9 minutes on an H200):
#   1. the GPU tests of the step modes (compiled blocks and CUDA-graph micro-steps against eager, every model
#      kind, packed batches) and of static-cache decoding;
#   2. the 340M hybrid recipe on the default corpus: run.compile=true twice with one run.compile_cache (cold, then
#      warm), then eager and run.cuda_graph=true: the console's lines, compile_s and tokens/s from metrics.jsonl;
#   3. dev/gpu/tools/step_profile.py: wall, host and GPU time of a step, host time per launch, eager / compiled /
#      graph, and the eager step's costliest ops.
# Outputs under $OUT: env.txt, tests.log, recipe.log, step_profile.log, profile/.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
start=$SECONDS
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"

PARTS=${PARTS:-tests recipe profile}  # which of the three to run
if [[ $PARTS == *tests* ]]; then
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short ${TESTS:-tests/train/test_step_modes_gpu.py \
  tests/generation/test_static_cache_gpu.py} 2>&1 | grep -v "^SKIPPED" > "$OUT/tests.log"
tail -30 "$OUT/tests.log"
echo "# tests: $((SECONDS - start)) s"
fi

recipe() {  # $1: name of the run, then overrides
  name=$1; shift
  timeout $RECIPE_S python3 -m linmem.cli train --recipe hybrid-gdn-340m run.compile=true \
    data.text.dataset=null data.text.tokenizer=null schedule.steps=${STEPS:-30} schedule.warmup_steps=5 \
    run.log_every=10 run.save_every=0 run.eval_every=0 data.text.val_fraction=0.001 run.progress=false \
    run.compile_cache=/tmp/compile-cache run.out_dir=/tmp/runs/$name "$@" 2>&1 | grep -v "^compile: compiling" | tail -12
  grep -h '"tok_s"\|"mode"' /tmp/runs/$name/metrics.jsonl
}
if [[ $PARTS == *recipe* ]]; then
{ echo "## compiled, cold cache"; RECIPE_S=130 recipe cold; echo "## compiled, warm cache"; RECIPE_S=80 recipe warm
  echo "## eager"; RECIPE_S=70 recipe eager run.compile=false
  echo "## graph"; RECIPE_S=70 recipe graph run.compile=false run.cuda_graph=true
} 2>&1 | tee "$OUT/recipe.log"
echo "# recipe: $((SECONDS - start)) s"
fi

if [[ $PARTS == *profile* ]]; then
timeout ${PROFILE_S:-200} python3 dev/gpu/tools/step_profile.py --models ${PROFILE_MODELS:-gated_deltanet,hybrid} \
  --shapes ${PROFILE_SHAPES:-8x2048} --ops --out "$OUT/profile" 2>&1 | grep -v Warning | tee "$OUT/step_profile.log"
fi
echo "# total: $((SECONDS - start)) s"
