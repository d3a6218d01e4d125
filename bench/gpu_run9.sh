#!/usr/bin/env bash
# H200 session 9 (issues 5 and 6), one command of at most ~570 s; results under $OUT, a short table last.
#   store     bench/store.py on W1 (flux-dev 1024x1024 bf16): `first` (empty file store: compiles and
#             publishes; the CUDA default format, Inductor standalone files) then `second` (a second node
#             with its own empty Inductor cache: zero compiles expected), artifacts kept in /tmp/w1store
#   artifact  bench/artifact.py W1 on the second node's artifact: load -> first step ready, step with CUDA
#             graphs on and off; then stock (eager + compile_repeated_blocks) side by side
#   tests     the suite's GPU tests, with whatever time is left
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - SECONDS )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
KEEP=/tmp/w1store
timeout $(( $(left) - 200 )) python3 -P bench/store.py --model flux-dev --shapes 1024x1024 --dtype bf16 --device cuda \
  --store "file://$KEEP/store" --modes first,second --keep "$KEEP" --json "$OUT/store_w1.json" \
  > "$OUT/store_w1.txt" 2> "$OUT/store_w1.log"
echo "store bench rc=$? at ${SECONDS}s"
for d in first-0 second-0; do
  [ -f "$KEEP/$d/manifest.json" ] && mkdir -p "$OUT/$d" && cp "$KEEP/$d/manifest.json" "$OUT/$d/"
done
if [ -f "$KEEP/second-0/manifest.json" ] && [ "$(left)" -gt 120 ]; then
  timeout $(( $(left) - 60 )) python3 -P bench/artifact.py --workloads W1 --steps 10 --warmup 3 --modes artifact,stock \
    --art "$KEEP/second-0" --json "$OUT/artifact_w1.json" > "$OUT/artifact_w1.txt" 2> "$OUT/artifact_w1.log"
  echo "artifact bench rc=$? at ${SECONDS}s"
fi
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) python3 -P -m pytest -q -m gpu tests -p no:cacheprovider -x > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? at ${SECONDS}s"; tail -4 "$OUT/gpu_tests.log"
fi
echo "=== tables ==="
for f in store_w1 artifact_w1; do
  [ -s "$OUT/$f.txt" ] && { echo "--- $f"; cat "$OUT/$f.txt"; }
  [ -s "$OUT/$f.log" ] && grep -E "ERROR|Error|error:" "$OUT/$f.log" | tail -3
done
exit 0
