#!/usr/bin/env bash
# One device call: GPU tests of the routed layers, `linmem bench layers`, and the MoM vs
# single-memory MQAR study on CUDA. Logs go to $OUT (the device tool brings them back).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/layers/test_moe.py tests/layers/test_mom.py 2>&1 \
  | tail -5 | tee "$OUT/gpu_tests.log"
python3 -m linmem.cli bench layers 2>&1 | grep -v "Writing\|Loading" | tee "$OUT/bench_layers.log"
python3 -m linmem.cli demo --mom --device cuda --out /tmp/mom 2>&1 | grep -v "Writing\|Loading" | tee "$OUT/mom_mqar.log"
