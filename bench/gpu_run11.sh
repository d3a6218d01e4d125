#!/usr/bin/env bash
# H200 session 11 (issues 6 and 8), one command of at most ~570 s; results under $OUT, a short table last.
#   STAGES (default "store serve"):
#   store   bench/store.py on W1 (flux-dev 1024x1024 bf16): `first` (empty file store: compiles and publishes)
#           and `second` (a second node, own empty Inductor cache: zero compiles and exports expected), then
#           `second` again SECOND_REPEAT times on the same store; artifacts kept in /tmp/w1store
#   serve   bench/serve.py on the second node's artifact: server start -> /health 200, then 1024x1024 x 28-step
#           requests through the server vs the same pipeline eager and with stock regional compile
#   tests   the suite's GPU tests, with whatever time is left
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
DEADLINE=${DEADLINE:-570}
STAGES=${STAGES:-"store serve"}
SECOND_REPEAT=${SECOND_REPEAT:-3}
left() { echo $(( DEADLINE - SECONDS )); }
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
KEEP=/tmp/w1store
if has store; then
  timeout $(( $(left) - 60 )) python3 -P bench/store.py --model flux-dev --shapes 1024x1024 --dtype bf16 --device cuda \
    --store "file://$KEEP/store" --modes first,second --keep "$KEEP" --json "$OUT/store_w1.json" \
    > "$OUT/store_w1.txt" 2> "$OUT/store_w1.log"
  echo "store bench rc=$? at ${SECONDS}s"
  timeout $(( $(left) - 60 )) python3 -P bench/store.py --model flux-dev --shapes 1024x1024 --dtype bf16 --device cuda \
    --store "file://$KEEP/store" --modes second --repeat "$SECOND_REPEAT" --keep "$KEEP/again" \
    --json "$OUT/store_w1_second.json" > "$OUT/store_w1_second.txt" 2>> "$OUT/store_w1.log"
  echo "second-node repeats rc=$? at ${SECONDS}s"
  [ -f "$KEEP/second-0/manifest.json" ] && cp "$KEEP/second-0/manifest.json" "$OUT/second_manifest.json"
fi
if has serve && [ -f "$KEEP/second-0/manifest.json" ] && [ "$(left)" -gt 150 ]; then
  timeout $(( $(left) - 30 )) python3 -P bench/serve.py --artifact "$KEEP/second-0" --steps 28 --reps 3 \
    --json "$OUT/serve_w1.json" > "$OUT/serve_w1.txt" 2> "$OUT/serve_w1.log"
  echo "serve bench rc=$? at ${SECONDS}s"
fi
if has tests && [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 10 )) python3 -P -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? at ${SECONDS}s"; tail -4 "$OUT/gpu_tests.log"
fi
echo "=== tables ==="
for f in store_w1 store_w1_second serve_w1; do
  [ -s "$OUT/$f.txt" ] && { echo "--- $f"; cat "$OUT/$f.txt"; }
done
grep -hE "Traceback|Error|error:" "$OUT"/*.log 2>/dev/null | tail -5
exit 0
