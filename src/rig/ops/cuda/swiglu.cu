// SwiGLU: a = silu(g) * u and its backward, float math on any element type.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename E>
__global__ void swiglu_fwd_kernel(const E* g, const E* u, E* a, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = ld(g, i);
    st(a, i, x / (1.0f + expf(-x)) * ld(u, i));
  }
}

template <typename E>
__global__ void swiglu_bwd_kernel(const E* da, const E* g, const E* u, E* dg, E* du, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = ld(g, i), d = ld(da, i), y = ld(u, i);
    const float sig = 1.0f / (1.0f + expf(-x));
    st(du, i, d * x * sig);
    st(dg, i, d * y * sig * (1.0f + x * (1.0f - sig)));
  }
}

// The same math on 16-byte vectors (n a multiple of the vector, pointers aligned).
template <typename E>
__global__ void swiglu_fwd_vec_kernel(const E* g, const E* u, E* a, int64_t n) {
  constexpr int V = kVec<E>;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * V; i < n;
       i += int64_t(gridDim.x) * blockDim.x * V) {
    float x[V], y[V];
    ld_vec(g, i, x);
    ld_vec(u, i, y);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = x[j] / (1.0f + expf(-x[j])) * y[j];
    st_vec(a, i, x);
  }
}

template <typename E>
__global__ void swiglu_bwd_vec_kernel(const E* da, const E* g, const E* u, E* dg, E* du,
                                      int64_t n) {
  constexpr int V = kVec<E>;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * V; i < n;
       i += int64_t(gridDim.x) * blockDim.x * V) {
    float x[V], d[V], y[V], ou[V], og[V];
    ld_vec(g, i, x);
    ld_vec(da, i, d);
    ld_vec(u, i, y);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float sig = 1.0f / (1.0f + expf(-x[j]));
      ou[j] = d[j] * x[j] * sig;
      og[j] = d[j] * y[j] * sig * (1.0f + x[j] * (1.0f - sig));
    }
    st_vec(du, i, ou);
    st_vec(dg, i, og);
  }
}

constexpr int kThreads = 256;

}  // namespace

cudaError_t swiglu_fwd(T t, const void* g, const void* u, void* a, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const int eb = t == T::F32 ? 4 : 2;
  if (is_vec_ok(n, eb, {g, u, a})) {
    RIG_K_DISPATCH(t, E,
                   (swiglu_fwd_vec_kernel<E><<<grid_for(n / kVec<E>, kThreads), kThreads, 0, s>>>(
                       static_cast<const E*>(g), static_cast<const E*>(u), static_cast<E*>(a), n)));
    return cudaGetLastError();
  }
  RIG_K_DISPATCH(t, E, (swiglu_fwd_kernel<E><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                           static_cast<const E*>(g), static_cast<const E*>(u), static_cast<E*>(a), n)));
  return cudaGetLastError();
}

cudaError_t swiglu_bwd(T t, const void* da, const void* g, const void* u, void* dg, void* du,
                       int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const int eb = t == T::F32 ? 4 : 2;
  if (is_vec_ok(n, eb, {da, g, u, dg, du})) {
    RIG_K_DISPATCH(t, E,
                   (swiglu_bwd_vec_kernel<E><<<grid_for(n / kVec<E>, kThreads), kThreads, 0, s>>>(
                       static_cast<const E*>(da), static_cast<const E*>(g),
                       static_cast<const E*>(u), static_cast<E*>(dg), static_cast<E*>(du), n)));
    return cudaGetLastError();
  }
  RIG_K_DISPATCH(t, E, (swiglu_bwd_kernel<E><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                           static_cast<const E*>(da), static_cast<const E*>(g), static_cast<const E*>(u),
                           static_cast<E*>(dg), static_cast<E*>(du), n)));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
