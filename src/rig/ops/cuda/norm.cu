// RMSNorm forward/backward and the bias ops. Rows are reduced by one block each; the column sums
// of the parameter gradients (dw, dbias) go through a deterministic two-pass reduction: fixed row
// chunks write float32 partials, then one pass adds the partials in chunk order into the gradient.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename X, typename W, typename Y>
__global__ void rmsnorm_fwd_kernel(const X* x, const W* w, float eps, Y* y, float* rstd, int64_t h) {
  const int64_t r = blockIdx.x;
  const X* xr = x + r * h;
  float ss = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const float v = ld(xr, j);
    ss += v * v;
  }
  ss = block_sum(ss);
  const float rs = rsqrtf(ss / float(h) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  // As Hugging Face: the normalised value is rounded to the activation dtype, then scaled.
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    st(y, r * h + j, ld(w, j) * round_as<X>(ld(xr, j) * rs));
}

template <typename DY, typename X, typename W, typename DX>
__global__ void rmsnorm_dx_kernel(const DY* dy, const X* x, const W* w, const float* rstd, DX* dx,
                                  int64_t h) {
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  float dot = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    dot += ld(dy, r * h + j) * ld(w, j) * ld(x, r * h + j);
  dot = block_sum(dot);
  const float c = dot / float(h) * rs * rs;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    st(dx, r * h + j, rs * (ld(dy, r * h + j) * ld(w, j) - ld(x, r * h + j) * c));
}

// The two kernels above on eight elements at a time (h a multiple of 8, rows 16-byte aligned).
template <typename X, typename W, typename Y>
__global__ void rmsnorm_fwd_vec_kernel(const X* x, const W* w, float eps, Y* y, float* rstd,
                                       int64_t h) {
  const int64_t r = blockIdx.x;
  const X* xr = x + r * h;
  float ss = 0;
  for (int64_t j = threadIdx.x * 8; j < h; j += blockDim.x * 8) {
    float v[8];
    ld8(xr, j, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
  }
  ss = block_sum(ss);
  const float rs = rsqrtf(ss / float(h) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  for (int64_t j = threadIdx.x * 8; j < h; j += blockDim.x * 8) {
    float v[8], wv[8];
    ld8(xr, j, v);
    ld8(w, j, wv);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = wv[e] * round_as<X>(v[e] * rs);
    st8(y + r * h, j, v);
  }
}

template <typename DY, typename X, typename W, typename C>
__global__ void rmsnorm_dx_add_vec_kernel(const DY* dy, const X* x, const W* w, const float* rstd,
                                          float* dh, C* copy, int64_t h) {
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  const DY* dyr = dy + r * h;
  const X* xr = x + r * h;
  float dot = 0;
  for (int64_t j = threadIdx.x * 8; j < h; j += blockDim.x * 8) {
    float a[8], b[8], c[8];
    ld8(dyr, j, a);
    ld8(w, j, b);
    ld8(xr, j, c);
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += a[e] * b[e] * c[e];
  }
  dot = block_sum(dot);
  const float c = dot / float(h) * rs * rs;
  for (int64_t j = threadIdx.x * 8; j < h; j += blockDim.x * 8) {
    float a[8], b[8], xv[8], d[8];
    ld8(dyr, j, a);
    ld8(w, j, b);
    ld8(xr, j, xv);
    ld8(dh + r * h, j, d);
#pragma unroll
    for (int e = 0; e < 8; ++e) d[e] += rs * (a[e] * b[e] - xv[e] * c);
    st8(dh + r * h, j, d);
    if (copy) st8(copy + r * h, j, d);
  }
}

// dh += dx (float32 residual gradient), and the sum written to copy (the next products' operand)
// when given: one pass instead of dx, an add and a cast.
template <typename DY, typename X, typename W, typename C>
__global__ void rmsnorm_dx_add_kernel(const DY* dy, const X* x, const W* w, const float* rstd,
                                      float* dh, C* copy, int64_t h) {
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  float dot = 0;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    dot += ld(dy, r * h + j) * ld(w, j) * ld(x, r * h + j);
  dot = block_sum(dot);
  const float c = dot / float(h) * rs * rs;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    const int64_t i = r * h + j;
    const float v = dh[i] + rs * (ld(dy, i) * ld(w, j) - ld(x, i) * c);
    dh[i] = v;
    if (copy) st(copy, i, v);
  }
}

constexpr int kColX = 32, kColY = 8;

// partial[chunk, j] = sum over the chunk's rows of dy[r, j] (* x[r, j] * rstd[r] for rmsnorm).
template <bool kNorm, typename DY, typename X>
__global__ void colsum_partial_kernel(const DY* dy, const X* x, const float* rstd, float* partial,
                                      int64_t rows, int64_t n, int64_t rows_per_chunk) {
  __shared__ float sh[kColY][kColX + 1];
  const int64_t j = int64_t(blockIdx.x) * kColX + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  float s = 0;
  if (j < n)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColY) {
      float v = ld(dy, r * n + j);
      if constexpr (kNorm) v *= ld(x, r * n + j) * rstd[r];
      s += v;
    }
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < n) {
    for (int y = 1; y < kColY; ++y) s += sh[y][threadIdx.x];
    partial[int64_t(blockIdx.y) * n + j] = s;
  }
}

