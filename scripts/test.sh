#!/usr/bin/env bash
# Sets up, builds and runs every test. GPU tests skip with a printed reason when there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch-test-assets.sh
bash scripts/build.sh
cd build && ctest --output-on-failure -j "$(nproc)"
