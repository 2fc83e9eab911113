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

constexpr int kThreads = 256;

}  // namespace

cudaError_t swiglu_fwd(T t, const void* g, const void* u, void* a, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RIG_K_DISPATCH(t, E, (swiglu_fwd_kernel<E><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                           static_cast<const E*>(g), static_cast<const E*>(u), static_cast<E*>(a), n)));
  return cudaGetLastError();
}

cudaError_t swiglu_bwd(T t, const void* da, const void* g, const void* u, void* dg, void* du,
                       int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RIG_K_DISPATCH(t, E, (swiglu_bwd_kernel<E><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                           static_cast<const E*>(da), static_cast<const E*>(g), static_cast<const E*>(u),
                           static_cast<E*>(dg), static_cast<E*>(du), n)));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
