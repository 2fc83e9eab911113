#!/usr/bin/env bash
# Inference with rig's own tools on one GPU at 8B size: writes an 8B-shaped model with random
# weights (rig debug random-model, bf16 safetensors + the demo tokenizer), then times greedy
# generation at batch 1 (rig generate --device cuda --stats: prompt, prefill, decode tokens/s,
# peak memory) and the held-out loss over data/demo (rig eval --device cuda --stats), each with
# nvidia-smi's peak used memory beside rig's allocator peak. Target: >= 30 tokens/s greedy decode
# of llama3-8b on an H200.
#
# usage: bench/generate_8b.sh [OUTDIR]   (from the repository root, with a bundle at dist/rig/rig)
#   RIG=path/to/rig (default dist/rig/rig); ARCH=llama3-8b (any rig catalogue name);
#   MODEL_DIR=the model folder (default OUTDIR/model; reused when it holds config.json);
#   NEW_TOKENS=256; QLORA=1 also writes the 4-bit folder (rig quantize) and times it the same way.
# The random model takes 32 GB of host memory while it is written and 16 GB on disk (8B, bf16).
set -u
out=${1:-generate-8b-out}
rig=${RIG:-dist/rig/rig}
arch=${ARCH:-llama3-8b}
model=${MODEL_DIR:-$out/model}
new=${NEW_TOKENS:-256}
prompt='<|im_start|>user
reverse abcdefghijkl<|im_end|>
<|im_start|>assistant
'
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

# Runs "$@" with its output in $out/$1.log while nvidia-smi samples the used memory every 100 ms;
# prints rig's --stats line and nvidia-smi's peak.
with_smi_peak() {
  local name=$1
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$out/$name.smi" &
  local smi=$!
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  echo "== $name (rc $rc, $((SECONDS - t0)) s): $*"
  grep -E '^rig (generate|eval):|^loss |^rig:' "$out/$name.log"
  echo "nvidia-smi peak used: $(sort -n "$out/$name.smi" | tail -1) MiB"
  return $rc
}

if [ ! -f "$model/config.json" ]; then
  t0=$SECONDS
  "$rig" debug random-model --architecture "$arch" --out "$model" --dtype bf16 \
    --tokenizer data/demo/tokenizer.json || exit 1
  echo "random $arch written in $((SECONDS - t0)) s"
fi

# Greedy decode at batch 1: the prompt in one pass, then one token per step, the pick on the GPU.
# --ignore-eos: every run generates exactly NEW_TOKENS (a random model may hit a stop token).
with_smi_peak generate "$rig" generate --model "$model" --device cuda --stats --ignore-eos \
  --max-new-tokens "$new" --prompt "$prompt"
# bf16 forced and float32 for comparison (f32 reads twice the bytes per token).
with_smi_peak generate_f32 "$rig" generate --model "$model" --device cuda --dtype f32 --stats \
  --ignore-eos --max-new-tokens 64 --prompt "$prompt"
# The loss over the 6000 demo samples, 64 rows of 64 tokens per forward.
with_smi_peak eval "$rig" eval --model "$model" --data data/demo/reverse.jsonl --device cuda \
  --seq 64 --batch 64 --stats

if [ "${QLORA:-0}" = 1 ]; then
  q="$model-nf4"
  [ -f "$q/config.json" ] || "$rig" quantize --model "$model" --out "$q" || exit 1
  with_smi_peak generate_nf4 "$rig" generate --model "$q" --device cuda --stats --ignore-eos \
    --max-new-tokens "$new" --prompt "$prompt"
  with_smi_peak eval_nf4 "$rig" eval --model "$q" --data data/demo/reverse.jsonl --device cuda \
    --seq 64 --batch 64 --stats
fi

# The verdict on the target from the bf16 run's decode speed.
tps=$(sed -n 's/.*decode \([0-9.]*\) tokens\/s.*/\1/p' "$out/generate.log" | head -1)
echo "greedy $arch decode: ${tps:-?} tokens/s (target >= 30 on an H200: $(
  awk -v t="${tps:-0}" 'BEGIN { print (t >= 30 ? "met" : "NOT met") }'))"
