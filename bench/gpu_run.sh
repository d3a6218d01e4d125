#!/usr/bin/env bash
# All GPU checks and measurements of one device session, results under $OUT, a short table last.
# Run on the GPU machine from the project root, after installing .whl/ and the project into /tmp/site:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
#     && export PYTHONPATH=/tmp/site && bash bench/gpu_run.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WORKLOADS=${WORKLOADS:-W1,W2}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/gpu.txt"

# 1. GPU tests of the suite (they skip on CPU machines). -P keeps the source tree off sys.path.
python3 -P -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

# 2. CLI smoke build on the GPU.
omni_build() { python3 -P -m omni_compile.cli build "$@"; }
omni_build flux-tiny --device cuda --dtype bf16 --out /tmp/flux-tiny-cuda --force -q --json > "$OUT/flux_tiny_cuda_report.json" \
  && echo "cli build on cuda: ok" || echo "cli build on cuda: FAILED"

# 3. End-to-end: eager vs stock regional compile vs omni-compile (cold and warm start).
python3 bench/e2e.py --workloads "$WORKLOADS" --json "$OUT/e2e.json" 2> "$OUT/e2e.log"