template <typename G>
__global__ void colsum_finish_kernel(const float* partial, int chunks, int64_t n, G* grad) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n;
       j += int64_t(gridDim.x) * blockDim.x) {
    float s = 0;
    for (int c = 0; c < chunks; ++c) s += partial[int64_t(c) * n + j];
    st(grad, j, ld(grad, j) + s);
  }
}

template <typename Y, typename B>
__global__ void add_bias_kernel(Y* y, const B* b, int64_t total, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    st(y, i, ld(y, i) + ld(b, i % n));
}

int row_threads(int64_t h) {
  if (h >= 2048) return 512;
  if (h >= 512) return 256;
  return 128;
}

template <bool kNorm>
cudaError_t colsum(T tdy, const void* dy, T tx, const void* x, const float* rstd, T tg, void* grad,
                   float* partial, int64_t rows, int64_t n, cudaStream_t s) {
  const int chunks = colsum_chunks(rows);
  const int64_t per = (rows + chunks - 1) / chunks;
  dim3 grid(unsigned((n + kColX - 1) / kColX), unsigned(chunks)), block(kColX, kColY);
  RIG_K_DISPATCH(tdy, DY, RIG_K_DISPATCH(tx, X, (colsum_partial_kernel<kNorm, DY, X><<<grid, block, 0, s>>>(
                                                     static_cast<const DY*>(dy), static_cast<const X*>(x), rstd,
                                                     partial, rows, n, per))));
  RIG_K_DISPATCH(tg, G, (colsum_finish_kernel<G><<<grid_for(n, 256), 256, 0, s>>>(partial, chunks, n, static_cast<G*>(grad))));
  return cudaGetLastError();
}

}  // namespace

int colsum_chunks(int64_t rows) {
  int64_t c = (rows + 63) / 64;
  if (c < 1) c = 1;
  if (c > 128) c = 128;
  return int(c);
}

cudaError_t rmsnorm_fwd(T tx, const void* x, T tw, const void* w, float eps, T ty, void* y,
                        float* rstd, int64_t rows, int64_t h, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  const int th = row_threads(h);
  const bool vec = h % 8 == 0 && is_vec_ok(h, 2, {x, w, y});  // 8 elements: 16 bytes of bf16
  if (vec) {
    RIG_K_DISPATCH(
        tx, X,
        RIG_K_DISPATCH(
            tw, W,
            RIG_K_DISPATCH(ty, Y,
                           (rmsnorm_fwd_vec_kernel<X, W, Y><<<unsigned(rows), th, 0, s>>>(
                               static_cast<const X*>(x), static_cast<const W*>(w), eps,
                               static_cast<Y*>(y), rstd, h)))));
    return cudaGetLastError();
  }
  RIG_K_DISPATCH(tx, X, RIG_K_DISPATCH(tw, W, RIG_K_DISPATCH(ty, Y, (rmsnorm_fwd_kernel<X, W, Y><<<unsigned(rows), th, 0, s>>>(
                                                                         static_cast<const X*>(x), static_cast<const W*>(w), eps,
                                                                         static_cast<Y*>(y), rstd, h)))));
  return cudaGetLastError();
}

