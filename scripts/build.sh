#!/usr/bin/env bash
# Configures and builds rig into build/ (CUDA backend when nvcc is found). RIG_BUILD_DIR names
# another folder; RIG_CMAKE_ARGS adds CMake options (-DRIG_CUDA=OFF, -DCMAKE_CUDA_ARCHITECTURES=89).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${RIG_BUILD_DIR:-build}
cmake -S . -B "$dir" -G Ninja ${RIG_CMAKE_ARGS:-} >/dev/null
cmake --build "$dir" -j "$(nproc)"
