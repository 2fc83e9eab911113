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

// Eight pairs per thread (16-byte accesses of bf16, 32-bit index math): the scalar kernel above
// ran at about a quarter of the memory bandwidth on a 1B model's q and k. Needs half % 8 == 0
// and 16-byte aligned x and tables; `units` = rows * heads * half / 8 fits in 32 bits.
template <typename X, typename Tab>
__global__ void rope_vec_kernel(X* x, const int64_t* pos, uint32_t units, uint32_t heads,
                                uint32_t half, const Tab* cos, const Tab* sin, int64_t positions,
                                float sgn, DeviceError* err) {
  const uint32_t per_head = half / 8, per_row = heads * per_head;
  for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < units; u += gridDim.x * blockDim.x) {
    const uint32_t r = u / per_row, rem = u - r * per_row, h = rem / per_head;
    const uint32_t i = (rem - h * per_head) * 8;
    const int64_t p = pos[r];
    if (p < 0 || p >= positions) {
      if (rem == 0) rig_device_error(err, kBadRopePos, r, p, positions);
      continue;
    }
    float c[8], sn[8], x1[8], x2[8];
    ld8(cos, p * half + i, c);
    ld8(sin, p * half + i, sn);
    X* xh = x + (int64_t(r) * heads + h) * (2 * half);
    ld8(xh, i, x1);
    ld8(xh, i + half, x2);
    float y1[8], y2[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float si = sgn * sn[e];
      y1[e] = x1[e] * c[e] - x2[e] * si;
      y2[e] = x2[e] * c[e] + x1[e] * si;
    }
    st8(xh, i, y1);
    st8(xh, i + half, y2);
  }
}

}  // namespace

cudaError_t rope(T tx, void* x, const int64_t* pos, int64_t rows, int heads, int64_t head_dim,
                 T ttab, const void* cos, const void* sin, int64_t positions, bool backward,
                 DeviceError* err, cudaStream_t s) {
  const int64_t total = rows * heads * (head_dim / 2);
  if (total == 0) return cudaSuccess;
  const int64_t half = head_dim / 2, tab_bytes = ttab == T::F32 ? 4 : 2;
  if (half % 8 == 0 && total / 8 < (int64_t(1) << 31) &&
      is_vec_ok(half, int(tab_bytes), {cos, sin}) && is_vec_ok(half, tx == T::F32 ? 4 : 2, {x})) {
    const int64_t units = total / 8;
    RIG_K_DISPATCH(tx, X,
                   RIG_K_DISPATCH(ttab, Tab,
                                  (rope_vec_kernel<X, Tab><<<grid_for(units, 256), 256, 0, s>>>(
                                      static_cast<X*>(x), pos, uint32_t(units), uint32_t(heads),
                                      uint32_t(half), static_cast<const Tab*>(cos),
                                      static_cast<const Tab*>(sin), positions,
                                      backward ? -1.0f : 1.0f, err))));
    return cudaGetLastError();
  }
  RIG_K_DISPATCH(tx, X, RIG_K_DISPATCH(ttab, Tab, (rope_kernel<X, Tab><<<grid_for(total, 256), 256, 0, s>>>(
                                                       static_cast<X*>(x), pos, rows, heads, head_dim,
                                                       static_cast<const Tab*>(cos), static_cast<const Tab*>(sin),
                                                       positions, backward ? -1.0f : 1.0f, err))));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
