// Device helpers shared by the kernels: element load/store as float, warp and block reductions,
// grid sizing and the dtype switch that turns the runtime element type into a template argument.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "rig/ops/cuda/launch.h"

namespace rig::ops::cuda::k {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
// The value a store of v into an element of type E would hold, as a float.
template <typename E>
__device__ __forceinline__ float round_as(float v) {
  if constexpr (sizeof(E) == 2) return __bfloat162float(__float2bfloat16_rn(v));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
template <typename V>
__device__ V block_sum(V v) {
  __shared__ V sh[32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous call
  if (lane == 0) sh[w] = v;
  __syncthreads();
  V r = lane < nw ? sh[lane] : V(0);
  return warp_sum(r);
}
__device__ inline float block_max(float v) {
  __shared__ float sh[32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float r = lane < nw ? sh[lane] : -INFINITY;
  return warp_max(r);
}

inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65535LL * 16) {
  int64_t g = (n + threads - 1) / threads;
  if (g < 1) g = 1;
  if (g > cap) g = cap;
  return unsigned(g);
}


}  // namespace rig::ops::cuda::k

// Calls body with `using E = float` or `using E = bf16` chosen by the runtime type.
#define RIG_K_DISPATCH(t, E, ...)          \
  do {                                     \
    if ((t) == ::rig::ops::cuda::k::T::F32) { \
      using E = float;                     \
      __VA_ARGS__;                         \
    } else {                               \
      using E = ::rig::ops::cuda::k::bf16; \
      __VA_ARGS__;                         \
    }                                      \
  } while (0)

// Records the first bad input the kernels meet (device side).
__device__ __forceinline__ void rig_device_error(rig::ops::cuda::k::DeviceError* err, int code,
                                                 long long where, long long value,
                                                 long long limit) {
  if (err && atomicCAS(&err->code, 0, -1) == 0) {
    err->where = where;
    err->value = value;
    err->limit = limit;
    __threadfence();
    atomicExch(&err->code, code);
  }
}
