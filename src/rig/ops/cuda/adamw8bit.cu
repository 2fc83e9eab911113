// 8-bit AdamW: one thread block per 256-element state block. Each thread dequantizes its moments,
// applies the float32 AdamW update (the order of operations of adamw.cu), the block finds the new
// absmax of both moments, and each thread stores the nearest codes (a binary search over the
// midpoints of the sorted map, the same function the CPU oracle calls).
#include "rig/ops/adam8_code.h"
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k8 {

namespace {

constexpr int kBlock = 256;

__device__ __forceinline__ float block_max256(float v) {
  __shared__ float sh[kBlock / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = sh[0];
#pragma unroll
  for (int w = 1; w < kBlock / 32; ++w) r = fmaxf(r, sh[w]);
  return r;
}

template <typename P, typename G>
__global__ void adamw8bit_kernel(P* p, const G* g, unsigned char* mq, float* mabs,
                                 unsigned char* vq, float* vabs, const float* mmap_g,
                                 const float* vmap_g, int64_t n, float decay, float w1, float beta2,
                                 float w2, float bc2_sqrt, float eps, float step_size) {
  __shared__ float mmap[256], vmap[256];
  mmap[threadIdx.x] = mmap_g[threadIdx.x];
  vmap[threadIdx.x] = vmap_g[threadIdx.x];
  __syncthreads();
  const int64_t b = blockIdx.x, i = b * kBlock + threadIdx.x;
  const bool live = i < n;
  float mi = 0, vi = 0;
  if (live) {
    const float gi = k::ld(g, i);
    float pi = k::ld(p, i) * decay;
    mi = mmap[mq[i]] * mabs[b];
    vi = vmap[vq[i]] * vabs[b];
    mi += w1 * (gi - mi);
    vi = vi * beta2 + w2 * gi * gi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    pi -= step_size * (mi / denom);
    k::st(p, i, pi);
  }
  const float mmax = block_max256(live ? fabsf(mi) : 0.0f);
  const float vmax = block_max256(live ? vi : 0.0f);
  if (threadIdx.x == 0) {
    mabs[b] = mmax;
    vabs[b] = vmax;
  }
  if (live) {
    mq[i] = adam8_nearest_code(mmap, mmax > 0 ? mi / mmax : 0.0f);
    vq[i] = adam8_nearest_code(vmap, vmax > 0 ? vi / vmax : 0.0f);
  }
}

}  // namespace

int adamw8bit(void* p, int p_bf16, const void* g, int g_bf16, unsigned char* mq, float* mabs,
              unsigned char* vq, float* vabs, const float* mmap, const float* vmap, long long n,
              float decay, float w1, float beta2, float w2, float bc2_sqrt, float eps,
              float step_size, void* stream) {
  if (n == 0) return 0;
  const unsigned blocks = unsigned((n + kBlock - 1) / kBlock);
  auto s = static_cast<cudaStream_t>(stream);
  const k::T tp = p_bf16 ? k::T::BF16 : k::T::F32, tg = g_bf16 ? k::T::BF16 : k::T::F32;
  RIG_K_DISPATCH(
      tp, P,
      RIG_K_DISPATCH(tg, G,
                     (adamw8bit_kernel<P, G><<<blocks, kBlock, 0, s>>>(
                         static_cast<P*>(p), static_cast<const G*>(g), mq, mabs, vq, vabs, mmap,
                         vmap, n, decay, w1, beta2, w2, bc2_sqrt, eps, step_size))));
  return int(cudaGetLastError());
}

}  // namespace rig::ops::cuda::k8
