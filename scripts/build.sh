#!/usr/bin/env bash
# Configures and builds rig into build/ (CUDA backend when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja ${RIG_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$(nproc)"
