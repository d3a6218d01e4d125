#!/usr/bin/env bash
# H200: `omni-compile inspect --profile` on CUDA (issue 7), one command of at most ~570 s; results under $OUT.
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
#     && export PYTHONPATH=/tmp/site && bash bench/gpu_inspect.sh
#   tiny  flux-tiny 64x64 on CUDA (fp32): our fused ops' Triton kernels in the kernel lists, a profile
#   w1    W1, flux-dev 1024x1024 bf16: the per-category profile table (docs/inspect.md)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/insp
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - SECONDS )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
run() {  # name, args...
  local name=$1; shift
  timeout $(( $(left) - 20 )) python3 -P -m omni_compile.cli inspect "$@" --profile \
    --out "/tmp/insp/$name" --html "/tmp/insp/$name/report.html" --json "/tmp/insp/$name/inspect.json" \
    > "/tmp/insp/$name.txt" 2>&1
  echo "$name rc=$? at ${SECONDS}s"
  cp "/tmp/insp/$name.txt" "$OUT/$name.log"
  [ -f "/tmp/insp/$name/profile.md" ] && cp "/tmp/insp/$name/profile.md" "$OUT/$name.profile.md"
}
run tiny flux-tiny --shapes 64x64 --device cuda
[ -f /tmp/insp/tiny/inspect.json ] && gzip -c /tmp/insp/tiny/inspect.json > "$OUT/tiny.inspect.json.gz"
run w1 flux-dev --shapes 1024x1024 --dtype bf16 --device cuda
[ -f /tmp/insp/w1/inspect.json ] && gzip -c /tmp/insp/w1/inspect.json > "$OUT/w1.inspect.json.gz"
[ -f /tmp/insp/w1/report.html ] && gzip -c /tmp/insp/w1/report.html > "$OUT/w1.report.html.gz"
echo "=== profiles ==="
for n in tiny w1; do [ -f "$OUT/$n.profile.md" ] && { echo "--- $n"; cat "$OUT/$n.profile.md"; }; done
tail -5 /tmp/insp/w1.txt
exit 0
