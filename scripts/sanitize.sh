#!/usr/bin/env bash
# The unit tests (ctest label unit: rig_tests and the fuzz replay drivers) under AddressSanitizer
# and UndefinedBehaviorSanitizer, in a CPU-only build in build-asan; any report fails. Run by
# scripts/test.sh when RIG_UNIT_SANITIZED=1 (as CI does), or after it (it sets up and fetches the
# test assets).
# rig_tests runs directly (ctest's discovery of parameterised tests trips over sanitizer output),
# split into gtest shards that a pool of one job per core takes in turn (more shards than cores,
# so that one shard of long tests does not leave the other cores idle at the end); the fuzz
# replays run through ctest as one more job of the pool. Leak detection is off: process-lifetime
# singletons (cuBLASLt handles, caches) are deliberately never freed.
#   RIG_SANITIZE_JOBS (default: the number of cores), RIG_SANITIZE_SHARDS (default: 4 per job),
#   RIG_ASAN_BUILD_DIR (default: build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
b=${RIG_ASAN_BUILD_DIR:-build-asan}
# -O1: under ASan + UBSan, -O3 takes 2.4 times as long to compile (48 s against 20 s for
# trainer_setup.cpp), most of CI's time, for tests that run a few minutes either way.
cmake -S . -B "$b" -G Ninja -DRIG_CUDA=OFF -DRIG_SANITIZE=ON -DRIG_UNIT_TESTS=ON \
  -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" >/dev/null
ninja -C "$b" rig rig_tests fuzz_replays
jobs_max=${RIG_SANITIZE_JOBS:-$(nproc)}
shards=${RIG_SANITIZE_SHARDS:-$((4 * jobs_max))}
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1
rm -f "$b"/shard-*.log "$b"/shard-*.rc "$b"/fuzz.log "$b"/fuzz.rc
run_job() {  # NAME COMMAND...: output in $b/NAME.log, exit status in $b/NAME.rc
  local name=$1
  shift
  local rc=0
  "$@" >"$b/$name.log" 2>&1 || rc=$?
  echo "$rc" >"$b/$name.rc"
}
start=$SECONDS
names=(fuzz)
run_job fuzz ctest --test-dir "$b" -R '^fuzz_.*_replay$' --output-on-failure &
for ((i = 0; i < shards; i++)); do
  while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n || true; done
  names+=("shard-$i")
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
    run_job "shard-$i" "$b/tests/rig_tests" --gtest_brief=1 &
done
wait
rc=0
for name in "${names[@]}"; do
  if [ "$(cat "$b/$name.rc")" != 0 ]; then
    rc=1
    echo "sanitized unit tests: $name failed ($b/$name.log):"
    tail -n 80 "$b/$name.log"
  fi
done
count() {  # the summary lines of gtest: "[  PASSED  ] 12 tests.", "[  SKIPPED ] 1 test, listed below:"
  cat "$b"/shard-*.log |
    awk -v tag="$1" '$0 ~ "^\\[ +" tag " +\\] [0-9]+ tests?[.,]" { sub(/^[^]]*\] /, ""); n += $1 } END { print n + 0 }'
}
grep -h "tests passed" "$b/fuzz.log" || true
echo "sanitized unit tests: rig_tests $(count PASSED) passed, $(count SKIPPED) skipped, $(count FAILED) failed" \
  "($shards shards, $jobs_max at a time, $((SECONDS - start)) s)"
exit $rc
