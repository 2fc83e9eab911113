#!/usr/bin/env bash
# What the GPU machine runs from a bundle (scripts/bundle.sh build-cuda dist/rig): the GPU tests,
# rig doctor and rig watch for real, and the transformers/PEFT check of what rig writes.
# Results go to $OUT (or ./gpu-check-out).
set -uo pipefail
D=${RIG_BUNDLE:-dist/rig}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
"$D/rig_gpu_tests" 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE '^\[ +(RUN|OK) ' | tail -40
"$D/rig" doctor > "$OUT/doctor.txt" 2>&1; echo "doctor exit $?" >> "$OUT/doctor.txt"
"$D/rig" watch --iterations 3 --no-clear > "$OUT/watch.txt" 2>&1
"$D/rig" bench comm --op all_reduce --max-bytes 64M > "$OUT/bench_comm.txt" 2>&1
W=$(mktemp -d)
"$D/rig" train tests/data/configs/tiny-llama3-lora.yaml --quiet --output "$W/run" > "$OUT/train.txt" 2>&1
"$D/rig" merge --model tests/data/hf/tiny-llama3/model --adapter "$W/run/final" --out "$W/merged" >> "$OUT/train.txt" 2>&1
B=tests/data/hf/tiny-llama3/forward_backward.safetensors
"$D/rig" debug forward-backward --model "$W/merged" --batch $B --out "$W/merged.safetensors" >> "$OUT/train.txt" 2>&1
"$D/rig" debug forward-backward --model tests/data/hf/tiny-llama3/model --adapter "$W/run/final" --batch $B --out "$W/adapter.safetensors" >> "$OUT/train.txt" 2>&1
python3 scripts/check_with_transformers.py tests/data/hf/tiny-llama3/model "$W/run/final" "$W/merged" "$W" $B 2>&1 | tail -3 | tee "$OUT/transformers_check.txt"
