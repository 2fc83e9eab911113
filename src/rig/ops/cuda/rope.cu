// Rotary embedding, Hugging Face half-split layout, in place: one thread per (row, head, pair).
// Backward is the same rotation with -sin (the transpose).
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename X, typename Tab>
__global__ void rope_kernel(X* x, const int64_t* pos, int64_t rows, int heads, int64_t d,
                            const Tab* cos, const Tab* sin, int64_t positions, float sgn,
                            DeviceError* err) {
  const int64_t half = d / 2, per_row = int64_t(heads) * half, total = rows * per_row;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = t / per_row, rem = t % per_row, h = rem / half, i = rem % half;
    const int64_t p = pos[r];
    if (p < 0 || p >= positions) {
      if (h == 0 && i == 0) rig_device_error(err, kBadRopePos, r, p, positions);
      continue;
    }
    const float c = ld(cos, p * half + i), s = sgn * ld(sin, p * half + i);
    const int64_t base = r * heads * d + h * d;
    const float x1 = ld(x, base + i), x2 = ld(x, base + i + half);
    st(x, base + i, x1 * c - x2 * s);
    st(x, base + i + half, x2 * c + x1 * s);
  }
}

}  // namespace

cudaError_t rope(T tx, void* x, const int64_t* pos, int64_t rows, int heads, int64_t head_dim,
                 T ttab, const void* cos, const void* sin, int64_t positions, bool backward,
                 DeviceError* err, cudaStream_t s) {
  const int64_t total = rows * heads * (head_dim / 2);
  if (total == 0) return cudaSuccess;
  RIG_K_DISPATCH(tx, X, RIG_K_DISPATCH(ttab, Tab, (rope_kernel<X, Tab><<<grid_for(total, 256), 256, 0, s>>>(
                                                       static_cast<X*>(x), pos, rows, heads, head_dim,
                                                       static_cast<const Tab*>(cos), static_cast<const Tab*>(sin),
                                                       positions, backward ? -1.0f : 1.0f, err))));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
