#!/usr/bin/env bash
# H200 session for the prebuilt artifacts (issue 5) and the attention pass end to end (issue 4). Results
# under $OUT, a short table last. STAGES picks stages, in this order (each under its own timeout; the bench
# scripts write their JSON after every mode, so a stage cut short keeps what it measured):
#   artifact   bench/artifact.py W1,W3: build one artifact with both buckets, then artifact (load -> first
#              step ready, CUDA graphs on/off), stock regional compile and omni-compile JIT, side by side
#   rest       the same bench's stock and omni modes only (when `artifact` ran out of time)
#   tests      every GPU test of the suite (CUDA graphs, the CUDA artifact, attention, kernels, passes)
#   w2         bench/e2e.py W2: stock vs omni-compile (attention pass, auto = cuDNN on an H200)
#   w1triton   bench/e2e.py W1 with the attention pass on our Triton kernel
# e.g. `STAGES=artifact bash bench/gpu_run8.sh`, then `STAGES="tests w2" bash bench/gpu_run8.sh`.
set -u
OUT=${OUT:-/tmp/out}
STAGES=" ${STAGES:-artifact tests w2} "
has() { [[ "$STAGES" == *" $1 "* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ART=bench/results/w1w3-artifact
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if has artifact; then
  timeout 570 python3 bench/artifact.py --workloads W1,W3 --steps 10 --warmup 3 --modes "${MODES:-build,artifact,stock,omni}" --art "$ART" \
    --json "$OUT/artifact.json" > "$OUT/artifact.txt" 2> "$OUT/artifact.log"
  echo "artifact bench rc=$?"
  mkdir -p "$OUT/w1w3-artifact" && cp -r "$ART/manifest.json" "$ART/report" "$OUT/w1w3-artifact/" 2>/dev/null
  du -sh "$ART" 2>/dev/null
fi
if has rest; then
  timeout 300 python3 bench/artifact.py --workloads W1,W3 --steps 10 --warmup 3 --modes stock,omni \
    --json "$OUT/artifact_rest.json" > "$OUT/artifact_rest.txt" 2> "$OUT/artifact_rest.log"
  echo "artifact bench (stock, omni) rc=$?"
fi
if has tests; then
  timeout 300 python3 -P -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
fi
if has w2; then
  timeout 200 python3 bench/e2e.py --workloads W2 --steps 5 --json "$OUT/e2e_w2.json" --modes "stock,omni" \
    2> "$OUT/e2e_w2.log" > "$OUT/e2e_w2.txt"
  echo "e2e W2 rc=$?"
fi
if has w1triton; then
  timeout 90 python3 bench/e2e.py --workloads W1 --steps 10 --json "$OUT/e2e_w1_triton.json" \
    --modes "omni/attn=TRITON_ATTN" 2> "$OUT/e2e_w1_triton.log" > "$OUT/e2e_w1_triton.txt"
  echo "e2e W1 triton rc=$?"
fi
echo "=== tables ==="
for f in artifact artifact_rest e2e_w2 e2e_w1_triton; do
  [ -s "$OUT/$f.txt" ] && { echo "--- $f"; cat "$OUT/$f.txt"; }
  [ -s "$OUT/$f.log" ] && grep -E "ERROR|Error|error:" "$OUT/$f.log" | tail -3
done
exit 0
