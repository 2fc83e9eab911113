// Cross-entropy with ignore index -100: one block per row (online max/sum in float32, then the
// gradient written in place or into a tensor of its own dtype), then one block adds the row losses
// in row order (double) and counts the valid rows, so the host copies back a single small record.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename E, typename G>
__global__ void ce_row_kernel(const E* logits, const int64_t* targets, int64_t V, float scale,
                              G* dlogits, float* row_loss) {
  const int64_t r = blockIdx.x;
  const E* x = logits + r * V;
  G* dx = dlogits ? dlogits + r * V : nullptr;
  const int64_t t = targets[r];
  if (t < 0 || t >= V) {  // ignored (-100) or invalid (reported by the finishing kernel)
    if (dx)
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) st(dx, j, 0.0f);
    if (threadIdx.x == 0) row_loss[r] = 0.0f;
    return;
  }
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    const float v = ld(x, j);
    if (v > m) {
      s = s * expf(m - v) + 1.0f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  const float xt = ld(x, t);  // read before any thread passes the barriers below and writes dx
  const float M = block_max(m);
  const float S = block_sum(m == -INFINITY ? 0.0f : s * expf(m - M));
  const float lse = M + logf(S);
  if (threadIdx.x == 0) row_loss[r] = lse - xt;
  if (dx)
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float g = expf(ld(x, j) - lse) * scale;
      if (j == t) g -= scale;
      st(dx, j, g);
    }
}

__global__ void ce_finish_kernel(const float* row_loss, const int64_t* targets, int64_t rows,
                                 int64_t V, CeResult* out) {
  double loss = 0;
  long long count = 0, bad = rows;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const int64_t t = targets[r];
    if (t == -100) continue;
    if (t < 0 || t >= V) {
      bad = min(bad, (long long)r);
      continue;
    }
    loss += row_loss[r];
    ++count;
  }
  loss = block_sum(loss);
  const double c = block_sum(double(count));
  __shared__ long long sh_bad;
  if (threadIdx.x == 0) sh_bad = rows;
  __syncthreads();
  if (bad < rows) atomicMin(&sh_bad, bad);
  __syncthreads();
  if (threadIdx.x == 0) {
    out->loss = loss;
    out->count = (long long)c;
    out->bad_row = sh_bad < rows ? sh_bad : -1;
    out->bad_label = sh_bad < rows ? targets[sh_bad] : 0;
  }
}

int ce_threads(int64_t V) {
  if (V >= 8192) return 1024;
  if (V >= 1024) return 512;
  return 128;
}

}  // namespace

cudaError_t cross_entropy(T t, const void* logits, const int64_t* targets, int64_t rows, int64_t V,
                          float grad_scale, T td, void* dlogits, float* row_loss, CeResult* out,
                          cudaStream_t s) {
  if (rows > 0)
    RIG_K_DISPATCH(t, E,
                   RIG_K_DISPATCH(td, G,
                                  (ce_row_kernel<E, G><<<unsigned(rows), ce_threads(V), 0, s>>>(
                                      static_cast<const E*>(logits), targets, V, grad_scale,
                                      static_cast<G*>(dlogits), row_loss))));
  ce_finish_kernel<<<1, 1024, 0, s>>>(row_loss, targets, rows, V, out);
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
