#!/usr/bin/env bash
# GPU session for the attention backends (issue 4), results under $OUT, a short table last. Two stages,
# one device command each, run back to back on one machine (FlashAttention-4 and its CuTe DSL libraries are
# 68 MB of xz, more than one command carries: stage a brings the first half, stage b the second):
#   bash bench/gpu_run6.sh a   # GPU tests; attention microbenchmark without FlashAttention (+ Triton tiling sweep)
#   bash bench/gpu_run6.sh b   # FA4 unpacked: microbenchmark with it; W1/W2 end to end with each backend
# The .fa4a/.fa4b halves are `split -n 2` of a tar.xz of the unpacked wheels flash-attn-4 4.0.0b36,
# nvidia-cutlass-dsl 4.8.1 (+ libs-base, libs-cu13), quack-kernels 0.6.5, apache-tvm-ffi 0.1.15.post2,
# torch-c-dlpack-ext 0.1.5 (cp312, manylinux_2_28).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-a}" in
  a)
    cp .fa4a/part00 /tmp/fa4.part00 2>/dev/null || echo "no .fa4a: stage b will skip FlashAttention-4"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    timeout 300 python3 -P -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
    timeout 200 python3 bench/attention.py --sweep --json "$OUT/attention_a.json" 2> "$OUT/attention_a.log" | tee "$OUT/attention_a.txt"
    ;;
  b)
    if [ -f /tmp/fa4.part00 ] && [ -f .fa4b/part01 ]; then
      mkdir -p /tmp/fa4site && cat /tmp/fa4.part00 .fa4b/part01 | xz -d | tar xf - -C /tmp/fa4site \
        && export PYTHONPATH=/tmp/fa4site:${PYTHONPATH:-}
      timeout 120 python3 -c "import flash_attn.cute as f; print('flash_attn.cute', getattr(f, '__version__', '?'))" 2>&1 | tail -3 | tee "$OUT/fa4_import.txt"
      timeout 200 python3 bench/attention.py --backends flash,sdpa-cudnn --json "$OUT/attention_b.json" 2> "$OUT/attention_b.log" | tee "$OUT/attention_b.txt"
    fi
    python3 -P -m omni_compile.cli attention --device cuda --head-dim 128 | tee "$OUT/attention_listing.txt"
    for W in w1 w2; do
      timeout 230 python3 bench/e2e.py --workloads "${W^^}" --steps 20 --profile --json "$OUT/e2e_$W.json" \
        --modes "stock,omni,omni/attn=CUDNN_ATTN,omni/attn=TRITON_ATTN" 2> "$OUT/e2e_$W.log" | tee "$OUT/e2e_$W.txt"
    done
    ;;
  *) echo "usage: $0 a|b" >&2; exit 2 ;;
esac
