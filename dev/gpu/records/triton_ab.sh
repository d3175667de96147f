#!/usr/bin/env bash
# Record: run 2026-11-26 on one H200 as `OUT=/tmp/out dev/gpu/records/triton_ab.sh`, the check of the
# Triton package's restructure; result: its printed A/B table, not kept in the repository.
# GPU check of the Triton package's restructure, in one run: the GPU suite of the Triton backend, then an A/B of
# three revisions of the kernel package at the shapes of `linmem bench ops` (fwd+bwd, H = 16, K = V = 128, bf16):
#   base   the starting commit (one kernel file per direction, number codes, stand-in pointers)
#   moved  the package split by stage with named switches (the same PTX as base, kernel for kernel)
#   head   the working tree: absent tensors passed as None (a new kernel signature), and the -inf gate floor
# The A/B prints each revision's time, its ratio to base and the largest difference of its outputs and gradients
# from base's (0: the same bits). Keep `None` for absent tensors only if head is no slower than moved.
#
#   OUT=/tmp/out dev/gpu/records/triton_ab.sh            # on the GPU machine, from the repository root
#
# The revisions come from git (BASE, MOVED: commits). Where the GPU machine's copy has no git history, run
# `dev/gpu/records/triton_ab.sh --prepare` in the checkout first: it writes them to dev/gpu/ab_revisions/
# (untracked, not ignored), which travels with the working tree and which the run then takes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BASE=${BASE:-95e1dd7}
MOVED=${MOVED:-f77f3c9}
PREPARED=dev/gpu/ab_revisions
extract() {  # extract LABEL COMMIT DEST: the commit's kernel package under DEST/LABEL
    mkdir -p "$3/$1" && git archive "$2" linmem/ops/recurrence/triton | tar -x -C "$3/$1"
}
if [ "${1:-}" = "--prepare" ]; then
    rm -rf "$PREPARED" && extract base "$BASE" "$PREPARED" && extract moved "$MOVED" "$PREPARED" && ls -R "$PREPARED" | head
    exit $?
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())" | tee "$OUT/env.txt"
REVS=$(mktemp -d)
if [ -d "$PREPARED/base" ] && [ -d "$PREPARED/moved" ]; then
    REVS=$PREPARED
elif ! { extract base "$BASE" "$REVS" && extract moved "$MOVED" "$REVS"; }; then
    echo "no git history here: run dev/gpu/records/triton_ab.sh --prepare in the checkout first" | tee "$OUT/ab.log"
    exit 1
fi
PKG=linmem/ops/recurrence/triton
status=0
# the GPU suite, sharded: compiling the kernels of each test takes most of its time
python3 dev/gpu/tools/test_shards.py tests/ops/test_recurrence_triton.py --shards 12 --log-dir "$OUT/shards" \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1
python3 dev/gpu/records/triton_ab.py --rev "base=$REVS/base/$PKG" --rev "moved=$REVS/moved/$PKG" --rev "head=$PKG" \
    2>&1 | tee "$OUT/ab.log" || status=1
# the per-channel decays' block products and pairwise paths (gates 10 and 100 times the bench's)
for gates in 10 100; do
    python3 dev/gpu/records/triton_ab.py --rev "base=$REVS/base/$PKG" --rev "moved=$REVS/moved/$PKG" --rev "head=$PKG" \
        --ops gla,rwkv6,kda --shapes 4x4096 --gates "$gates" 2>&1 | tee "$OUT/ab_gates$gates.log" || status=1
done
# fp16 and fp32 inputs at one shape
for dtype in fp16 fp32; do
    python3 dev/gpu/records/triton_ab.py --rev "base=$REVS/base/$PKG" --rev "moved=$REVS/moved/$PKG" --rev "head=$PKG" \
        --shapes 4x4096 --dtype "$dtype" --rounds 10 2>&1 | tee "$OUT/ab_$dtype.log" || status=1
done
exit $status
