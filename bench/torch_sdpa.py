"""PyTorch's scaled_dot_product_attention on rig bench attention's shape, one JSON line per backend.

usage: python3 bench/torch_sdpa.py [--batch 2 --seq 4096 --heads 32 --kv-heads 8 --head-dim 128]
                                  [--segments FILE --packed-avg 512]
Backends forced with torch.nn.attention.sdpa_kernel: cuDNN's fused attention and FlashAttention-2.
With --segments (a JSON list of each batch row's segment lengths, as `rig bench attention
--packed N --json` prints them), the varlen kernels instead, on those segments: the packed-data
comparison points (aten's _flash_attention_* and _cudnn_attention_* with cumulative lengths).
Causal, bf16, [B,H,T,D]; K/V carry kv-heads and enable_gqa=True where the backend takes it, else
they are expanded to the query heads (the expansion is not timed). FLOPs count visible pairs
only: forward 4*B*H*D*T(T+1)/2, backward 2.5x forward.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def varlen_rows(a, lengths):
    """FlashAttention-2's and cuDNN's varlen kernels on the given segments: [total, H, D] with
    cumulative offsets. cuDNN's output is checked against FA2's (max_abs_diff_vs_flash2)."""
    H, Hk, D = a.heads, a.kv_heads, a.head_dim
    offs, pairs = [0], 0
    for row in lengths:
        for n in row:
            offs.append(offs[-1] + n)
            pairs += n * (n + 1) // 2
    total, longest = offs[-1], max(max(r) for r in lengths)
    g = torch.Generator(device="cuda").manual_seed(1234)
    mk = lambda h: torch.randn(total, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, dout = mk(H), mk(Hk), mk(Hk), mk(H)
    cu = torch.tensor(offs, dtype=torch.int32, device="cuda")
    scale = D ** -0.5
    fwd_flops = 4.0 * H * D * pairs
    aten = torch.ops.aten

    def flash2():
        fwd = lambda: aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale)
        out, lse, rng, unused, _ = fwd()
        bwd = lambda: aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, rng, unused,
            scale=scale)
        return fwd, bwd, out

    def cudnn():
        fwd = lambda: aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, longest, longest, True, 0.0, True, False, scale=scale)
        res = fwd()
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        bwd = lambda: aten._cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cu, cu, longest, longest, 0.0, True,
            scale=scale)
        return fwd, bwd, out

    reference = None
    for name, make in [("torch-flash2-varlen", flash2), ("torch-cudnn-varlen", cudnn)]:
        if a.impls and name.split("-")[1] not in a.impls.split(","):
            continue
        row = {"impl": name, "B": a.batch, "T": a.seq, "Hq": H, "Hk": Hk, "D": D,
               "causal": True, "packed_avg": a.packed_avg, "torch": torch.__version__}
        if name == "torch-cudnn-varlen":
            # Seen with PyTorch 2.11: the cuDNN graph is rebuilt on every varlen call.
            row["note"] = "wall time per call, graph building included; ncu gives the kernels' time"
        try:
            with torch.no_grad():
                fwd, bwd, out = make()
                if reference is None:
                    reference = out
                else:
                    row["max_abs_diff_vs_flash2"] = (out.float() - reference.float()).abs().max().item()
                row["fwd_ms"] = median_ms(fwd, iters=a.iters)
                row["bwd_ms"] = median_ms(bwd, iters=a.iters)
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = 2.5 * fwd_flops / row["bwd_ms"] / 1e9
        except (RuntimeError, TypeError, AttributeError) as e:
            row["skipped"] = str(e).splitlines()[0][:300]
        print(json.dumps(row), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--segments", help="JSON file: each batch row's segment lengths")
    p.add_argument("--packed-avg", type=int, default=0, help="recorded in the output row")
    p.add_argument("--impls", default="", help="with --segments: flash2,cudnn (default both)")
    a = p.parse_args()
    if a.segments:
        with open(a.segments) as f:
            varlen_rows(a, json.load(f))
        return
    B, T, H, Hk, D = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    g = torch.Generator(device="cuda").manual_seed(1234)
    mk = lambda h: torch.randn(B, h, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, dout = mk(H), mk(Hk), mk(Hk), mk(H)
    fwd_flops = 4.0 * B * H * D * T * (T + 1) / 2
    for name, backend in [("torch-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("torch-flash2", SDPBackend.FLASH_ATTENTION)]:
        row = {"impl": name, "B": B, "T": T, "Hq": H, "Hk": Hk, "D": D, "causal": True,
               "packed_avg": 0, "torch": torch.__version__}
        try:
            with sdpa_kernel(backend):
                for gqa in (True, False):
                    kk = k if gqa else k.repeat_interleave(H // Hk, dim=1)
                    vv = v if gqa else v.repeat_interleave(H // Hk, dim=1)
                    qq, kk, vv = (t.detach().requires_grad_() for t in (q, kk, vv))
                    try:
                        run = lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                                     enable_gqa=gqa)
                        out = run()
                        break
                    except RuntimeError:
                        if not gqa:
                            raise
                row["gqa_native"] = gqa
                with torch.no_grad():
                    row["fwd_ms"] = median_ms(run, iters=a.iters)
                out = run()
                row["bwd_ms"] = median_ms(
                    lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True),
                    iters=a.iters)
                row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
                row["bwd_tflops"] = 2.5 * fwd_flops / row["bwd_ms"] / 1e9
        except RuntimeError as e:
            row["skipped"] = str(e).splitlines()[0][:200]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
