// Token embedding: a row gather forward, a scatter-add backward (fp32 or bf16 atomics, so rows that
// share a token add in an unspecified order).
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename Tt, typename O>
__global__ void embedding_fwd_kernel(const int64_t* ids, const Tt* table, int64_t vocab, int64_t h,
                                     O* out, DeviceError* err) {
  const int64_t r = blockIdx.x;
  const int64_t id = ids[r];
  const bool ok = id >= 0 && id < vocab;
  if (!ok && threadIdx.x == 0) rig_device_error(err, kBadTokenId, r, id, vocab);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    st(out, r * h + j, ok ? ld(table, id * h + j) : 0.0f);
}

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(bf16* p, float v) {
  atomicAdd(p, __float2bfloat16_rn(v));
}

template <typename D, typename Tt>
__global__ void embedding_bwd_kernel(const int64_t* ids, const D* dout, Tt* dtable, int64_t vocab,
                                     int64_t h) {
  const int64_t r = blockIdx.x;
  const int64_t id = ids[r];
  if (id < 0 || id >= vocab) return;  // already reported by the forward
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    atomic_add(dtable + id * h + j, ld(dout, r * h + j));
}

}  // namespace

cudaError_t embedding_fwd(const int64_t* ids, int64_t rows, T tt, const void* table, int64_t vocab,
                          int64_t h, T to, void* out, DeviceError* err, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  RIG_K_DISPATCH(tt, Tt, RIG_K_DISPATCH(to, O, (embedding_fwd_kernel<Tt, O><<<unsigned(rows), 256, 0, s>>>(
                                                    ids, static_cast<const Tt*>(table), vocab, h, static_cast<O*>(out), err))));
  return cudaGetLastError();
}

cudaError_t embedding_bwd(const int64_t* ids, int64_t rows, T td, const void* dout, T tt,
                          void* dtable, int64_t vocab, int64_t h, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  RIG_K_DISPATCH(td, D, RIG_K_DISPATCH(tt, Tt, (embedding_bwd_kernel<D, Tt><<<unsigned(rows), 256, 0, s>>>(
                                                    ids, static_cast<const D*>(dout), static_cast<Tt*>(dtable), vocab, h))));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
