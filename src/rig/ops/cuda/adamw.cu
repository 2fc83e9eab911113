// torch.optim.AdamW (single tensor, non-amsgrad) in the same order of operations as the CPU
// oracle. Parameters and gradients F32 or BF16; moments float32.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename P, typename G>
__global__ void adamw_kernel(P* p, const G* g, float* m, float* v, int64_t n, float decay,
                             float w1, float beta2, float w2, float bc2_sqrt, float eps,
                             float step_size) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = ld(g, i);
    float pi = ld(p, i) * decay;
    const float mi = m[i] + w1 * (gi - m[i]);
    const float vi = v[i] * beta2 + w2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    pi -= step_size * (mi / denom);
    st(p, i, pi);
  }
}

constexpr int kThreads = 256;

}  // namespace

cudaError_t adamw(T tp, void* p, T tg, const void* g, float* m, float* v, int64_t n, float decay,
                  float w1, float beta2, float w2, float bc2_sqrt, float eps, float step_size,
                  cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RIG_K_DISPATCH(tp, P, RIG_K_DISPATCH(tg, G, (adamw_kernel<P, G><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                                                   static_cast<P*>(p), static_cast<const G*>(g), m, v, n, decay,
                                                   w1, beta2, w2, bc2_sqrt, eps, step_size))));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
