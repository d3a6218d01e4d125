#!/usr/bin/env bash
# One H200 session for the attention backends (issue 4), sized for ~6 minutes of device time; results
# under $OUT, a short table last. Stages run cheapest-and-most-needed first, each under its own timeout,
# so a cut-off run still leaves the earlier results:
#   1. attention microbenchmark: every backend installed here on the W1/W2/odd shapes (time, TFLOP/s,
#      error vs float64);
#   2. the GPU tests of the attention backends, kernels and pass;
#   3. W1 and W2 end to end: stock regional compile vs omni-compile with auto attention (cuDNN on an H200
#      without FlashAttention), W1 with a profile (kernels per step by category); then W1 with TRITON_ATTN.
# FlashAttention is not installed on this image and not carried: FLASH_ATTN is skipped (see bench/gpu_run6.sh
# for the FA4 session).
# STAGES (default "bench tests w1 w2 w1triton") picks stages, in that order, for a lease with less time.
set -u
OUT=${OUT:-/tmp/out}
STAGES=" ${STAGES:-bench tests w1 w2 w1triton} "
has() { [[ "$STAGES" == *" $1 "* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
has bench && timeout 90 python3 bench/attention.py --json "$OUT/attention.json" 2> "$OUT/attention.log" > "$OUT/attention.txt"
echo "attention bench rc=$?"
has tests && timeout 100 python3 -P -m pytest -q -m gpu tests/test_attention.py tests/test_attention_kernels.py \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
has w1 && timeout 90 python3 bench/e2e.py --workloads W1 --steps 10 --profile --json "$OUT/e2e_w1.json" \
  --modes "stock,omni" 2> "$OUT/e2e_w1.log" > "$OUT/e2e_w1.txt"
echo "e2e W1 rc=$?"
has w2 && timeout 110 python3 bench/e2e.py --workloads W2 --steps 5 --json "$OUT/e2e_w2.json" \
  --modes "stock,omni" 2> "$OUT/e2e_w2.log" > "$OUT/e2e_w2.txt"
echo "e2e W2 rc=$?"
has w1triton && timeout 60 python3 bench/e2e.py --workloads W1 --steps 10 --json "$OUT/e2e_w1_triton.json" \
  --modes "omni/attn=TRITON_ATTN" 2> "$OUT/e2e_w1_triton.log" > "$OUT/e2e_w1_triton.txt"
echo "e2e W1 triton rc=$?"
echo "=== attention (bf16) ==="; cat "$OUT/attention.txt" 2>/dev/null
echo "=== e2e ==="; tail -q -n 5 "$OUT"/e2e_*.txt 2>/dev/null
