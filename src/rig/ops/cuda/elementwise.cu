// Element-wise ops: add_, scale_, sum_squares, dropout. Grid-stride loops, float math.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename A, typename B>
__global__ void add_kernel(A* a, const B* b, float alpha, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    st(a, i, ld(a, i) + alpha * ld(b, i));
}

template <typename A>
__global__ void scale_kernel(A* a, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    st(a, i, ld(a, i) * s);
}

template <typename S, typename D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    st(dst, i, ld(src, i));
}

// Each block sums a fixed, interleaved share of the elements in double; the partials are added in
// block order by sum_doubles, so the result does not depend on scheduling.
template <typename A>
__global__ void sumsq_kernel(const A* a, int64_t n, double* partial) {
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double x = ld(a, i);
    s += x * x;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_doubles_kernel(const double* partial, int n, double* out) {
  double s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = s;
}

struct SumSqBatch {
  SumSqSlot slot[kSumSqSlotsPerLaunch];
  int first_block[kSumSqSlotsPerLaunch + 1];
  int count;
};

// sumsq_kernel and sum_doubles_kernel with the grid split among the batch's tensors.
__device__ __forceinline__ int slot_of_block(const SumSqBatch& b) {
  int j = 0;
  while (j + 1 < b.count && b.first_block[j + 1] <= int(blockIdx.x)) ++j;
  return j;
}
__global__ void sumsq_multi_kernel(const __grid_constant__ SumSqBatch b, double* partial) {
  const int j = slot_of_block(b);
  const SumSqSlot& t = b.slot[j];
  const int64_t block = int(blockIdx.x) - b.first_block[j];
  double s = 0;
  RIG_K_DISPATCH(t.t, A, {
    const A* a = static_cast<const A*>(t.a);
    for (int64_t i = block * blockDim.x + threadIdx.x; i < t.n;
         i += int64_t(t.blocks) * blockDim.x) {
      const double x = ld(a, i);
      s += x * x;
    }
  });
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void sum_doubles_multi_kernel(const __grid_constant__ SumSqBatch b,
                                         const double* partial, double* sums) {
  const int j = blockIdx.x;
  const double* p = partial + b.first_block[j];
  double s = 0;
  for (int i = threadIdx.x; i < b.slot[j].blocks; i += blockDim.x) s += p[i];
  s = block_sum(s);
  if (threadIdx.x == 0) sums[j] = s;
}

// Counter-based randomness: the keep decision of element i depends only on (seed, i), so the
// mask is the same for any launch shape and can be regenerated in backward.
__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

template <typename X, typename O>
__global__ void dropout_kernel(const X* x, O* out, float p, float keep_scale, uint64_t seed,
                               int64_t n) {
  const uint64_t key = splitmix64(seed);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(key ^ uint64_t(i));
    const float u = float(r >> 40) * (1.0f / 16777216.0f);  // 24 bits in [0, 1)
    st(out, i, u < p ? 0.0f : ld(x, i) * keep_scale);
  }
}

constexpr int kThreads = 256;

}  // namespace

cudaError_t add(T ta, void* a, T tb, const void* b, float alpha, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RIG_K_DISPATCH(ta, A, RIG_K_DISPATCH(tb, B, (add_kernel<A, B><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                                                   static_cast<A*>(a), static_cast<const B*>(b), alpha, n))));
  return cudaGetLastError();
}

cudaError_t cast(T tsrc, const void* src, T tdst, void* dst, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RIG_K_DISPATCH(tsrc, S, RIG_K_DISPATCH(tdst, D, (cast_kernel<S, D><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                                                       static_cast<const S*>(src), static_cast<D*>(dst), n))));
  return cudaGetLastError();
}

cudaError_t scale(T ta, void* a, float sc, int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  RIG_K_DISPATCH(ta, A, (scale_kernel<A><<<grid_for(n, kThreads), kThreads, 0, s>>>(static_cast<A*>(a), sc, n)));
  return cudaGetLastError();
}

cudaError_t sum_squares_partial(T ta, const void* a, int64_t n, double* partial, int blocks,
                                cudaStream_t s) {
  RIG_K_DISPATCH(ta, A, (sumsq_kernel<A><<<blocks, kThreads, 0, s>>>(static_cast<const A*>(a), n, partial)));
  return cudaGetLastError();
}

cudaError_t sum_squares_multi(const SumSqSlot* slots, int count, double* partial, double* sums,
                              cudaStream_t s) {
  if (count <= 0 || count > kSumSqSlotsPerLaunch) return cudaErrorInvalidValue;
  SumSqBatch b{};
  b.count = count;
  int blocks = 0;
  for (int j = 0; j < count; ++j) {
    if (slots[j].blocks < 1 || slots[j].blocks > 1024) return cudaErrorInvalidValue;
    b.slot[j] = slots[j];
    b.first_block[j] = blocks;
    blocks += slots[j].blocks;
  }
  b.first_block[count] = blocks;
  sumsq_multi_kernel<<<blocks, kThreads, 0, s>>>(b, partial);
  sum_doubles_multi_kernel<<<count, 1024, 0, s>>>(b, partial, sums);
  return cudaGetLastError();
}

cudaError_t sum_doubles(const double* partial, int n, double* out, cudaStream_t s) {
  sum_doubles_kernel<<<1, 1024, 0, s>>>(partial, n, out);
  return cudaGetLastError();
}

cudaError_t dropout(T tx, const void* x, T to, void* out, float p, uint64_t seed, int64_t n,
                    cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const float keep = p > 0 ? 1.0f / (1.0f - p) : 1.0f;
  RIG_K_DISPATCH(tx, X, RIG_K_DISPATCH(to, O, (dropout_kernel<X, O><<<grid_for(n, kThreads), kThreads, 0, s>>>(
                                                   static_cast<const X*>(x), static_cast<O*>(out), p, keep, seed, n))));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
