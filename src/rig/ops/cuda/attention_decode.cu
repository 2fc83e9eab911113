// Attention of new rows against a key/value cache (op_table.inc: attention_decode), fp32 math,
// and generation's greedy pick (argmax) at the end of the file.
//
// One block of kWarps warps per (row, query head). Each warp takes every kWarps-th visible key
// and keeps its own online softmax: the 32 lanes split the head dimension (lane x holds dims
// x, x+32, ...), so a score is one warp sum and the output stays in registers. At the end warp 0
// merges the kWarps partial (max, sum, output) triples through shared memory. Decode is bound by
// reading the cache, which every lane reads coalesced; a split over the keys across blocks
// (flash-decoding) would fill more of a large GPU when n * Hq is small, and is not done here.
#include "rig/ops/cuda/attention_decode.h"
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

constexpr int kWarps = 8;
constexpr int kMaxNT = 8;  // head dims up to 256

template <typename E, int NT>
__global__ void __launch_bounds__(kWarps * 32)
    attn_decode_kernel(const E* q, const E* kc, const E* vc, E* out, DecodeDims d, float scale) {
  __shared__ float sm_m[kWarps], sm_l[kWarps];
  __shared__ float sm_acc[kWarps][NT * 32];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x / d.Hq;
  const int h = int(blockIdx.x % d.Hq), hk = h / (d.Hq / d.Hk);
  const int64_t len = d.past + r + 1, qoff = (r * d.Hq + h) * d.D;
  float qv[NT], acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int x = lane + 32 * t;
    qv[t] = x < d.D ? ld(q, qoff + x) : 0.0f;
    acc[t] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = w; j < len; j += kWarps) {
    const int64_t koff = (j * d.Hk + hk) * d.D;
    float part = 0.0f;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int x = lane + 32 * t;
      if (x < d.D) part = fmaf(qv[t], ld(kc, koff + x), part);
    }
    const float s = warp_sum(part) * scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn);  // m = -inf before the first key: corr = 0
    const float p = expf(s - mn);
    l = l * corr + p;
    m = mn;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int x = lane + 32 * t;
      if (x < d.D) acc[t] = fmaf(p, ld(vc, koff + x), acc[t] * corr);
    }
  }
  if (lane == 0) {
    sm_m[w] = m;
    sm_l[w] = l;
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) sm_acc[w][lane + 32 * t] = acc[t];
  __syncthreads();
  if (w != 0) return;
  float M = -INFINITY;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) M = fmaxf(M, sm_m[i]);
  float L = 0.0f, o[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) o[t] = 0.0f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) {
    const float c = expf(sm_m[i] - M);  // a warp that saw no key (m = -inf, l = 0) adds nothing
    L = fmaf(sm_l[i], c, L);
#pragma unroll
    for (int t = 0; t < NT; ++t) o[t] = fmaf(sm_acc[i][lane + 32 * t], c, o[t]);
  }
  const float inv = 1.0f / L;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int x = lane + 32 * t;
    if (x < d.D) st(out, qoff + x, o[t] * inv);
  }
}

template <typename E, int NT>
cudaError_t launch(const void* q, const void* kc, const void* vc, void* out, DecodeDims d,
                   cudaStream_t s) {
  const int64_t blocks = d.n * d.Hq;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  attn_decode_kernel<E, NT><<<unsigned(blocks), kWarps * 32, 0, s>>>(
      static_cast<const E*>(q), static_cast<const E*>(kc), static_cast<const E*>(vc),
      static_cast<E*>(out), d, 1.0f / sqrtf(float(d.D)));
  return cudaGetLastError();
}

template <typename E>
cudaError_t launch_for_dim(const void* q, const void* kc, const void* vc, void* out, DecodeDims d,
                           cudaStream_t s) {
  if (d.D <= 32) return launch<E, 1>(q, kc, vc, out, d, s);
  if (d.D <= 64) return launch<E, 2>(q, kc, vc, out, d, s);
  if (d.D <= 128) return launch<E, 4>(q, kc, vc, out, d, s);
  if (d.D <= 32 * kMaxNT) return launch<E, kMaxNT>(q, kc, vc, out, d, s);
  return cudaErrorInvalidValue;
}

// argmax: one block per row. Each thread walks its strided share of the row in increasing index,
// so a strictly larger value is the only one that replaces its pick (the first index among equal
// values stays); the warp and then the block merge (value, index) pairs, ties to the smaller
// index. NaN is skipped; index -1 means "nothing seen yet".
constexpr int kArgmaxThreads = 1024;

__device__ __forceinline__ void argmax_merge(float& v, long long& i, float ov, long long oi) {
  if (oi < 0) return;
  if (i < 0 || ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

template <typename E>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const E* x, int64_t V, int64_t limit, long long* out) {
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ long long si[kArgmaxThreads / 32];
  const E* row = x + int64_t(blockIdx.x) * V;
  float v = 0.0f;
  long long idx = -1;
  for (int64_t j = threadIdx.x; j < limit; j += blockDim.x) {
    const float y = ld(row, j);
    if (isnan(y)) continue;
    if (idx < 0 || y > v) {
      v = y;
      idx = j;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, v, o);
    const long long oi = __shfl_down_sync(0xffffffffu, idx, o);
    argmax_merge(v, idx, ov, oi);
  }
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (lane == 0) {
    sv[w] = v;
    si[w] = idx;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int k = 1; k < warps; ++k) argmax_merge(v, idx, sv[k], si[k]);
  out[blockIdx.x] = idx < 0 ? 0 : idx;
}

}  // namespace

cudaError_t argmax_rows(T t, const void* x, int64_t rows, int64_t V, int64_t limit, int64_t* out,
                        cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffffLL || limit < 1 || limit > V) return cudaErrorInvalidValue;
  long long* o = reinterpret_cast<long long*>(out);
  if (t == T::F32)
    argmax_kernel<float><<<unsigned(rows), kArgmaxThreads, 0, s>>>(static_cast<const float*>(x), V,
                                                                   limit, o);
  else
    argmax_kernel<bf16><<<unsigned(rows), kArgmaxThreads, 0, s>>>(static_cast<const bf16*>(x), V,
                                                                  limit, o);
  return cudaGetLastError();
}

int attention_decode_max_head_dim() {
  return 32 * kMaxNT;
}

cudaError_t attention_decode_fwd(T t, const void* q, const void* k_cache, const void* v_cache,
                                 void* out, DecodeDims d, cudaStream_t s) {
  if (d.n == 0 || d.Hq == 0 || d.D == 0) return cudaSuccess;
  if (t == T::F32) return launch_for_dim<float>(q, k_cache, v_cache, out, d, s);
  return launch_for_dim<bf16>(q, k_cache, v_cache, out, d, s);
}

}  // namespace rig::ops::cuda::k
