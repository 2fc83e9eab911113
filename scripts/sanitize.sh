#!/usr/bin/env bash
# The unit tests under AddressSanitizer and UndefinedBehaviorSanitizer (a CPU-only build in
# build-asan; any report fails). Run after scripts/test.sh, which sets up and fetches test assets.
# The test binary runs directly (ctest's discovery of parameterised tests trips over sanitizer
# output), split into one gtest shard per core run side by side. Leak detection is off:
# process-lifetime singletons (cuBLASLt handles, caches) are deliberately never freed.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-asan -G Ninja -DRIG_CUDA=OFF -DRIG_SANITIZE=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build-asan rig rig_tests
shards=$(nproc)
pids=()
for ((i = 0; i < shards; i++)); do
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
    build-asan/tests/rig_tests --gtest_brief=1 > "build-asan/shard-$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for ((i = 0; i < shards; i++)); do
  if ! wait "${pids[$i]}"; then
    rc=1
    echo "sanitized tests, shard $i of $shards, failed:"
    tail -n 80 "build-asan/shard-$i.log"
  fi
done
for ((i = 0; i < shards; i++)); do tail -n 3 "build-asan/shard-$i.log"; done
exit $rc
