#!/usr/bin/env bash
# Prepares FlashAttention-4 (flash-attn-4, CuTe DSL) for the GPU machine, whose image lacks it and cannot
# download. Run from the project root after ../shared/tools/gpu-wheels.sh fa3-fwd==0.0.3 (which fills .whl/):
#
#   bash bench/fa4_wheels.sh
#
# It adds FA4's small wheels to .whl/ (about 10 MB) and packs the CUTLASS DSL's CUDA 13 libraries into
# .fa4/cu13.tar.xz (about 61 MB): too big to travel with .whl in one call (64 MiB a call), so a first device
# call carries .fa4 alone and unpacks it on the machine, and the next call, on the same warm machine,
# carries .whl:
#
#   run(carry=[".fa4"], command="bash bench/gpu.sh fa4libs")
#   run(carry=[".whl"], command="bash bench/gpu.sh install attention ...")     # at once: warm for 30 s
set -euo pipefail
for d in .whl .fa4; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
mkdir -p .whl .fa4
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# The image has torch, cuda-bindings, einops, protobuf and typing-extensions; these are what it lacks.
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP" nvidia-cutlass-dsl-libs-cu13==4.8.1
mkdir "$TMP/libs" && (cd "$TMP/libs" && python3 -m zipfile -e "$TMP"/nvidia_cutlass_dsl_libs_cu13-*.whl .)
tar -C "$TMP/libs" -cf - . | xz -9 -T2 > .fa4/cu13.tar.xz
du -sh .whl .fa4
