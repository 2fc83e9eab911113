#!/usr/bin/env bash
# Prints the fault table of docs/reliability.md as the guard tests last measured it: each test in
# tests/unit/guard_test.cpp and guard_parallel_test.cpp writes its row to
# BUILD/reliability/NN-name.md and fails when the committed page lacks that exact row. After a
# change that moves a row, run the tests (build/tests/rig_tests --gtest_filter='Guard*') and
# paste this output over the table.
set -euo pipefail
build="${1:-build}"
dir="$build/reliability"
if ! compgen -G "$dir/*.md" >/dev/null; then
  echo "no rows in $dir: run build/tests/rig_tests --gtest_filter='Guard*' first" >&2
  exit 1
fi
echo "| fault injected | where | detected by | detection latency | recovery | steps redone | batches skipped | data lost | final weights |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
cat $(ls "$dir"/*.md | sort)
