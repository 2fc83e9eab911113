// Causal attention with grouped kv heads and packed segments, forward and backward, fp32 math.
//
// Layout: q/out/dout/dq [B,T,Hq,D], k/v/dk/dv [B,T,Hk,D], lse and delta [B,Hq,T] float32.
// A query i sees key j when j <= i and seg[b,j] == seg[b,i] (no seg: plain causal).
//
// Forward (flash-style): a block of kWarps warps takes kWarps consecutive queries of one (b, h);
// it walks the visible keys in tiles of 32 staged in shared memory (float32, rows padded to D+1 so
// that lane j reading key j is conflict-free). Within a warp, lane j scores key j of the tile; the
// running max / sum are updated once per tile (online softmax) and each lane accumulates its own
// D/32 output dimensions. lse = max + log(sum) is saved.
//
// Backward recomputes p = exp(s - lse) and never stores [T,T]:
//  1. dq kernel, shaped like the forward: per query, delta = dout·out (saved for step 2),
//     ds_j = p_j (dout·v_j - delta) * scale, dq = sum_j ds_j k_j.
//  2. dk/dv kernel: a block of kWarps warps takes kWarps consecutive keys of one (b, kv head); each
//     warp owns its key and walks every query head of the group and the queries i >= j in tiles of
//     32, so dk_j = sum ds q and dv_j = sum p dout are summed by one warp in a fixed order: no
//     atomics, no races, deterministic.
// The head dimension is a runtime value up to 32*NT; NT (output dims per lane) is a template.
#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

constexpr int kWarps = 8;   // queries (forward, dq) or keys (dk/dv) per block
constexpr int kTile = 32;   // keys (forward, dq) or queries (dk/dv) per shared-memory tile

struct Geo {
  int T, Hq, Hk, D, group;
  float scale;
};

// Copies rows [r0, r0+kTile) of one head of a [B,T,H,D] tensor into sh[kTile][D+1] as float
// (rows past T become zeros).
template <typename E>
__device__ void load_tile(float* sh, const E* src, int b, int r0, int T, int H, int h, int D) {
  const int pitch = D + 1;
  for (int idx = threadIdx.x; idx < kTile * D; idx += blockDim.x) {
    const int r = idx / D, x = idx % D, row = r0 + r;
    sh[r * pitch + x] = row < T ? ld(src, ((int64_t(b) * T + row) * H + h) * D + x) : 0.0f;
  }
}

template <typename E>
__device__ void load_row(float* sh, const E* src, int64_t off, int D) {
  for (int x = threadIdx.x & 31; x < D; x += 32) sh[x] = ld(src, off + x);
}

__device__ __forceinline__ float dot_sh(const float* a, const float* b, int D) {
  float s = 0;
  for (int x = 0; x < D; ++x) s = fmaf(a[x], b[x], s);
  return s;
}

template <typename E, int NT>
__global__ void __launch_bounds__(kWarps * 32) attn_fwd_kernel(const E* q, const E* k, const E* v,
                                                               const int64_t* seg, E* out,
                                                               float* lse, Geo g) {
  extern __shared__ float smem[];
  const int D = g.D, pitch = D + 1;
  float* ks = smem;
  float* vs = ks + kTile * pitch;
  float* qs = vs + kTile * pitch;  // [kWarps][D]
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / g.group;
  const int i0 = blockIdx.x * kWarps, i = i0 + w;
  const int i_last = min(i0 + kWarps, g.T) - 1;
  const bool active = i < g.T;
  const int64_t qoff = ((int64_t(b) * g.T + i) * g.Hq + h) * D;
  if (active) load_row(qs + w * D, q, qoff, D);
  const int64_t si = (seg && active) ? seg[int64_t(b) * g.T + i] : 0;

  float m = -INFINITY, l = 0.0f, acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;

  for (int j0 = 0; j0 <= i_last; j0 += kTile) {
    __syncthreads();
    load_tile(ks, k, b, j0, g.T, g.Hk, hk, D);
    load_tile(vs, v, b, j0, g.T, g.Hk, hk, D);
    __syncthreads();
    if (!active || j0 > i) continue;
    const int j = j0 + lane;
    bool vis = j <= i;
    if (vis && seg) vis = seg[int64_t(b) * g.T + j] == si;
    const float s = vis ? dot_sh(qs + w * D, ks + lane * pitch, D) * g.scale : -INFINITY;
    const float mt = warp_max(s);
    if (mt == -INFINITY) continue;
    const float mn = fmaxf(m, mt);
    const float corr = expf(m - mn);  // m = -inf on the first visible tile: corr = 0
    const float p = vis ? expf(s - mn) : 0.0f;
    l = l * corr + warp_sum(p);
    m = mn;
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] *= corr;
    const int jn = min(kTile, i - j0 + 1);
    for (int jj = 0; jj < jn; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      if (pj == 0.0f) continue;
      const float* vr = vs + jj * pitch;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        if (x < D) acc[t] = fmaf(pj, vr[x], acc[t]);
      }
    }
  }
  if (!active) return;
  const float inv = 1.0f / l;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int x = lane + 32 * t;
    if (x < D) st(out, qoff + x, acc[t] * inv);
  }
  if (lane == 0) lse[(int64_t(b) * g.Hq + h) * g.T + i] = m + logf(l);
}

