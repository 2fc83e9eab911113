#!/usr/bin/env bash
# Side by side on one GPU, in one run: the rows of bench/hf_baseline.py (a copy of
# shared/bench/hf_baseline.py: transformers + PEFT, bf16 autocast, SDPA) and the same rows through
# `rig bench train`, each rig row with nvidia-smi's peak beside rig's own allocator peak.
#
# usage: bench/rig_vs_hf.sh OUTDIR [rig|hf|both]   (RIG=path/to/rig, default dist/rig/rig;
#        ROWS=0,3 runs those rows of the plan only; STEPS=N timed steps for rig;
#        CKPT="0=full:20 2=selective" sets rig's checkpointing per row: none, selective, full, or
#        full:N (the first N layers recompute, the rest selective); default: the plan's column;
#        EXTRA="3=--loss-chunk-rows 2048;0=..." adds rig flags to a row)
set -u
out=${1:?usage: bench/rig_vs_hf.sh OUTDIR [rig|hf|both]}
which=${2:-both}
rig=${RIG:-dist/rig/rig}
mkdir -p "$out"

# Runs "$@" (which prints one JSON line) while nvidia-smi samples the used memory every 100 ms;
# appends that line to rig.jsonl with the row index and nvidia-smi's peak in MiB added.
with_smi_peak() {
  local row=$1
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$out/smi.tmp" &
  local smi=$!
  "$@" > "$out/line.tmp"
  local rc=$?
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  python3 - "$out/line.tmp" "$row" "$(sort -n "$out/smi.tmp" | tail -1)" "$rc" >> "$out/rig.jsonl" <<'PY'
import json, sys
text = open(sys.argv[1]).read().strip()
r = json.loads(text) if text else {}
r = {"row": int(sys.argv[2]), "side": "rig", **r, "smi_peak_mib": int(sys.argv[3] or 0), "rc": int(sys.argv[4])}
print(json.dumps(r))
PY
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
          --steps "${STEPS:-4}" --json --profile)
    mode=$([ "$ckpt" = 1 ] && echo full || echo none)
    for kv in ${CKPT:-}; do [ "${kv%%=*}" = "$i" ] && mode=${kv#*=}; done
    args+=("--checkpointing=${mode%%:*}")
    [ "${mode#*:}" != "$mode" ] && args+=(--recompute-layers "${mode#*:}")
    [ "$method" = lora ] && args+=(--lora-targets "$targets" --lora-r "$rank")
    IFS=';' read -r -a extras <<< "${EXTRA:-}"
    for kv in "${extras[@]}"; do
      # shellcheck disable=SC2206
      [ "${kv%%=*}" = "$i" ] && args+=(${kv#*=})
    done
    echo "rig ${args[*]}" >&2
    with_smi_peak "$i" "$rig" "${args[@]}" || echo "rig row failed: $r" >&2
  done
fi
if [ "$which" != rig ]; then
  python3 "$(dirname "$0")/hf_baseline.py" "$out" 2>&1 | grep -v Warning | tee "$out/hf.jsonl"
fi
