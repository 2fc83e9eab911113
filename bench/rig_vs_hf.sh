#!/usr/bin/env bash
# Side by side on one GPU, in one run: the rows of bench/hf_baseline.py (a copy of
# shared/bench/hf_baseline.py: transformers + PEFT, bf16 autocast, SDPA) and the same rows through
# `rig bench train`, each rig row with nvidia-smi's peak beside rig's own allocator peak.
#
# usage: bench/rig_vs_hf.sh OUTDIR [rig|hf|both]   (RIG=path/to/rig, default dist/rig/rig;
#        ROWS=0,3 runs those rows of the plan only; STEPS=N timed steps for rig)
set -u
out=${1:?usage: bench/rig_vs_hf.sh OUTDIR [rig|hf|both]}
which=${2:-both}
rig=${RIG:-dist/rig/rig}
mkdir -p "$out"

# Runs "$@" while nvidia-smi samples the used memory every 100 ms; appends the peak in MiB.
with_smi_peak() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$out/smi.tmp" &
  local smi=$!
  "$@"
  local rc=$?
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  echo "{\"smi_peak_mib\": $(sort -n "$out/smi.tmp" | tail -1), \"rc\": $rc}" >> "$out/rig.jsonl"
  return $rc
}

# preset method seq batch checkpointing lora-targets lora-r: the plan of hf_baseline.py.
rows=(
  "llama3-8b lora 4096 2 1 q_proj,k_proj,v_proj,o_proj 16"
  "llama3-8b lora 4096 2 1 all 64"
  "llama3-8b lora 4096 2 0 all 16"
  "llama3-1b full 2048 8 0 - 0"
  "llama3-1b full 4096 4 1 - 0"
  "llama3-1b lora 2048 8 0 all 16"
)
# ROWS=0,3 picks rows of the plan (both sides).
pick=("${!rows[@]}")
[ -n "${ROWS:-}" ] && IFS=, read -r -a pick <<< "$ROWS"
if [ "$which" != hf ]; then
  : > "$out/rig.jsonl"
  for i in "${pick[@]}"; do
    r=${rows[$i]}
    read -r preset method seq batch ckpt targets rank <<< "$r"
    args=(bench train --device cuda --preset "$preset" --method "$method" --seq "$seq" --batch "$batch"
          --steps "${STEPS:-4}" --json)
    [ "$ckpt" = 1 ] && args+=(--checkpointing)
    [ "$method" = lora ] && args+=(--lora-targets "$targets" --lora-r "$rank")
    echo "rig ${args[*]}" >&2
    with_smi_peak "$rig" "${args[@]}" >> "$out/rig.jsonl" || echo "rig row failed: $r" >&2
  done
fi
if [ "$which" != rig ]; then
  python3 "$(dirname "$0")/hf_baseline.py" "$out" 2>&1 | grep -v Warning
fi
