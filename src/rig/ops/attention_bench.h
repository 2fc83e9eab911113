// Forward and backward attention throughput of each CUDA implementation on one shape
// (`rig bench attention`; bench/attention_vs_torch.sh runs PyTorch's SDPA beside it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace rig::ops {

struct AttentionBenchOptions {
  int64_t batch = 2, seq = 4096, heads = 32, kv_heads = 8, head_dim = 128;
  int64_t packed_avg = 0;  // > 0: packed segments of this average length (random, seeded)
  std::vector<std::string> impls{"cudnn", "flash"};
  int warmup = 3, iters = 20;
  bool deterministic = false;
  int device = 0;
};

struct AttentionBenchRow {
  std::string impl;
  double fwd_ms = 0, bwd_ms = 0;          // medians
  double fwd_tflops = 0, bwd_tflops = 0;  // useful FLOPs: visible (query, key) pairs only
  std::string skipped;                    // why this implementation did not run, if it did not
  // Packed runs: each batch row's segment lengths (bench/torch_sdpa.py replays them).
  std::vector<std::vector<int64_t>> segment_lengths;
};

// Causal FLOPs of one forward over `pairs` visible (query, key) pairs; backward counts 2.5x.
double attention_fwd_flops(int64_t pairs, int64_t heads, int64_t head_dim);

std::vector<AttentionBenchRow> bench_attention(const AttentionBenchOptions& o);

}  // namespace rig::ops
