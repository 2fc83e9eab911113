#!/usr/bin/env bash
# The built-in demo: sets up, builds, and runs rig on the bundled tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if nvidia-smi -L >/dev/null 2>&1; then
  # A GPU is visible: the demo may train on it (device: auto), so build the CUDA backend.
  build=build
else
  # No GPU: the demo trains on the CPU, so skip the CUDA kernels for four architectures (most of
  # the ~8-minute first build on 2 cores). A folder of its own: build/'s CMake cache keeps the
  # CUDA backend for scripts/test.sh.
  build=build-cpu
  export RIG_CMAKE_ARGS="-DRIG_CUDA=OFF ${RIG_CMAKE_ARGS:-}"
fi
RIG_BUILD_DIR=$build bash scripts/build.sh
./$build/rig train configs/demo.yaml --output runs/demo-$(date +%Y%m%d-%H%M%S)