cudaError_t rmsnorm_bwd(T tdy, const void* dy, T tx, const void* x, T tw, const void* w,
                        const float* rstd, T tdx, void* dx, T tdw, void* dw, float* partial,
                        int64_t rows, int64_t h, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  const int th = row_threads(h);
  // dx and dy share a dtype in practice; the kernel allows dy, x, w and dx to differ.
  RIG_K_DISPATCH(tdy, DY, RIG_K_DISPATCH(tx, X, RIG_K_DISPATCH(tw, W, RIG_K_DISPATCH(tdx, DX, (rmsnorm_dx_kernel<DY, X, W, DX><<<unsigned(rows), th, 0, s>>>(
      static_cast<const DY*>(dy), static_cast<const X*>(x), static_cast<const W*>(w), rstd, static_cast<DX*>(dx), h))))));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return colsum<true>(tdy, dy, tx, x, rstd, tdw, dw, partial, rows, h, s);
}

cudaError_t rmsnorm_bwd_add(T tdy, const void* dy, T tx, const void* x, T tw, const void* w,
                            const float* rstd, float* dh, T tc, void* copy, T tdw, void* dw,
                            float* partial, int64_t rows, int64_t h, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  const int th = row_threads(h);
  const bool vec = h % 8 == 0 && is_vec_ok(h, 2, {dy, x, w, dh, copy});
  if (vec)
    RIG_K_DISPATCH(
        tdy, DY,
        RIG_K_DISPATCH(
            tx, X,
            RIG_K_DISPATCH(
                tw, W,
                RIG_K_DISPATCH(
                    tc, C,
                    (rmsnorm_dx_add_vec_kernel<DY, X, W, C><<<unsigned(rows), th, 0, s>>>(
                        static_cast<const DY*>(dy), static_cast<const X*>(x),
                        static_cast<const W*>(w), rstd, dh, static_cast<C*>(copy), h))))));
  else
    RIG_K_DISPATCH(
        tdy, DY,
        RIG_K_DISPATCH(
            tx, X,
            RIG_K_DISPATCH(
                tw, W,
                RIG_K_DISPATCH(
                    tc, C,
                    (rmsnorm_dx_add_kernel<DY, X, W, C><<<unsigned(rows), th, 0, s>>>(
                        static_cast<const DY*>(dy), static_cast<const X*>(x),
                        static_cast<const W*>(w), rstd, dh, static_cast<C*>(copy), h))))));
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !dw) return e;
  return colsum<true>(tdy, dy, tx, x, rstd, tdw, dw, partial, rows, h, s);
}

cudaError_t add_bias(T ty, void* y, T tb, const void* b, int64_t rows, int64_t n, cudaStream_t s) {
  const int64_t total = rows * n;
  if (total == 0) return cudaSuccess;
  RIG_K_DISPATCH(ty, Y, RIG_K_DISPATCH(tb, B, (add_bias_kernel<Y, B><<<grid_for(total, 256), 256, 0, s>>>(
                                                   static_cast<Y*>(y), static_cast<const B*>(b), total, n))));
  return cudaGetLastError();
}

cudaError_t bias_bwd(T tdy, const void* dy, T tdb, void* db, float* partial, int64_t rows,
                     int64_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return colsum<false>(tdy, dy, tdy, dy, nullptr, tdb, db, partial, rows, n, s);
}

}  // namespace rig::ops::cuda::k
