// Cross-entropy with ignore index -100: one block per row (online max/sum in float32, then the
// gradient written in place or into a tensor of its own dtype), then one block adds the row losses
// in row order (double) and counts the valid rows, so the host copies back a single small record.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

// Four consecutive elements as float: one 16-byte (float) or 8-byte (bf16) access.
template <typename E>
struct Quad;
template <>
struct Quad<float> {
  static __device__ __forceinline__ void load(const float* p, float (&o)[4]) {
    const float4 r = *reinterpret_cast<const float4*>(p);
    o[0] = r.x, o[1] = r.y, o[2] = r.z, o[3] = r.w;
  }
  static __device__ __forceinline__ void store(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};
template <>
struct Quad<bf16> {
  static __device__ __forceinline__ void load(const bf16* p, float (&o)[4]) {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    const bf16* e = reinterpret_cast<const bf16*>(&r);
    for (int j = 0; j < 4; ++j) o[j] = __bfloat162float(e[j]);
  }
  static __device__ __forceinline__ void store(bf16* p, const float (&v)[4]) {
    uint2 r;
    bf16* e = reinterpret_cast<bf16*>(&r);
    for (int j = 0; j < 4; ++j) e[j] = __float2bfloat16_rn(v[j]);
    *reinterpret_cast<uint2*>(p) = r;
  }
};

// Folds x into a running (max m, sum s of exp(. - m)).
__device__ __forceinline__ void online_add(float x, float& m, float& s) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;
    m = x;
  } else {
    s += expf(x - m);
  }
}

// QUAD: the row is read and written four elements at a time (V a multiple of 4 and the rows
// aligned to that), so each thread keeps more bytes in flight on the bandwidth-bound passes.
// The block's max M of the V elements at x and the sum S of exp(x - M) (block-wide barriers).
template <typename E, bool QUAD>
__device__ __forceinline__ void row_max_sum(const E* x, int64_t V, float& M, float& S) {
  float m = -INFINITY, s = 0.0f;
  if constexpr (QUAD) {
    for (int64_t j = 4 * int64_t(threadIdx.x); j < V; j += 4 * int64_t(blockDim.x)) {
      float v[4];
      Quad<E>::load(x + j, v);
      for (int i = 0; i < 4; ++i) online_add(v[i], m, s);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) online_add(ld(x, j), m, s);
  }
  M = block_max(m);
  S = block_sum(m == -INFINITY ? 0.0f : s * expf(m - M));
}

template <typename E, typename G, bool QUAD>
__global__ void ce_row_kernel(const E* logits, const int64_t* targets, int64_t V, float scale,
                              G* dlogits, float* row_loss, DeviceError* err) {
  const int64_t r = blockIdx.x;
  const E* x = logits + r * V;
  G* dx = dlogits ? dlogits + r * V : nullptr;
  const int64_t t = targets[r];
  if (t < 0 || t >= V) {  // ignored (-100) or invalid (recorded, raised at the next check)
    if (t != -100 && threadIdx.x == 0) rig_device_error(err, kBadLabel, r, t, V);
    if (dx)
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) st(dx, j, 0.0f);
    if (threadIdx.x == 0) row_loss[r] = 0.0f;
    return;
  }
  const float xt = ld(x, t);  // read before any thread passes the barriers below and writes dx
  float M, S;
  row_max_sum<E, QUAD>(x, V, M, S);
  const float lse = M + logf(S);
  if (threadIdx.x == 0) row_loss[r] = lse - xt;
  if (!dx) return;
  if constexpr (QUAD) {
    for (int64_t j = 4 * int64_t(threadIdx.x); j < V; j += 4 * int64_t(blockDim.x)) {
      float v[4];
      Quad<E>::load(x + j, v);
      for (int i = 0; i < 4; ++i) {
        v[i] = expf(v[i] - lse) * scale;
        if (j + i == t) v[i] -= scale;
      }
      Quad<G>::store(dx + j, v);
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float g = expf(ld(x, j) - lse) * scale;
      if (j == t) g -= scale;
      st(dx, j, g);
    }
  }
}

// A column slice [v0, v0 + Vc) of each row folded into its running (max, sum, target's logit).
template <typename E, bool QUAD>
__global__ void ce_slice_kernel(const E* logits, const int64_t* targets, int64_t Vc, int64_t v0,
                                float* stats) {
  const int64_t r = blockIdx.x;
  const int64_t t = targets[r];
  if (t == -100) return;
  const E* x = logits + r * Vc;
  float M, S;
  row_max_sum<E, QUAD>(x, Vc, M, S);
  if (threadIdx.x != 0) return;
  float* st = stats + 3 * r;
  const float m0 = st[0], mn = fmaxf(m0, M);
  if (mn != -INFINITY)
    st[1] = (m0 == -INFINITY ? 0.0f : st[1] * expf(m0 - mn)) +
            (M == -INFINITY ? 0.0f : S * expf(M - mn));
  st[0] = mn;
  if (t >= v0 && t < v0 + Vc) st[2] = ld(x, t - v0);
}

