#!/usr/bin/env bash
# The built-in demo: sets up, builds, and runs rig on the bundled tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/rig train configs/demo.yaml --output runs/demo-$(date +%Y%m%d-%H%M%S)
