// rig bench attention: CUDA events around each call, median of the timed repetitions, on random
// bf16 inputs (never zeros: they run faster than real data).
#include <algorithm>
#include <random>

#include "rig/core/cuda_check.h"
#include "rig/ops/attention_bench.h"
#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/cuda_ops.h"
#include "rig/ops/ops.h"

namespace rig::ops {

namespace {

Tensor random_bf16(const Shape& s, std::mt19937& g, int dev) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = n(g);
  return Tensor::from_f32(v, s).to_dtype(DType::BF16).to(Device::cuda(dev));
}

// Segment ids with lengths drawn uniformly from [1, 2*avg-1]; returns the visible pair count.
Tensor packed_segments(int64_t B, int64_t T, int64_t avg, std::mt19937& g, int64_t* pairs,
                       std::vector<std::vector<int64_t>>* lengths) {
  std::uniform_int_distribution<int64_t> len(1, 2 * avg - 1);
  Tensor seg = Tensor::empty({B, T}, DType::I64);
  *pairs = 0;
  lengths->assign(size_t(B), {});
  for (int64_t b = 0; b < B; ++b) {
    int64_t t = 0, id = 0;
    while (t < T) {
      const int64_t l = std::min(len(g), T - t);
      for (int64_t i = 0; i < l; ++i) seg.data<int64_t>()[b * T + t + i] = id;
      *pairs += l * (l + 1) / 2;
      (*lengths)[size_t(b)].push_back(l);
      t += l;
      ++id;
    }
  }
  return seg;
}

template <typename F>
double median_ms(int warmup, int iters, int dev, F&& f) {
  cudaStream_t s = cuda::stream_for(dev);
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t a, b;
  RIG_CUDA_CHECK(cudaEventCreate(&a));
  RIG_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    RIG_CUDA_CHECK(cudaEventRecord(a, s));
    f();
    RIG_CUDA_CHECK(cudaEventRecord(b, s));
    RIG_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    RIG_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

double attention_fwd_flops(int64_t pairs, int64_t heads, int64_t head_dim) {
  return 4.0 * double(pairs) * double(heads) * double(head_dim);
}

std::vector<AttentionBenchRow> bench_attention(const AttentionBenchOptions& o) {
  if (!cuda_available()) bad_input("rig bench attention needs a CUDA GPU");
  if (o.batch < 1 || o.seq < 1 || o.heads < 1 || o.kv_heads < 1 || o.head_dim < 1 ||
      o.heads % o.kv_heads != 0 || o.iters < 1 || o.warmup < 0 || o.packed_avg < 0)
    bad_input(
        "rig bench attention: batch, seq, heads, kv-heads, head-dim and iters must be "
        "positive and kv-heads must divide heads");
  const int dev = o.device;
  cuda::DeviceGuard guard(dev);
  std::mt19937 g(1234);
  const Shape qs{o.batch, o.seq, o.heads, o.head_dim}, ks{o.batch, o.seq, o.kv_heads, o.head_dim};
  Tensor q = random_bf16(qs, g, dev), k = random_bf16(ks, g, dev), v = random_bf16(ks, g, dev);
  Tensor dout = random_bf16(qs, g, dev);
  int64_t pairs = o.batch * o.seq * (o.seq + 1) / 2;
  Tensor seg;
  std::vector<std::vector<int64_t>> lengths;
  if (o.packed_avg > 0)
    seg = packed_segments(o.batch, o.seq, o.packed_avg, g, &pairs, &lengths).to(Device::cuda(dev));
  Tensor out = Tensor::empty(qs, DType::BF16, Device::cuda(dev));
  Tensor lse = Tensor::empty({o.batch, o.heads, o.seq}, DType::F32, Device::cuda(dev));
  Tensor dq = Tensor::empty(qs, DType::BF16, Device::cuda(dev));
  Tensor dk = Tensor::empty(ks, DType::BF16, Device::cuda(dev)),
         dv = Tensor::empty(ks, DType::BF16, Device::cuda(dev));
  const double fwd_flops = attention_fwd_flops(pairs, o.heads, o.head_dim);
  const std::string prev = cuda::attention_impl();
  set_deterministic(o.deterministic);
  std::vector<AttentionBenchRow> rows;
  for (const auto& impl : o.impls) {
    AttentionBenchRow r;
    r.impl = impl;
    r.segment_lengths = lengths;
    cuda::set_attention_impl(impl);
    try {
      r.fwd_ms =
          median_ms(o.warmup, o.iters, dev, [&] { attention_forward(q, k, v, seg, out, lse); });
      r.bwd_ms = median_ms(o.warmup, o.iters, dev,
                           [&] { attention_backward(dout, q, k, v, seg, out, lse, dq, dk, dv); });
      r.fwd_tflops = fwd_flops / (r.fwd_ms * 1e-3) / 1e12;
      r.bwd_tflops = 2.5 * fwd_flops / (r.bwd_ms * 1e-3) / 1e12;
    } catch (const Error& e) {
      r.skipped = e.what();
    }
    rows.push_back(r);
  }
  cuda::set_attention_impl(prev);
  set_deterministic(false);
  return rows;
}

}  // namespace rig::ops