template <typename E, int NT>
__global__ void __launch_bounds__(kWarps * 32) attn_dq_kernel(const E* dout, const E* q,
                                                              const E* k, const E* v,
                                                              const int64_t* seg, const E* out,
                                                              const float* lse, float* delta,
                                                              E* dq, Geo g) {
  extern __shared__ float smem[];
  const int D = g.D, pitch = D + 1;
  float* ks = smem;
  float* vs = ks + kTile * pitch;
  float* qs = vs + kTile * pitch;  // [kWarps][D]
  float* dos = qs + kWarps * D;    // [kWarps][D]
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, h = blockIdx.y, hk = h / g.group;
  const int i0 = blockIdx.x * kWarps, i = i0 + w;
  const int i_last = min(i0 + kWarps, g.T) - 1;
  const bool active = i < g.T;
  const int64_t qoff = ((int64_t(b) * g.T + i) * g.Hq + h) * D;
  const int64_t roff = (int64_t(b) * g.Hq + h) * g.T + i;
  float dl = 0.0f, L = 0.0f;
  int64_t si = 0;
  if (active) {
    load_row(qs + w * D, q, qoff, D);
    load_row(dos + w * D, dout, qoff, D);
    float part = 0.0f;
    for (int x = lane; x < D; x += 32) part += ld(dout, qoff + x) * ld(out, qoff + x);
    dl = warp_sum(part);
    if (lane == 0) delta[roff] = dl;
    L = lse[roff];
    if (seg) si = seg[int64_t(b) * g.T + i];
  }
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;

  for (int j0 = 0; j0 <= i_last; j0 += kTile) {
    __syncthreads();
    load_tile(ks, k, b, j0, g.T, g.Hk, hk, D);
    load_tile(vs, v, b, j0, g.T, g.Hk, hk, D);
    __syncthreads();
    if (!active || j0 > i) continue;
    const int j = j0 + lane;
    bool vis = j <= i;
    if (vis && seg) vis = seg[int64_t(b) * g.T + j] == si;
    float ds = 0.0f;
    if (vis) {
      const float s = dot_sh(qs + w * D, ks + lane * pitch, D) * g.scale;
      const float p = expf(s - L);
      const float dp = dot_sh(dos + w * D, vs + lane * pitch, D);
      ds = p * (dp - dl) * g.scale;
    }
    const int jn = min(kTile, i - j0 + 1);
    for (int jj = 0; jj < jn; ++jj) {
      const float dj = __shfl_sync(0xffffffffu, ds, jj);
      if (dj == 0.0f) continue;
      const float* kr = ks + jj * pitch;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int x = lane + 32 * t;
        if (x < D) acc[t] = fmaf(dj, kr[x], acc[t]);
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int x = lane + 32 * t;
    if (x < D) st(dq, qoff + x, acc[t]);
  }
}

template <typename E, int NT>
__global__ void __launch_bounds__(kWarps * 32) attn_dkv_kernel(const E* dout, const E* q,
                                                               const E* k, const E* v,
                                                               const int64_t* seg,
                                                               const float* lse,
                                                               const float* delta, E* dk, E* dv,
                                                               Geo g) {
  extern __shared__ float smem[];
  const int D = g.D, pitch = D + 1;
  float* qs = smem;                  // [kTile][D+1]
  float* dos = qs + kTile * pitch;   // [kTile][D+1]
  float* kr = dos + kTile * pitch;   // [kWarps][D]
  float* vr = kr + kWarps * D;       // [kWarps][D]
  __shared__ float ls[kTile], dls[kTile];
  __shared__ int64_t ss[kTile];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.z, hk = blockIdx.y;
  const int j0 = blockIdx.x * kWarps, j = j0 + w;
  const bool active = j < g.T;
  const int64_t koff = ((int64_t(b) * g.T + j) * g.Hk + hk) * D;
  int64_t sj = 0;
  if (active) {
    load_row(kr + w * D, k, koff, D);
    load_row(vr + w * D, v, koff, D);
    if (seg) sj = seg[int64_t(b) * g.T + j];
  }
  float ak[NT], av[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) ak[t] = av[t] = 0.0f;

  const int first_tile = j0 / kTile * kTile;
  for (int h = hk * g.group; h < (hk + 1) * g.group; ++h)
    for (int i0 = first_tile; i0 < g.T; i0 += kTile) {
      __syncthreads();
      load_tile(qs, q, b, i0, g.T, g.Hq, h, D);
      load_tile(dos, dout, b, i0, g.T, g.Hq, h, D);
      if (threadIdx.x < kTile) {
        const int i = i0 + threadIdx.x;
        const int64_t roff = (int64_t(b) * g.Hq + h) * g.T + i;
        ls[threadIdx.x] = i < g.T ? lse[roff] : 0.0f;
        dls[threadIdx.x] = i < g.T ? delta[roff] : 0.0f;
        ss[threadIdx.x] = (seg && i < g.T) ? seg[int64_t(b) * g.T + i] : 0;
      }
      __syncthreads();
      if (!active || i0 + kTile - 1 < j) continue;
      const int i = i0 + lane;
      const bool vis = i < g.T && i >= j && (!seg || ss[lane] == sj);
      float p = 0.0f, ds = 0.0f;
      if (vis) {
        const float s = dot_sh(qs + lane * pitch, kr + w * D, D) * g.scale;
        p = expf(s - ls[lane]);
        const float dp = dot_sh(dos + lane * pitch, vr + w * D, D);
        ds = p * (dp - dls[lane]) * g.scale;
      }
      for (int ii = 0; ii < kTile; ++ii) {
        const float pi = __shfl_sync(0xffffffffu, p, ii);
        const float di = __shfl_sync(0xffffffffu, ds, ii);
        if (pi == 0.0f && di == 0.0f) continue;
        const float* qrow = qs + ii * pitch;
        const float* dorow = dos + ii * pitch;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int x = lane + 32 * t;
          if (x < D) {
            ak[t] = fmaf(di, qrow[x], ak[t]);
            av[t] = fmaf(pi, dorow[x], av[t]);
          }
        }
      }
    }
  if (!active) return;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int x = lane + 32 * t;
    if (x < D) {
      st(dk, koff + x, ak[t]);
      st(dv, koff + x, av[t]);
    }
  }
}

