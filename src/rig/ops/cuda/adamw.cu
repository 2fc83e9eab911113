// torch.optim.AdamW (single tensor, non-amsgrad) in the same order of operations as the CPU
// oracle. Parameters and gradients F32 or BF16; moments float32.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

// One element's update, every operation rounded on its own (no contracted multiply-adds), in the
// CPU oracle's order: the single-tensor and the list kernels give the same bits for the same input.
__device__ __forceinline__ float adamw_element(float p, float g, float& m, float& v, float decay,
                                               float w1, float beta2, float w2, float bc2_sqrt,
                                               float eps, float step_size) {
  p = __fmul_rn(p, decay);
  m = __fadd_rn(m, __fmul_rn(w1, __fsub_rn(g, m)));
  v = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(__fmul_rn(w2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2_sqrt), eps);
  return __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(m, denom)));
}

template <typename P, typename G>
__global__ void adamw_kernel(P* p, const G* g, float* m, float* v, int64_t n, float decay,
                             float w1, float beta2, float w2, float bc2_sqrt, float eps,
                             float step_size) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float mi = m[i], vi = v[i];
    st(p, i,
       adamw_element(ld(p, i), ld(g, i), mi, vi, decay, w1, beta2, w2, bc2_sqrt, eps, step_size));
    m[i] = mi;
    v[i] = vi;
  }
}

constexpr int kThreads = 256;

// Each block steps kListChunk consecutive elements of one slot; first_block[j] is slot j's first
// block, so the slot a block serves is found by a short scan of the launch's own parameters.
constexpr int64_t kListChunk = 4096;
struct AdamWBatch {
  AdamWSlot slot[kAdamWSlotsPerLaunch];
  int first_block[kAdamWSlotsPerLaunch + 1];
  int count;
};

template <typename P, typename G>
__device__ void adamw_chunk(const AdamWSlot& s, int64_t begin, int64_t end, float grad_scale,
                            float w1, float beta2, float w2, float bc2_sqrt, float eps,
                            float step_size) {
  P* p = static_cast<P*>(s.p);
  const G* g = static_cast<const G*>(s.g);
  bf16* copy = static_cast<bf16*>(s.copy);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    // The gradient as an in-place clip would leave it: a rounded product.
    const float gi = __fmul_rn(ld(g, i), grad_scale);
    float mi = s.m[i], vi = s.v[i];
    const float pi =
        adamw_element(ld(p, i), gi, mi, vi, s.decay, w1, beta2, w2, bc2_sqrt, eps, step_size);
    s.m[i] = mi;
    s.v[i] = vi;
    st(p, i, pi);
    if (copy) st(copy, i, pi);
  }
}

__global__ void __launch_bounds__(kThreads)
    adamw_list_kernel(const __grid_constant__ AdamWBatch b, float grad_scale, float w1, float beta2,
                      float w2, float bc2_sqrt, float eps, float step_size) {
  int j = 0;
  while (j + 1 < b.count && b.first_block[j + 1] <= int(blockIdx.x)) ++j;
  const AdamWSlot& s = b.slot[j];
  const int64_t begin = int64_t(int(blockIdx.x) - b.first_block[j]) * kListChunk;
  const int64_t end = begin + kListChunk < s.n ? begin + kListChunk : s.n;
  RIG_K_DISPATCH(s.tp, P,
                 RIG_K_DISPATCH(s.tg, G,
                                (adamw_chunk<P, G>(s, begin, end, grad_scale, w1, beta2, w2,
                                                   bc2_sqrt, eps, step_size))));
}

}  // namespace

cudaError_t adamw_list(const AdamWSlot* slots, int count, float grad_scale, float w1, float beta2,
                       float w2, float bc2_sqrt, float eps, float step_size, cudaStream_t s) {
  if (count <= 0 || count > kAdamWSlotsPerLaunch) return cudaErrorInvalidValue;
  AdamWBatch b{};
  b.count = count;
  int64_t blocks = 0;
  for (int j = 0; j < count; ++j) {
    b.slot[j] = slots[j];
    b.first_block[j] = int(blocks);
    blocks += (slots[j].n + kListChunk - 1) / kListChunk;
    if (blocks >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  }
  b.first_block[count] = int(blocks);
  if (blocks == 0) return cudaSuccess;
  adamw_list_kernel<<<unsigned(blocks), kThreads, 0, s>>>(b, grad_scale, w1, beta2, w2, bc2_sqrt,
                                                          eps, step_size);
  return cudaGetLastError();
}

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