__global__ void ce_finish_kernel(float* stats, const int64_t* targets, int64_t rows, int64_t V,
                                 float* row_loss, DeviceError* err) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int64_t t = targets[r];
  if (t < 0 || t >= V) {
    if (t != -100) rig_device_error(err, kBadLabel, r, t, V);
    row_loss[r] = 0.0f;
    return;
  }
  const float lse = stats[3 * r] + logf(stats[3 * r + 1]);
  row_loss[r] = lse - stats[3 * r + 2];
  stats[3 * r] = lse;
}

template <typename E, bool QUAD>
__global__ void ce_slice_bwd_kernel(E* logits, const int64_t* targets, int64_t Vc, int64_t v0,
                                    const float* stats, float scale) {
  const int64_t r = blockIdx.x;
  const int64_t t = targets[r];
  E* x = logits + r * Vc;
  if (t < 0) {  // ignored; a bad label was recorded by the finish
    for (int64_t j = threadIdx.x; j < Vc; j += blockDim.x) st(x, j, 0.0f);
    return;
  }
  const float lse = stats[3 * r];
  if constexpr (QUAD) {
    for (int64_t j = 4 * int64_t(threadIdx.x); j < Vc; j += 4 * int64_t(blockDim.x)) {
      float v[4];
      Quad<E>::load(x + j, v);
      for (int i = 0; i < 4; ++i) {
        v[i] = expf(v[i] - lse) * scale;
        if (v0 + j + i == t) v[i] -= scale;
      }
      Quad<E>::store(x + j, v);
    }
  } else {
    for (int64_t j = threadIdx.x; j < Vc; j += blockDim.x) {
      float g = expf(ld(x, j) - lse) * scale;
      if (v0 + j == t) g -= scale;
      st(x, j, g);
    }
  }
}

int ce_threads(int64_t V) {
  if (V >= 8192) return 1024;
  if (V >= 1024) return 512;
  return 128;
}

}  // namespace

cudaError_t cross_entropy(T t, const void* logits, const int64_t* targets, int64_t rows, int64_t V,
                          float grad_scale, T td, void* dlogits, float* row_loss, DeviceError* err,
                          cudaStream_t s) {
  // Quads need every row start aligned: V a multiple of 4 and 16-byte aligned bases.
  const bool quad = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dlogits) % 16 == 0;
  if (rows > 0)
    RIG_K_DISPATCH(t, E, RIG_K_DISPATCH(td, G, {
                     auto* x = static_cast<const E*>(logits);
                     auto* dx = static_cast<G*>(dlogits);
                     if (quad)
                       ce_row_kernel<E, G, true><<<unsigned(rows), ce_threads(V), 0, s>>>(
                           x, targets, V, grad_scale, dx, row_loss, err);
                     else
                       ce_row_kernel<E, G, false><<<unsigned(rows), ce_threads(V), 0, s>>>(
                           x, targets, V, grad_scale, dx, row_loss, err);
                   }));
  return cudaGetLastError();
}

cudaError_t cross_entropy_slice(T t, const void* logits, const int64_t* targets, int64_t rows,
                                int64_t Vc, int64_t v0, float* stats, cudaStream_t s) {
  const bool quad = Vc % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (rows > 0)
    RIG_K_DISPATCH(t, E, {
      auto* x = static_cast<const E*>(logits);
      if (quad)
        ce_slice_kernel<E, true>
            <<<unsigned(rows), ce_threads(Vc), 0, s>>>(x, targets, Vc, v0, stats);
      else
        ce_slice_kernel<E, false>
            <<<unsigned(rows), ce_threads(Vc), 0, s>>>(x, targets, Vc, v0, stats);
    });
  return cudaGetLastError();
}

cudaError_t cross_entropy_finish(float* stats, const int64_t* targets, int64_t rows, int64_t V,
                                 float* row_loss, DeviceError* err, cudaStream_t s) {
  if (rows > 0)
    ce_finish_kernel<<<unsigned((rows + 255) / 256), 256, 0, s>>>(stats, targets, rows, V, row_loss,
                                                                  err);
  return cudaGetLastError();
}

cudaError_t cross_entropy_slice_backward(T t, void* logits, const int64_t* targets, int64_t rows,
                                         int64_t Vc, int64_t v0, const float* stats,
                                         float grad_scale, cudaStream_t s) {
  const bool quad = Vc % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  if (rows > 0)
    RIG_K_DISPATCH(t, E, {
      auto* x = static_cast<E*>(logits);
      if (quad)
        ce_slice_bwd_kernel<E, true>
            <<<unsigned(rows), ce_threads(Vc), 0, s>>>(x, targets, Vc, v0, stats, grad_scale);
      else
        ce_slice_bwd_kernel<E, false>
            <<<unsigned(rows), ce_threads(Vc), 0, s>>>(x, targets, Vc, v0, stats, grad_scale);
    });
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