size_t fwd_smem(int D) { return sizeof(float) * (2 * kTile * (D + 1) + kWarps * D); }
size_t dq_smem(int D) { return sizeof(float) * (2 * kTile * (D + 1) + 2 * kWarps * D); }
size_t dkv_smem(int D) { return sizeof(float) * (2 * kTile * (D + 1) + 2 * kWarps * D); }

template <typename Kern>
cudaError_t allow_smem(Kern kern, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <typename E, int NT>
cudaError_t fwd(const E* q, const E* k, const E* v, const int64_t* seg, E* out, float* lse,
                const AttnDims& d, const Geo& g, cudaStream_t s) {
  const size_t sm = fwd_smem(d.D);
  cudaError_t e = allow_smem(attn_fwd_kernel<E, NT>, sm);
  if (e != cudaSuccess) return e;
  dim3 grid(unsigned((d.T + kWarps - 1) / kWarps), unsigned(d.Hq), unsigned(d.B));
  attn_fwd_kernel<E, NT><<<grid, kWarps * 32, sm, s>>>(q, k, v, seg, out, lse, g);
  return cudaGetLastError();
}

template <typename E, int NT>
cudaError_t bwd(const E* dout, const E* q, const E* k, const E* v, const int64_t* seg,
                const E* out, const float* lse, float* delta, E* dq, E* dk, E* dv,
                const AttnDims& d, const Geo& g, cudaStream_t s) {
  size_t sm = dq_smem(d.D);
  cudaError_t e = allow_smem(attn_dq_kernel<E, NT>, sm);
  if (e != cudaSuccess) return e;
  dim3 gq(unsigned((d.T + kWarps - 1) / kWarps), unsigned(d.Hq), unsigned(d.B));
  attn_dq_kernel<E, NT><<<gq, kWarps * 32, sm, s>>>(dout, q, k, v, seg, out, lse, delta, dq, g);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  sm = dkv_smem(d.D);
  if ((e = allow_smem(attn_dkv_kernel<E, NT>, sm)) != cudaSuccess) return e;
  dim3 gk(unsigned((d.T + kWarps - 1) / kWarps), unsigned(d.Hk), unsigned(d.B));
  attn_dkv_kernel<E, NT><<<gk, kWarps * 32, sm, s>>>(dout, q, k, v, seg, lse, delta, dk, dv, g);
  return cudaGetLastError();
}

Geo geo_of(const AttnDims& d) {
  return Geo{d.T, d.Hq, d.Hk, d.D, d.Hq / d.Hk, 1.0f / sqrtf(float(d.D))};
}

// Calls f.template operator()<NT>() with the smallest NT that covers D.
#define RIG_ATTN_NT(D, ...)                     \
  do {                                          \
    if ((D) <= 64) {                            \
      constexpr int NT = 2;                     \
      __VA_ARGS__;                              \
    } else if ((D) <= 96) {                     \
      constexpr int NT = 3;                     \
      __VA_ARGS__;                              \
    } else if ((D) <= 128) {                    \
      constexpr int NT = 4;                     \
      __VA_ARGS__;                              \
    } else {                                    \
      constexpr int NT = 8;                     \
      __VA_ARGS__;                              \
    }                                           \
  } while (0)

// One thread per (row b, token t, head h); consecutive threads walk heads, so the token-major
// side is read or written contiguously.
__global__ void lse_layout_kernel(const float* src, float* dst, int B, int T, int H,
                                  bool to_tokens) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(B) * T * H) return;
  const int64_t h = i % H, bt = i / H, b = bt / T, t = bt % T;
  const int64_t head_major = (b * H + h) * T + t;
  if (to_tokens)
    dst[i] = src[head_major];
  else
    dst[head_major] = src[i];
}

}  // namespace

