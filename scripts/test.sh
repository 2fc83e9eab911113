#!/usr/bin/env bash
# Sets up, builds and runs every test. GPU tests skip with a printed reason when there is no GPU.
#   RIG_BUILD_DIR      the build folder (default build/), as for scripts/build.sh
#   RIG_CMAKE_ARGS     CMake options for it (CI: -DCMAKE_CUDA_ARCHITECTURES=80, one architecture)
#   RIG_UNIT_SANITIZED=1 (CI sets it): the unit tests (ctest label unit) run once, under
#                      AddressSanitizer + UBSan in the CPU-only build-asan (scripts/sanitize.sh),
#                      instead of in the build folder, which then compiles everything else (rig,
#                      the CUDA backend, the GPU tests) and runs the tests that are not unit tests.
# Locally, `ctest -LE slow` in the build folder skips the slow multi-rank tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch-test-assets.sh
dir=${RIG_BUILD_DIR:-build}
if [ "${RIG_UNIT_SANITIZED:-0}" = 1 ]; then
  RIG_BUILD_DIR=$dir RIG_CMAKE_ARGS="${RIG_CMAKE_ARGS:-} -DRIG_UNIT_TESTS=OFF" bash scripts/build.sh
  (cd "$dir" && ctest --output-on-failure -j "$(nproc)" -LE unit)
  bash scripts/sanitize.sh
else
  RIG_BUILD_DIR=$dir RIG_CMAKE_ARGS="${RIG_CMAKE_ARGS:-} -DRIG_UNIT_TESTS=ON" bash scripts/build.sh
  cd "$dir" && ctest --output-on-failure -j "$(nproc)"
fi
