#!/usr/bin/env bash
# Second GPU session: W2 stock vs omni measured twice each (is the 1% gap noise?), kernel profiles of
# W1/W2, and the CLI's cold vs warm-start build of W1 (flux-dev 1024x1024).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/e2e.py --workloads W2 --modes stock,omni,stock,omni --steps 20 --profile --json "$OUT/w2_repeat.json" 2> "$OUT/w2_repeat.log"
python3 bench/e2e.py --workloads W1 --modes stock,omni --steps 20 --profile --json "$OUT/w1_profile.json" 2> "$OUT/w1_profile.log"
for kind in cold warm; do
  extra=(); [ "$kind" = warm ] && extra=(--cache-from /tmp/w1-cold)
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cli-$kind python3 -P -m omni_compile.cli build flux-dev --shapes 1024x1024 \
    --out /tmp/w1-$kind --force -q --json "${extra[@]}" > "$OUT/w1_cli_$kind.json" 2> "$OUT/w1_cli_$kind.log" \
    && python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('cli $kind:', r['buckets'][0]['first_call_seconds'], 's first call,', r['totals'])" "$OUT/w1_cli_$kind.json"
done