int attention_max_head_dim() { return 256; }

cudaError_t lse_layout(const float* src, float* dst, int B, int T, int H, bool to_tokens,
                       cudaStream_t s) {
  const int64_t n = int64_t(B) * T * H;
  if (n == 0) return cudaSuccess;
  lse_layout_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(src, dst, B, T, H, to_tokens);
  return cudaGetLastError();
}

cudaError_t attention_fwd(T t, const void* q, const void* k, const void* v, const int64_t* seg,
                          void* out, float* lse, AttnDims d, cudaStream_t s) {
  if (d.B == 0 || d.T == 0 || d.Hq == 0) return cudaSuccess;
  const Geo g = geo_of(d);
  RIG_K_DISPATCH(t, E, RIG_ATTN_NT(d.D, return (fwd<E, NT>(static_cast<const E*>(q), static_cast<const E*>(k),
                                                            static_cast<const E*>(v), seg, static_cast<E*>(out),
                                                            lse, d, g, s))));
  return cudaSuccess;
}

cudaError_t attention_bwd(T t, const void* dout, const void* q, const void* k, const void* v,
                          const int64_t* seg, const void* out, const float* lse, float* delta,
                          void* dq, void* dk, void* dv, AttnDims d, cudaStream_t s) {
  if (d.B == 0 || d.T == 0 || d.Hq == 0) return cudaSuccess;
  const Geo g = geo_of(d);
  RIG_K_DISPATCH(t, E, RIG_ATTN_NT(d.D, return (bwd<E, NT>(static_cast<const E*>(dout), static_cast<const E*>(q),
                                                            static_cast<const E*>(k), static_cast<const E*>(v), seg,
                                                            static_cast<const E*>(out), lse, delta, static_cast<E*>(dq),
                                                            static_cast<E*>(dk), static_cast<E*>(dv), d, g, s))));
  return cudaSuccess;
}

}  // namespace rig::ops::cuda::k
