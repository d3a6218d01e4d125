#!/usr/bin/env bash
# GPU session for the fusion passes and kernels (issue 3). One stage per device command, results
# under $OUT, a short table last. Run from the project root after installing .whl/ and the project
# into /tmp/site (see bench/gpu_run.sh):
#   bash bench/gpu_run3.sh kernels   # GPU tests (kernels vs float64 on W1/W2 shapes, tiny presets) + microbenchmarks
#   bash bench/gpu_run3.sh w1        # W1 end to end: stock vs omni-compile, all passes and one pass at a time
#   bash bench/gpu_run3.sh w2        # the same for W2
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-20}
# Mode syntax (bench/e2e.py): omni/SWITCH/.../OP=IMPL. omni/all/*=triton: every fusion pass with its
# Triton kernel; omni/none/+P/*=triton: only pass P (qk_norm_rope brings its own norms).
T='*=triton'
MODES=${MODES:-stock,omni,omni/all/$T,omni/none/+qk_norm_rope/+lower_fused_ops/$T,omni/none/+adaln/+lower_fused_ops/$T,omni/none/+gated_residual/+lower_fused_ops/$T,omni/none/+rms_norm/+lower_fused_ops/$T}
case "${1:-kernels}" in
  kernels)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/gpu.txt"
    python3 -P -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    python3 bench/kernels.py --json "$OUT/kernels.json" 2> "$OUT/kernels.log" | tee "$OUT/kernels.txt"
    ;;
  w1|w2)
    W=$(echo "$1" | tr a-z A-Z)
    python3 bench/e2e.py --workloads "$W" --modes "$MODES" --steps "$STEPS" --profile --json "$OUT/e2e_$1.json" 2> "$OUT/e2e_$1.log"
    ;;
  *) echo "usage: $0 kernels|w1|w2" >&2; exit 2 ;;
esac
