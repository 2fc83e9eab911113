// The guard's checks on the device: bad-value counts (NaN, Inf, implausible magnitudes) and the
// 64-bit parameter hash (ops/guard_hash.h). Each kernel adds into one device counter, so a list
// of tensors costs one launch per tensor and one read-back at the end; the CPU twins are in
// ops/cpu/guard.cpp.
#include "rig/ops/cuda/common.cuh"
#include "rig/ops/guard_hash.h"

namespace rig::ops::cuda::k {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Adds the block's values into *dst (modulo 2^64): one atomic per block.
__device__ __forceinline__ void block_add_u64(unsigned long long v, unsigned long long* dst) {
  __shared__ unsigned long long sh[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum_u64(v);
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    unsigned long long r = lane < nw ? sh[lane] : 0ull;
    r = warp_sum_u64(r);
    if (lane == 0 && r) atomicAdd(dst, r);
  }
}

template <typename E>
__global__ void count_bad_kernel(const E* a, int64_t n, float max_abs, unsigned long long* count) {
  unsigned long long bad = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = ld(a, i);
    bad += !isfinite(x) || (max_abs > 0.0f && fabsf(x) > max_abs);
  }
  block_add_u64(bad, count);
}

// Words of 4 bytes; `aligned` when the pointer allows 32-bit loads (a view may start at an odd
// BF16 element), the last partial word zero-padded as on the CPU.
__global__ void hash_kernel(const uint8_t* p, int64_t bytes, uint64_t base, bool aligned,
                            unsigned long long* sum) {
  const int64_t words = (bytes + 3) / 4;
  unsigned long long s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = 4 * i;
    uint32_t w = 0;
    if (aligned && b + 4 <= bytes) {
      w = reinterpret_cast<const uint32_t*>(p)[i];
    } else {
      for (int64_t k = b; k < bytes && k < b + 4; ++k) w |= uint32_t(p[k]) << (8 * (k - b));
    }
    s += hash::word_term(base, uint64_t(i), w);
  }
  // Sums modulo 2^64 in any order, so the value does not depend on the launch shape.
  block_add_u64(s, sum);
}

}  // namespace

cudaError_t count_bad(T ta, const void* a, int64_t n, float max_abs, unsigned long long* count,
                      cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RIG_K_DISPATCH(ta, A,
                 (count_bad_kernel<A><<<grid_for(n, kThreads, 4096), kThreads, 0, s>>>(
                     static_cast<const A*>(a), n, max_abs, count)));
  return cudaGetLastError();
}

cudaError_t hash_bytes(const void* p, int64_t bytes, uint64_t index_in_list,
                       unsigned long long* sum, cudaStream_t s) {
  if (bytes == 0) return cudaSuccess;
  const bool aligned = (reinterpret_cast<uintptr_t>(p) & 3u) == 0;
  hash_kernel<<<grid_for((bytes + 3) / 4, kThreads, 4096), kThreads, 0, s>>>(
      static_cast<const uint8_t*>(p), bytes, hash::tensor_base(index_in_list), aligned, sum);
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
