#!/usr/bin/env bash
# The unit tests under AddressSanitizer and UndefinedBehaviorSanitizer (a CPU-only build in
# build-asan; any report fails). Run after scripts/test.sh, which sets up and fetches test assets.
# The test binary runs directly: ctest's discovery of parameterised tests trips over sanitizer
# output. Leak detection is off: process-lifetime singletons (cuBLASLt handles, caches) are
# deliberately never freed.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-asan -G Ninja -DRIG_CUDA=OFF -DRIG_SANITIZE=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build-asan rig rig_tests
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  OMP_WAIT_POLICY=PASSIVE build-asan/tests/rig_tests --gtest_brief=1
