#!/usr/bin/env bash
# Runs every libFuzzer target for SECONDS each (default 60) in a clang build (build-fuzz):
# safetensors headers, the training YAML, config.json, tokenizer.json, JSONL records, the
# checkpoint manifest and the bitsandbytes quant state. New inputs go to
# build-fuzz/tests/fuzz/corpus_NAME; a crash leaves
# crash-* in the current folder: fix it, then keep the input in tests/fuzz/corpus/NAME, where
# the unit tests (fuzz_NAME_replay) replay it from then on.
#   bash scripts/fuzz.sh [SECONDS] [NAME...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors train_yaml model_config tokenizer_json records_jsonl checkpoint_manifest quant_state)
CXX=clang++ CC=clang cmake -S . -B build-fuzz -G Ninja -DRIG_CUDA=OFF -DRIG_FUZZ=ON \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build-fuzz $(printf 'fuzz_%s ' "${targets[@]}")
for t in "${targets[@]}"; do
  work="build-fuzz/tests/fuzz/corpus_$t"
  mkdir -p "$work"
  seeds=()
  [ -d "tests/fuzz/corpus/$t" ] && seeds=("tests/fuzz/corpus/$t")
  echo "== fuzz_$t for ${seconds}s"
  build-fuzz/tests/fuzz/fuzz_"$t" -max_total_time="$seconds" -print_final_stats=1 "$work" "${seeds[@]}"
done
