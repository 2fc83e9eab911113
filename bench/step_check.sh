#!/usr/bin/env bash
# One device call that checks and measures the training step: the GPU tests (op harness, training
# against the CPU and Hugging Face, QLoRA, 8-bit AdamW), then rows 0, 2 and 3 of the plan side by
# side with transformers + PEFT, rig with the checkpointing each row is meant to use and the
# variants worth comparing, then a per-op table of each profiled rig step.
#
# usage: bench/step_check.sh OUTDIR   (from a bundle: dist/rig/rig and dist/rig/rig_gpu_tests;
#        RIG_TEST_DATA must point at tests/data)
set -u
out=${1:?usage: bench/step_check.sh OUTDIR}
mkdir -p "$out"
here=$(dirname "$0")
timeout 300 dist/rig/rig_gpu_tests --gtest_brief=1 > "$out/gpu_tests.log" 2>&1
echo "gpu tests rc $?"; grep -E "^\[  (FAILED|PASSED)" "$out/gpu_tests.log" | head -20
# rig's rows: row 0 full on the first 20 of 32 layers (the rest selective), row 2 selective,
# row 3 selective (memory target) and none (speed), each twice where autotuning may matter.
CKPT="0=full:20 2=selective 3=selective" ROWS=0,2,3 STEPS=3 bash "$here/rig_vs_hf.sh" "$out/a" rig
RIG_GEMM_AUTOTUNE=0 CKPT="0=full:20 3=none" ROWS=0,3 STEPS=3 bash "$here/rig_vs_hf.sh" "$out/b" rig
# The stream-ordered pool allocator against the caching one: the allocator tests and reserved
# peaks on row 0 and on the 8B QLoRA row (issue target: 12 GiB reserved).
RIG_CUDA_ALLOCATOR=pool timeout 120 dist/rig/rig_gpu_tests --gtest_filter='CudaAllocator*:GpuTraining.ActivationCheckpointing*' \
  > "$out/gpu_tests_pool.log" 2>&1; echo "pool allocator tests rc $?"
RIG_CUDA_ALLOCATOR=pool CKPT="0=full:20" ROWS=0 STEPS=3 bash "$here/rig_vs_hf.sh" "$out/c" rig
for alloc in caching pool; do
  RIG_CUDA_ALLOCATOR=$alloc timeout 120 dist/rig/rig bench train --device cuda --preset llama3-8b --method qlora \
    --seq 4096 --batch 2 --steps 2 --checkpointing --lora-targets q_proj,k_proj,v_proj,o_proj --json >> "$out/qlora8b.jsonl"
done
timeout 400 dist/rig/rig bench train --device cuda --preset llama3-70b --method qlora --seq 2048 --batch 1 \
  --steps 2 --checkpointing --lora-targets q_proj,k_proj,v_proj,o_proj --json >> "$out/qlora70b.jsonl"
ROWS=0,2,3 bash "$here/rig_vs_hf.sh" "$out/a" hf
for f in "$out"/a/rig.jsonl "$out"/b/rig.jsonl "$out"/c/rig.jsonl; do python3 "$here/op_table.py" "$f"; done
