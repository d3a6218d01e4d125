#!/usr/bin/env bash
# The GPU runner: every measurement and GPU check of a session, by stage, in one command on the GPU machine;
# results under $OUT, a short table last. Run from the project root with the wheels of
# ../shared/tools/gpu-wheels.sh fa3-fwd==0.0.3 torchao==0.18.0 prometheus-client==0.26.0 in .whl/ (torchao: stock-fp8;
# prometheus-client: the server); to try FA4 too, bench/fa4_wheels.sh adds its wheels
# there and packs its CUDA libraries into .fa4/cu13.tar.xz, which travels alone in a first call:
#
#   bash bench/gpu.sh fa4libs                       # carry [".fa4"]: it stays in the machine's tree copy
#   bash bench/gpu.sh install attention tests w3    # carry [".whl"], at once (the machine stays warm 30 s)
#   bash bench/gpu.sh install e2e
#
# Stages:
#   fa4libs    unpack .fa4/cu13.tar.xz into /tmp/fa4libs (it stays there while the machine is warm)
#   install    the wheels and omni-compile into /tmp/site (every later stage of the call needs it), and FA4's
#              CUDA libraries from /tmp/fa4libs (a fa4libs call before) into the same package folders
#   attention  bench/attention.py: every backend that runs here on the W1/W2/W3, LTX key-bias and odd shapes
#              (ATTN_BACKENDS, ATTN_ONLY: parts of shape names, comma-separated, ATTN_ARGS: more options, e.g. --sweep)
#   tests      GPU tests of the suite (TESTS_MARK, default gpu; TESTS_K, a -k expression; TESTS, default: attention backends vs float64, the measured choice and
#              FA3/FA4 in the pass, gemm_gelu, CUDA graphs, GPU artifacts; `pytest -m gpu tests` is all of them)
#   w3         bench/e2e.py on W3 (FLUX 512²): stock, stock-fa3, omni, omni with whole-step CUDA graphs
#   e2e        bench/e2e.py on W1, then W2 (E2E_WORKLOADS, E2E_MODES), with a profile of the modes in E2E_PROFILE (default
#              omni,stock-fa3: kernel categories, GEMMs by shape, the device timeline)
#   w5         bench/e2e.py on W5-ltx (LTX-Video 2B) and W5-hunyuan (HunyuanVideo 13B) (and, named in W5, W5-cogview4:
#              CogView4 6B-sized, LayerNorm QK-norm), families without an adapter:
#              stock, stock-fa3, omni (W5, W5_MODES, or W5_MODES_W5_ltx / W5_MODES_W5_hunyuan for one of them)
#   imports    bench/imports.py: Python start and each import of a server, fresh processes, with and without a
#              bytecode cache in /tmp/pyc
#   artifact   bench/artifact.py on W1 and W3: build, load -> first step, steps with and without CUDA graphs, stock,
#              omni JIT, build --dynamic (ARTIFACT_MODES, ARTIFACT_WORKLOADS, ARTIFACT_DYNAMIC; ARTIFACT_DIR keeps it)
#   store      bench/store.py on W1: a first node publishes to a file store, a second node takes every file
#   serve      bench/serve.py on SERVE_ART (default: the store stage's second-node W1 artifact): start -> /health,
#              per request, SERVE_CONCURRENT (32) requests at once; SERVE_ARGS: more options (e.g. --modes server)
#   video      bench/serve.py on VIDEO_ART (default /tmp/w2art: `ARTIFACT_WORKLOADS=W2 ARTIFACT_DIR=/tmp/w2art` in the
#              artifact stage before), a Wan artifact served as text-to-video: start -> /health, video jobs of
#              VIDEO_STEPS (50) steps, MP4 downloaded (needs PyAV: `av` in /tmp/site); VIDEO_ARGS: more options
#   kernels    bench/fused_ops.py: each fused-op kernel against stock Inductor on the W1/W2 shapes (KERNELS_ARGS:
#              more options, e.g. --only rms_norm_rope --sweep)
#   fp8        bench/e2e.py on W1 and W2 (FP8_WORKLOADS): stock, omni, omni/fp8, stock-fp8 (torchao float8 rowwise
#              on the same Linears), FP8_MODES to change them, FP8_PROFILE the modes profiled; lossy: rel L2 against
#              eager bf16 in the table
#   stepcache  bench/step_cache.py on the W1-sized FLUX pipeline (1024², 28 steps): each step cache setting's
#              seconds per image, computed share, one-step and final-latent rel L2, PSNR (STEP_CACHE_ARGS: more
#              options, e.g. --fp8 for every setting again with fp8 GEMMs)
#   inspect    `omni-compile inspect flux-dev --profile` at 1024x1024: the per-category profile
# Env: DEADLINE (s, default 570) stops starting new work near the end; each stage writes its JSON and log
# as it goes, so a stage cut short keeps what it measured.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
DEADLINE=${DEADLINE:-570}
left() { echo $(( DEADLINE - SECONDS )); }
run() {  # run NAME TIMEOUT CMD...: stdout to $OUT/NAME.txt, stderr to $OUT/NAME.log
  local name=$1 t=$2; shift 2
  if [ "$(left)" -lt 30 ]; then echo "skip $name: ${SECONDS}s of ${DEADLINE}s used"; return; fi
  [ "$t" -gt $(( $(left) - 10 )) ] && t=$(( $(left) - 10 ))
  timeout "$t" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log"
  echo "$name rc=$? at ${SECONDS}s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for stage in "$@"; do
  case $stage in
    fa4libs)
      # unpacked at once into /tmp/fa4libs, which stays on the warm machine (the tree copy's .fa4 does not);
      # `install` merges it into the package folders after the wheels (pip --upgrade replaces whole folders)
      mkdir -p /tmp/fa4libs && xz -dc .fa4/cu13.tar.xz | tar -x -C /tmp/fa4libs && echo "fa4libs unpacked at ${SECONDS}s" ;;
    install)
      # SKIP_WHEELS: a regex of wheel names to leave out (e.g. flash_attn_4, to run without FA4); WHEELS: the
      # folder of wheels (default .whl; another git-ignored folder carried instead when .whl would pass 64 MiB)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        $(ls "${WHEELS:-.whl}"/*.whl | grep -vE "${SKIP_WHEELS:-^$}") \
        && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
      # bytecode as a normal install writes it: a process started later does not compile these packages from source
      python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
      [ -d /tmp/fa4libs ] && cp -a /tmp/fa4libs/. /tmp/site/ && echo "FA4's CUDA libraries merged"
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      # the CUTLASS DSL puts its `cutlass` package on sys.path from a .pth file, which a --target folder on
      # PYTHONPATH does not run: FA4 imports only with that folder named here
      [ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
      python3 -P -c "from omni_compile.attention.backends import import_error as e; print({m: e(m) or 'ok' for m in ('fa3_fwd_interface', 'flash_attn.cute', 'diffusers')})" \
        | tee -a "$OUT/gpu.txt"
      echo "install at ${SECONDS}s" ;;
    imports)
      # Python start and each import in fresh processes, then again with a bytecode cache outside the packages
      run imports 120 python3 -P bench/imports.py --reps "${IMPORTS_REPS:-3}" --json "$OUT/imports.json"
      run imports_pyc 120 python3 -P bench/imports.py --reps "${IMPORTS_REPS:-3}" --pycache-prefix /tmp/pyc --json "$OUT/imports_pyc.json" ;;
    attention)
      run attention 150 python3 -P bench/attention.py --backends "${ATTN_BACKENDS:-sdpa,sdpa-cudnn,fa3,fa4,triton}" \
        ${ATTN_ONLY:+--only "$ATTN_ONLY"} ${ATTN_ARGS:-} --reps 20 --json "$OUT/attention.json" ;;
    tests)
      A=tests/test_attention.py
      TESTS=${TESTS:-"$A::test_backends_match_float64_on_cuda $A::test_measured_choice_on_cuda
        $A::test_attention_pass_on_cuda[FA3_ATTN] $A::test_attention_pass_on_cuda[FA4_ATTN] tests/test_gemm_gelu.py
        tests/test_cuda_graphs.py tests/test_artifact_gpu.py"}
      # shellcheck disable=SC2086
      MARK=${TESTS_MARK-gpu}  # TESTS_MARK='' runs the named tests whatever their marker (CPU tests under this torch)
      # the default set takes about 7 minutes on an H100 (run 16): alone in a call, with TESTS_TIMEOUT=500
      run gpu_tests "${TESTS_TIMEOUT:-330}" python3 -P -m pytest -q -rfs --tb=short ${MARK:+-m "$MARK"} ${TESTS_K:+-k "$TESTS_K"} $TESTS \
        -p no:cacheprovider --timeout 280
      tail -3 "$OUT/gpu_tests.txt" ;;
    w3)
      run e2e_w3 240 python3 -P bench/e2e.py --workloads W3 --modes stock,stock-fa3,omni,omni/cg \
        --json "$OUT/e2e_w3.json" ;;
    e2e)
      E2E_MODES=${E2E_MODES:-"stock,stock-fa3,omni,omni/cg,omni/fuse,eager"}
      for w in ${E2E_WORKLOADS:-W1 W2}; do
        run "e2e_$w" 280 python3 -P bench/e2e.py --workloads "$w" --modes "$E2E_MODES" --profile-modes "${E2E_PROFILE:-omni,stock-fa3}" \
          --json "$OUT/e2e_$w.json"
      done ;;
    w5)
      # families without an adapter (issue 19): LTX-Video 2B and HunyuanVideo 13B, generic adapter; three modes of
      # HunyuanVideo (one process each: 13B random weights, compile, steps) take about 6 minutes
      for w in ${W5:-W5-ltx W5-hunyuan}; do
        t=280; [ "$w" = W5-hunyuan ] && t=420
        own="W5_MODES_${w//-/_}"  # e.g. W5_MODES_W5_hunyuan: this workload's modes
        run "e2e_$w" "$t" python3 -P bench/e2e.py --workloads "$w" --modes "${!own:-${W5_MODES:-stock,stock-fa3,omni}}" \
          --profile-modes omni --json "$OUT/e2e_$w.json"
      done ;;
    artifact)
      # ARTIFACT_MODES (default: all four; build-dynamic,dynamic: `build --dynamic ARTIFACT_DYNAMIC`), ARTIFACT_DIR:
      # keep the built artifact there (a later command reuses it), ARTIFACT_WORKLOADS (default W1,W3)
      run artifact 540 python3 -P bench/artifact.py --workloads "${ARTIFACT_WORKLOADS:-W1,W3}" \
        --modes "${ARTIFACT_MODES:-build,artifact,stock,omni}" --dynamic "${ARTIFACT_DYNAMIC:-768-1280:64}" \
        ${ARTIFACT_DIR:+--art "$ARTIFACT_DIR"} --json "$OUT/artifact.json" ;;
    store)
      run store 400 python3 -P bench/store.py --model flux-dev --shapes 1024x1024 --dtype bf16 --device cuda \
        --store file:///tmp/w1store/store --modes first,second --keep /tmp/w1store --json "$OUT/store.json" ;;
    serve)
      # shellcheck disable=SC2086
      run serve 420 python3 -P bench/serve.py --artifact "${SERVE_ART:-/tmp/w1store/second-0}" --steps 28 --reps 3 \
        --concurrent "${SERVE_CONCURRENT:-32}" ${SERVE_ARGS:-} --json "$OUT/serve.json" ;;
    video)
      # shellcheck disable=SC2086
      run video 420 python3 -P bench/serve.py --artifact "${VIDEO_ART:-/tmp/w2art}" --steps "${VIDEO_STEPS:-50}" \
        --reps 1 --warmup 0 --modes server ${VIDEO_ARGS:-} --json "$OUT/video.json" ;;
    fp8)
      for w in ${FP8_WORKLOADS:-W1 W2}; do
        run "fp8_$w" 400 python3 -P bench/e2e.py --workloads "$w" --modes "${FP8_MODES:-stock,omni,omni/fp8,stock-fp8}" \
          --profile-modes "${FP8_PROFILE:-}" --json "$OUT/fp8_$w.json"
      done ;;
    stepcache)
      # shellcheck disable=SC2086
      run step_cache 420 python3 -P bench/step_cache.py --preset flux-dev --device cuda --reps 2 ${STEP_CACHE_ARGS:-} \
        --json "$OUT/step_cache.json" ;;
    kernels)
      # shellcheck disable=SC2086
      run kernels 300 python3 -P bench/fused_ops.py ${KERNELS_ARGS:-} --json "$OUT/kernels.json" ;;
    inspect)
      run inspect 300 python3 -P -m omni_compile.cli inspect flux-dev --shapes 1024x1024 --dtype bf16 --device cuda \
        --profile --out /tmp/insp --json "$OUT/inspect.json" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
# one file for every stage's stderr: at most 8 files come back from $OUT
for f in "$OUT"/*.log; do [ -s "$f" ] && { echo "=== $(basename "$f")"; cat "$f"; }; done > "$OUT/stderr.txt"
rm -f "$OUT"/*.log
echo "=== tables ==="
for f in imports imports_pyc attention kernels e2e_w3 e2e_W1 e2e_W2 e2e_W5-ltx e2e_W5-hunyuan fp8_W1 fp8_W2 step_cache artifact store serve video inspect; do
  [ -s "$OUT/$f.txt" ] && { echo "--- $f"; cat "$OUT/$f.txt"; }
done
grep -hE "Traceback|Error|error:" "$OUT/stderr.txt" 2>/dev/null | sort | uniq -c | sort -rn | head -8
[ -s "$OUT/gpu_tests.txt" ] && { echo "--- gpu_tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -25; }
exit 0
