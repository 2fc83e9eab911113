#!/usr/bin/env bash
# Several ranks on one GPU, end to end (run from the repository root on the GPU machine, from a
# bundle: dist/rig/rig and dist/rig/rig_gpu_tests):
#   1. the shared-GPU tests (staged collectives; 2 and 4 ranks against one, bf16, ddp and sharded)
#   2. llama3-8b QLoRA and LoRA data-parallel on 2 ranks sharing the GPU against 1 rank
#   3. the seeds' flagship shape: llama3-70b QLoRA sharded over 4 ranks, max_memory 22GiB each
#   c. rig bench comm with 4 ranks on the GPU (CUDA IPC device buffers, then shared host memory)
# usage: bench/multirank.sh OUTDIR [parts, default "1 2 3"] (STEPS70 sets part 3's steps; 2q and 2l
#        run part 2 for QLoRA or LoRA alone; bf16 LoRA of 8B at micro-batch 2 needs more than 22 GiB,
#        so the LoRA runs have no cap)
set -uo pipefail
out=${1:?usage: bench/multirank.sh OUTDIR [parts]}
parts=${2:-1 2 3}
R=${RIG:-dist/rig/rig}
T=${RIG_GPU_TESTS:-dist/rig/rig_gpu_tests}
mkdir -p "$out"
export RIG_TEST_DATA=$PWD/tests/data RIG_SOURCE_DIR=$PWD RIG_BUILD_DIR=${TMPDIR:-/tmp}/rig-build
mkdir -p "$RIG_BUILD_DIR"
data=(tokenizer=data/demo/tokenizer.json datasets.0.path=data/demo/reverse.jsonl
      datasets.0.format=chat datasets.0.template=chatml eval.every=0 eval.split=0 save.every=0)
for p in $parts; do case $p in
1)
  timeout 400 "$T" --gtest_filter='*SharedGpu*' > "$out/shared_gpu_tests.log" 2>&1
  echo "shared-GPU tests rc $?"; grep -E "^\[  (FAILED|PASSED)|worst loss" "$out/shared_gpu_tests.log"
  ;;
2|2q|2l)
  methods="qlora lora"; [ "$p" = 2q ] && methods=qlora; [ "$p" = 2l ] && methods=lora
  for method in $methods; do
    for n in 1 2; do
      mb=$((2 / n))
      run=$out/runs/8b-$method-$n
      timeout 240 "$R" train configs/llama3-8b-qlora-24gb.yaml --nproc-per-node $n --quiet --output "$run" \
        --set init=random architecture=llama3-8b method=$method strategy=ddp packing=false \
        sequence_len=512 micro_batch_size=$mb gradient_accumulation_steps=2 max_steps=8 \
        schedule.warmup_steps=1 optimizer.lr=1e-3 max_memory=$([ $method = lora ] && echo 0 || echo 22GiB) \
        "${data[@]}" > "$out/8b-$method-$n.log" 2>&1
      echo "8b $method on $n rank(s): rc $?"
      grep -h '"loss"' "$run/metrics.jsonl" | grep -o '"loss":[0-9.]*' | tr '\n' ' '; echo
      grep -h 'peak reserved' "$run/train.log"
    done
  done
  ;;
c)
  # The default (CUDA IPC device buffers), then shared host memory, at the same sizes.
  for t in ipc shm; do
    RIG_STAGED_IPC=$([ $t = ipc ] && echo 1 || echo 0) timeout 120 "$R" bench comm \
      --nproc-per-node 4 --op all --min-bytes 1M --max-bytes 256M > "$out/bench_comm_4_on_1_$t.txt" 2>&1
    echo "bench comm, 4 ranks on one GPU, $t: rc $?"
    grep -E "share|correct|WRONG|268435456|67108864" "$out/bench_comm_4_on_1_$t.txt"
  done
  ;;
3)
  run=$out/runs/70b-qlora-4
  start=$(date +%s)
  timeout ${T70:-540} "$R" train configs/llama3-70b-qlora-4x24gb.yaml --nproc-per-node 4 --quiet --output "$run" \
    --set init=random architecture=llama3-70b max_steps=${STEPS70:-20} gradient_accumulation_steps=1 \
    num_epochs=4 schedule.warmup_steps=2 optimizer.lr=5e-4 "${data[@]}" ${EXTRA70:-} > "$out/70b.log" 2>&1
  rc=$?
  echo "70b QLoRA on 4 ranks: rc $rc in $(( $(date +%s) - start )) s"
  if [ $rc != 0 ] && [ $(( $(date +%s) - start )) -lt 150 ]; then
    # A quick failure: once more through Gloo's sockets (slower), for the steps that time allows.
    cp "$out/70b.log" "$out/70b-shm-failed.log"; rm -rf "$run"
    RIG_STAGED_SHM=0 timeout $(( ${T70:-540} - 150 )) "$R" train configs/llama3-70b-qlora-4x24gb.yaml \
      --nproc-per-node 4 --quiet --output "$run" --set init=random architecture=llama3-70b \
      max_steps=${STEPS70:-20} gradient_accumulation_steps=1 num_epochs=4 schedule.warmup_steps=2 \
      optimizer.lr=5e-4 "${data[@]}" ${EXTRA70:-} > "$out/70b.log" 2>&1
    echo "70b QLoRA on 4 ranks, Gloo sockets: rc $? in $(( $(date +%s) - start )) s"
  fi
  tail -5 "$out/70b.log"
  cp "$run/metrics.jsonl" "$out/70b-metrics.jsonl" 2>/dev/null
  cp "$run/train.log" "$out/70b-train.log" 2>/dev/null
  grep -h -E 'share|peak reserved|step 1:|step 20:' "$run/train.log" | head
  # What the planner predicts per card for the same job: the config's LoRA targets, optimizer and
  # checkpointing, the sequence length as run.
  seq70=$(echo "${EXTRA70:-}" | grep -o 'sequence_len=[0-9]*' | cut -d= -f2)
  "$R" plan -c configs/llama3-70b-qlora-4x24gb.yaml --model llama3-70b --seq "${seq70:-2048}" \
    --gpus 4x4090 --json > "$out/70b-plan.json" 2>&1
  echo "plan rc $?"; grep -o '"allocator_peak[^,]*' "$out/70b-plan.json" | head -1
  ;;
esac; done
