# Per-op table of rig bench train --json --profile lines: ms, calls and TFLOP/s of each product shape.
import json, re, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except Exception:
        continue
    b = r.get("breakdown")
    if not b:
        continue
    print(f"== row {r.get('row')} {r.get('method')} ckpt={r.get('checkpointing')} rl={r.get('recompute_layers')} "
          f"tok/s={r.get('tokens_per_s', 0):.0f} step={b.get('step_ms', 0):.1f}ms peak={r.get('peak_reserved_bytes', 0)/2**30:.2f}GiB")
    cats = {k: round(v, 1) for k, v in b.items() if k.endswith("_ms")}
    print("  ", cats)
    ops = sorted(b["ops"].items(), key=lambda kv: -kv[1]["ms"])
    for name, e in ops[:28]:
        m = re.match(r"gemm (\d+)x(\d+)x(\d+)", name)
        tf = ""
        if m:
            M, N, K = map(int, m.groups())
            tf = f"{2 * M * N * K * e['calls'] / (e['ms'] * 1e-3) / 1e12:7.1f} TF/s"
        print(f"   {e['ms']:8.2f} ms {e['calls']:5d}x  {tf:>12}  {name}")
