#!/usr/bin/env bash
# Attention side by side on one GPU, in one run: rig bench attention (cuDNN, rig's flash kernel;
# plain causal and packed segments of average length 512) and PyTorch's SDPA (cuDNN and
# FlashAttention-2 backends; FA2 and cuDNN varlen kernels on the same packed segments) on the same shapes.
# Writes OUTDIR/attention.jsonl.
#
# usage: bench/attention_vs_torch.sh OUTDIR   (RIG=path/to/rig, default dist/rig/rig)
set -u
out=${1:?usage: bench/attention_vs_torch.sh OUTDIR}
rig=${RIG:-dist/rig/rig}
mkdir -p "$out"
: > "$out/attention.jsonl"
for shape in "2 4096 32 8 128" "4 2048 32 8 128" "2 4096 32 8 64"; do
  read -r B T H Hk D <<< "$shape"
  args=(--batch "$B" --seq "$T" --heads "$H" --kv-heads "$Hk" --head-dim "$D")
  "$rig" bench attention "${args[@]}" --impl cudnn,flash --json >> "$out/attention.jsonl"
  "$rig" bench attention "${args[@]}" --impl cudnn --deterministic --json >> "$out/attention.jsonl"
  "$rig" bench attention "${args[@]}" --impl cudnn,flash --packed 512 --json > "$out/packed.json"
  cat "$out/packed.json" >> "$out/attention.jsonl"
  python3 "$(dirname "$0")/torch_sdpa.py" "${args[@]}" >> "$out/attention.jsonl" 2>> "$out/torch_sdpa.err"
  # The varlen kernels (FlashAttention-2, cuDNN) on the very segments rig's packed run drew.
  python3 -c 'import json,sys; json.dump(json.loads(sys.stdin.readline())["segment_lengths"], sys.stdout)' \
    < "$out/packed.json" > "$out/segments.json" &&
    python3 "$(dirname "$0")/torch_sdpa.py" "${args[@]}" --segments "$out/segments.json" \
      --packed-avg 512 >> "$out/attention.jsonl" 2>> "$out/torch_sdpa.err"
done
python3 - "$out/attention.jsonl" <<'PY'
import json, sys
print(f"{'impl':<14}{'shape':<22}{'packed':>7}{'det':>5}{'fwd TF/s':>10}{'bwd TF/s':>10}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    r.pop("segment_lengths", None)
    shape = f"{r['B']}x{r['T']} {r['Hq']}/{r['Hk']} d{r['D']}"
    if "skipped" in r:
        print(f"{r['impl']:<14}{shape:<22} skipped: {r['skipped'][:60]}")
        continue
    print(f"{r['impl']:<14}{shape:<22}{r.get('packed_avg', 0):>7}{'y' if r.get('deterministic') else '':>5}"
          f"{r['fwd_tflops']:>10.1f}{r['bwd_tflops']:>10.1f}")
PY
