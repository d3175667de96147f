#!/usr/bin/env bash
# Whole-model training speed of the fused glue on one GPU, in one device call of at most ~9.5 minutes on an
# H100. Every stage runs under its own `timeout`, cut to what is left of TOTAL_S, and writes its log as it
# goes, so a run cut short keeps what it did:
#   1. correctness on CUDA: tests/layers/test_fused_glue.py (every mixer's fused path against its CPU form:
#      outputs, gradients and decoding; a packed model under torch.compile(fullgraph=True) equal to eager);
#   2. graph breaks: torch._dynamo.explain of 4-layer GLA, DeltaNet, Gated DeltaNet and hybrid models on a packed
#      batch (cu_seqlens), the count and the reasons;
#   3. torch.profiler of one training step of the ~370M DeltaNet and Gated DeltaNet at 8 x 2K (bf16 weights,
#      fused AdamW, as the bench runs them): the step's wall time, peak memory, the top 25 entries by GPU time;
#   4. linmem bench models --peers, eager: DeltaNet, Gated DeltaNet, hybrid, GLA and transformer (in that order,
#      each beside its fla / HF Llama peer) at T = 2K, 8K, 32K, 16K tokens a step;
#   5. --activation-checkpointing rows of DeltaNet, Gated DeltaNet and the hybrid at 32K and 64K;
#   6. --compile rows (with the eager ones beside) of DeltaNet at 2K, in what is left (compiling a 24-layer
#      model takes a minute or two per shape).
# fla is installed from .whl/*.whl when the working tree carries its wheels (no network on the device).
# Outputs under $OUT: env.txt, glue_tests.log, graph_breaks.log, profile.log, and models{,_ckpt,_compile}/ with
# {models.json,models.md} (rewritten after every cell) and models{,_ckpt,_compile}.log.
# Run from the repository root: OUT=/tmp/out bash dev/gpu/tools/model_speed.sh [STAGE...], STAGE one of glue_tests,
# graph_breaks, profile, models, models_ckpt, models_compile (default: all of them, in that order).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
TOTAL_S=${TOTAL_S:-560}  # the whole script's wall-clock cap (a device call allows 600 s)
mkdir -p "$OUT"
work=$(mktemp -d)  # the stages' Python scripts
start=$SECONDS
STAGES=" ${*:-glue_tests graph_breaks profile models models_ckpt models_compile} "

stamp() { echo "# $1: $((SECONDS - start)) s since the start" | tee -a "$2"; }
cap() {  # cap BUDGET: BUDGET seconds, or what is left of TOTAL_S if less (0: nothing left)
  local left=$((TOTAL_S - (SECONDS - start)))
  (( left < 0 )) && left=0
  echo $(( $1 < left ? $1 : left ))
}
run_stage() {  # run_stage NAME BUDGET CMD...: CMD under timeout, its output into $OUT/NAME.log as it comes
  local name=$1 limit
  limit=$(cap "$2")
  shift 2
  [[ $STAGES == *" $name "* ]] || return 0
  if (( limit <= 0 )); then echo "# $name: no time left" | tee "$OUT/$name.log"; return; fi
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  (( rc == 124 || rc == 137 )) && echo "# $name: stopped after its $limit s" >> "$OUT/$name.log"
  grep -v "deprecated\|Writing\|Loading\|^W1\|^I1" "$OUT/$name.log" | tail -40
  stamp "$name (exit $rc)" "$OUT/$name.log"
}

if compgen -G ".whl/*.whl" > /dev/null; then  # fla's wheels, carried with the working tree
  timeout 60 python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
timeout 60 python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())
try:
    import fla; print('fla', fla.__version__)
except ImportError as error:
    print('fla not importable:', error)" 2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"

# 1. correctness of the fused paths on CUDA (they run only there)
run_stage glue_tests 110 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/layers/test_fused_glue.py

# 2. graph breaks of whole models on a packed batch
cat > "$work/graph_breaks.py" <<'EOF'
import torch

from linmem.bench.peers import ModelShape, build_model

shape = ModelShape(num_layers=4)
ids = torch.randint(0, shape.vocab_size, (1, 4096), device="cuda")
cu = torch.tensor([0, 1000, 2500, 4096], device="cuda")
for key in ("gla", "deltanet", "gated_deltanet", "hybrid"):
    torch._dynamo.reset()
    model = build_model(key, shape)[0].train()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, cu_seqlens=cu, use_cache=False)
    print(f"{key:16s} graphs: {explained.graph_count}, graph breaks: {explained.graph_break_count}", flush=True)
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame else "?"
        print(f"    {str(reason.reason).splitlines()[0][:150]} at {where}", flush=True)
EOF
run_stage graph_breaks 80 python3 "$work/graph_breaks.py"

# 3. the profile of one training step
cat > "$work/step_profile.py" <<'EOF'
import time

import torch
from torch.profiler import ProfilerActivity, profile

from linmem.bench.peers import ModelShape, build_model

for key in ("deltanet", "gated_deltanet"):
    torch.manual_seed(0)
    model = build_model(key, ModelShape())[0].train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 32000, (8, 2048), device="cuda")

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # Triton compilation and autotuning, AdamW's states
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - begin) * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    sort = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(f"== {key}, 8 x 2048, ~370M, bf16 weights: step {wall_ms:.0f} ms wall ({8 * 2048 / wall_ms:.1f} "
          f"ktok/s), peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB; the GPU total is the table's last line")
    print(events.table(sort_by=sort, row_limit=25, max_name_column_width=70), flush=True)
    del model, optimizer
    torch.cuda.empty_cache()
EOF
run_stage profile 70 python3 "$work/step_profile.py"

bench() {  # bench NAME BUDGET ARGS...: linmem bench models starting no cell after BUDGET s, stopped 60 s later
  local name=$1 budget
  budget=$(cap "$2")
  shift 2
  [[ $STAGES == *" $name "* ]] || return 0
  if (( budget <= 0 )); then echo "# $name: no time left" | tee "$OUT/$name.log"; return; fi
  run_stage "$name" $((budget + 60)) python3 -m linmem.bench.models --warmup 1 --steps 3 --budget-s "$budget" \
    --out "$OUT/$name" "$@"
}
# 4. 10 rows x 3 lengths; 5. 3 rows x 2 lengths; 6. one model, one length, eager and compiled
bench models 170 --models deltanet,gated_deltanet,hybrid,gla,transformer --peers --seq-lens 2048,8192,32768
bench models_ckpt 40 --models deltanet,gated_deltanet,hybrid --seq-lens 32768,65536 --activation-checkpointing
bench models_compile $(( $(cap 1000) - 70 )) --models deltanet --seq-lens 2048 --compile
echo "# total: $((SECONDS - start)) s" | tee -a "$OUT/env.txt"
