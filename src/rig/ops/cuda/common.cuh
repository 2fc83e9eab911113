// Device helpers shared by the kernels: element load/store as float, warp and block reductions,
// grid sizing and the dtype switch that turns the runtime element type into a template argument.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

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

// 16 bytes of elements at once (8 bf16 or 4 float): element-wise kernels move data in full
// vectors when pointers and lengths allow (is_vec_ok), converting to float in registers.
template <typename E>
constexpr int kVec = 16 / int(sizeof(E));
template <typename E>
__device__ __forceinline__ void ld_vec(const E* p, int64_t i, float (&out)[kVec<E>]) {
  const uint4 r = *reinterpret_cast<const uint4*>(p + i);
  const E* e = reinterpret_cast<const E*>(&r);
#pragma unroll
  for (int j = 0; j < kVec<E>; ++j) out[j] = ld(e, j);
}
template <typename E>
__device__ __forceinline__ void st_vec(E* p, int64_t i, const float (&v)[kVec<E>]) {
  uint4 r;
  E* e = reinterpret_cast<E*>(&r);
#pragma unroll
  for (int j = 0; j < kVec<E>; ++j) st(e, j, v[j]);
  *reinterpret_cast<uint4*>(p + i) = r;
}
// Eight elements at p + i (16-byte aligned): one 16-byte access for bf16, two for float. Lets
// kernels that mix dtypes (a float32 residual, bf16 activations) step through rows together.
template <typename E>
__device__ __forceinline__ void ld8(const E* p, int64_t i, float (&out)[8]) {
  if constexpr (sizeof(E) == 2) {
    ld_vec(p, i, out);
  } else {
    float a[4], b[4];
    ld_vec(p, i, a);
    ld_vec(p, i + 4, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = a[j], out[j + 4] = b[j];
  }
}
template <typename E>
__device__ __forceinline__ void st8(E* p, int64_t i, const float (&v)[8]) {
  if constexpr (sizeof(E) == 2) {
    st_vec(p, i, v);
  } else {
    const float a[4] = {v[0], v[1], v[2], v[3]}, b[4] = {v[4], v[5], v[6], v[7]};
    st_vec(p, i, a);
    st_vec(p, i + 4, b);
  }
}
inline bool is_vec_ok(int64_t n_elems, int elem_bytes, std::initializer_list<const void*> ptrs) {
  if ((n_elems * elem_bytes) % 16 != 0) return false;
  for (const void* p : ptrs)
    if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
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
