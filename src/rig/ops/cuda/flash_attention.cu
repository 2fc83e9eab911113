// Tensor-core causal attention, FlashAttention-2 style: bf16 operands, fp32 accumulation,
// mma.sync.m16n8k16 fed by ldmatrix from shared memory, cp.async tile loads. Runs on sm_80..sm_90
// (no wgmma: the RTX 4090 has none). Never stores a T x T matrix.
//
// Layout: q/out/dout/dq [B,T,Hq,D], k/v/dk/dv [B,T,Hk,D] bf16; lse/delta [B,Hq,T] fp32.
// Query i sees key j iff j <= i and (no seg, or seg[b,j] == seg[b,i]).
//
// Kernels
//  seg_info   per batch row: each position's `first` (first position with the same id: equal
//             `first` <=> same segment, an int32 compare) and, when the ids never decrease (what
//             rig's packer makes), each segment's last position.
//  tile_list  per batch row, with segments: the tiles the blocks take, longest first. Ids that
//             never decrease: tiles cut from each segment's start, so no tile holds two segments
//             and only the causal diagonal is masked (varlen scheduling). Otherwise tiles of
//             [0, T), every element masked by segment: still exact, no skipping.
//  fwd        one block per (b, query head, BM query rows), or per (b, query head) share of the
//             tile list; walks key tiles left to right with the online softmax. Each warp owns
//             16*MT full query rows, so row max / sum need only a quad shuffle. K/V tiles
//             double-buffered: tile n+1 loads under tile n's math.
//  delta      rowsum(dout * out), fp32, into the workspace.
//  bwd_dq     one block per (b, query head, 16*NW query rows), key tiles double-buffered:
//             S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K. Q and dO live in registers.
//  bwd_dkdv   one block per (b, kv head, 16*NW keys); each warp owns 16 keys ("keys as rows"), so
//             P^T and dS^T come out of the MMA already in the A-operand layout of dV += P^T dO and
//             dK += dS^T Q: nothing goes through shared memory but Q, dO, K, V. Loops over every
//             query head of the group and the query tiles in a fixed order: deterministic.
//
// Masks: a tile is masked per element only on the causal diagonal, at its run's end (T or the
// segment's end), or in rows whose ids are not sorted; everything else runs the unmasked path.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "rig/ops/cuda/flash_attention.h"

namespace rig::ops::cuda::k {

namespace {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;

// ================================================================ parameters

struct FlashParams {
  const bf16 *q, *k, *v, *o, *dout;
  bf16 *out, *dq, *dk, *dv;
  float* lse;           // fwd output
  const float* lse_in;  // bwd input
  float* delta;         // [B,Hq,T] (bwd workspace)
  const int64_t* seg;   // [B,T] or nullptr (read by the pre-pass only)
  const int *mono, *first, *last;  // seg_info_kernel's output, nullptr without seg
  // tile_list_kernel's output with seg, nullptr without: per batch row, `cap` int4 {i0, s, e,
  // masked} longest first and their count; the forward's tiles of BM rows, dQ's (and dK/dV's,
  // read in the dK/dV order) of 64.
  const int4 *fwd_tiles, *dq_tiles, *kv_tiles;
  const int *fwd_count, *dq_count, *kv_count;
  int fwd_cap, bwd_cap;
  int B, T, Hq, Hk, group;
  float scale, sl2;  // sl2 = scale * log2(e): scores go to exp2 in one FMA
};

// ================================================================ PTX wrappers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte async copy; pred false zero-fills (rows past T read as zeros, never garbage).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// c += a * b, m16n8k16, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// ================================================================ shared-memory tiles
// A tile is rows of D bf16 in 16-byte chunks. ldmatrix reads 8 rows at one chunk column; to keep
// those 8 reads in distinct banks, D % 64 == 0 XOR-swizzles the chunk with the row (no padding,
// so D=128 tiles fit the 4090's 99 KB), other D pad each row by one chunk (odd pitch).

template <int D>
struct Tile {
  static constexpr int C = D / 8;  // chunks per row
  static constexpr bool kSwz = (C % 8) == 0;
  static constexpr int P = kSwz ? C : C + 1;   // row pitch in chunks
  static constexpr int kRowBytes = P * 16;
  __device__ static __forceinline__ uint32_t off(int r, int c) {
    return uint32_t(r * P + (kSwz ? (c ^ (r & 7)) : c)) * 16u;
  }
};

// Rows [r0, r0+R) of one head (g points at row 0 of that head; rows are `stride` elements apart)
// into the tile at s; rows >= T are zero-filled. Each thread keeps one chunk column and steps
// down the rows, so its shared address only moves by constants (RPP % 8 == 0 keeps the swizzle).
template <int D, int R, int NT>
__device__ __forceinline__ void load_tile(uint32_t s, const bf16* g, int64_t stride, int r0, int T,
                                          int tid) {
  constexpr int C = D / 8, RPP = NT / C, PASSES = (R + RPP - 1) / RPP;
  static_assert(!Tile<D>::kSwz || RPP % 8 == 0, "swizzle needs 8-row steps");
  const int rr = tid / C, c = tid % C;
  if (rr >= RPP) return;
  const uint32_t sd = s + Tile<D>::off(rr, c);
  const bf16* src = g + int64_t(r0 + rr) * stride + c * 8;
  const int64_t step = int64_t(RPP) * stride;
#pragma unroll
  for (int ps = 0; ps < PASSES; ++ps) {
    const int r = ps * RPP + rr;
    if (R % RPP == 0 || r < R) {
      const bool ok = r0 + r < T;
      cp_async16(sd + uint32_t(ps * RPP * Tile<D>::kRowBytes), ok ? src + ps * step : g, ok);
    }
  }
}

// Per-lane ldmatrix addresses. A lane reads row rl + R0 and chunk cl + C0 of a tile (R0 % 8 == 0,
// C0 even, both compile-time after unrolling). The lane's own offset already holds the swizzle
// bits (cl ^ rl & 7) of the 16-byte chunk; R0 only adds whole rows and C0 only flips chunk bits
// above bit 0, so an address is one add and one xor away, with no register per (R0, C0).
// Patterns:
//   A operand (16 rows x 16 k), and B via .trans (rows k, columns n):  rl = lane & 15, cl = lane >> 4
//   B operand, rows n and columns k (K in Q K^T):  rl = (lane & 7) + (lane >> 4) * 8, cl = (lane >> 3) & 1
template <int D>
struct Lanes {
  static constexpr int RB = Tile<D>::kRowBytes;
  uint32_t off;
  __device__ __forceinline__ Lanes(int rl, int cl)
      : off(Tile<D>::kSwz ? uint32_t(rl * RB + ((cl ^ (rl & 7)) << 4)) : uint32_t(rl * RB + cl * 16)) {}
  // Re-read each tile iteration: keeps the compiler from hoisting one register per address.
  __device__ __forceinline__ Lanes fresh() const {
    Lanes r = *this;
    asm volatile("" : "+r"(r.off));
    return r;
  }
  __device__ __forceinline__ uint32_t operator()(uint32_t s, int R0, int C0) const {
    if constexpr (Tile<D>::kSwz) return s + ((off + uint32_t(R0 * RB)) ^ uint32_t(C0 << 4));
    else return s + off + uint32_t(R0 * RB + C0 * 16);
  }
};
template <int D>
__device__ __forceinline__ Lanes<D> lanes_a(int lane) { return Lanes<D>(lane & 15, lane >> 4); }
template <int D>
__device__ __forceinline__ Lanes<D> lanes_bn(int lane) {
  return Lanes<D>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
}

// ================================================================ segment pre-pass

// Grid (position blocks, B). first[i]: the first position of the row holding seg[i]'s id, so two
// positions share a segment iff their `first` agree (int32 compares, whatever the ids are).
// Non-decreasing ids (the packer's): first by binary search, and last[i] the segment's last position;
// the tile loops start and stop there. Otherwise first by a linear search and last = T-1: no skipping.
// Every block checks the whole row's order itself (a few loads a thread) rather than waiting on one.
constexpr int kSegThreads = 256;
__global__ void __launch_bounds__(kSegThreads) seg_info_kernel(const int64_t* seg, int T, int* mono,
                                                                int* first, int* last) {
  const int b = blockIdx.y;
  const int64_t* s = seg + int64_t(b) * T;
  int bad = 0;
  for (int i = threadIdx.x + 1; i < T; i += blockDim.x) bad |= s[i] < s[i - 1];
  const int ok = __syncthreads_and(!bad);
  if (blockIdx.x == 0 && threadIdx.x == 0) mono[b] = ok;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < T) {
    const int64_t v = s[i];
    int lo = i, hi = T - 1;
    if (ok) {
      int a = 0, z = i;  // first index in [0, i] with s >= v
      while (a < z) {
        const int mid = (a + z) >> 1;
        if (s[mid] < v) a = mid + 1; else z = mid;
      }
      lo = a;
      a = i, z = T - 1;  // last index in [i, T) with s <= v
      while (a < z) {
        const int mid = (a + z + 1) >> 1;
        if (s[mid] > v) z = mid - 1; else a = mid;
      }
      hi = a;
    } else {
      for (int j = 0; j < i; ++j)
        if (s[j] == v) {
          lo = j;
          break;
        }
    }
    first[int64_t(b) * T + i] = lo;
    last[int64_t(b) * T + i] = hi;
  }
}

// Per batch row: the tiles of TILE positions a kernel's blocks take, longest first, as int4
// {i0, s, e, masked} (see Work). Rows with non-decreasing ids: each segment [s, e) is cut into
// tiles from s, bucketed by cost (the forward and dQ: tile k of a segment sees k + 1 key tiles;
// dK/dV, REMAINING: n - k query tiles) with a counting sort; the order inside a bucket is whatever
// the atomics give, which changes no result (every tile is computed alone). Other rows: TILE
// tiles of [0, T), masked. One block per batch row; K buckets (the costliest are merged into the
// last), 2K ints of dynamic shared memory.
template <int TILE, bool REMAINING>
__global__ void __launch_bounds__(1024)
    tile_list_kernel(const int64_t* seg, int T, const int* mono, const int* last, int K, int cap,
                     int4* tiles, int* count) {
  extern __shared__ int sh[];
  int *hist = sh, *base = sh + K;
  __shared__ int part[1024];
  const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  const int64_t* sg = seg + int64_t(b) * T;
  const int* lst = last + int64_t(b) * T;
  int4* out = tiles + int64_t(b) * cap;
  if (!mono[b]) {
    const int n = (T + TILE - 1) / TILE;
    for (int k = tid; k < n; k += nt) {
      const int t = REMAINING ? k : n - 1 - k;
      out[k] = make_int4(t * TILE, 0, T, 1);
    }
    if (tid == 0) count[b] = n;
    return;
  }
  auto bucket = [&](int k, int n) { return min(REMAINING ? n - 1 - k : k, K - 1); };
  for (int k = tid; k < K; k += nt) hist[k] = 0;
  __syncthreads();
  for (int i = tid; i < T; i += nt) {
    if (i > 0 && sg[i] == sg[i - 1]) continue;  // not a segment's start
    const int n = (lst[i] - i + TILE) / TILE;
    for (int k = 0; k < n; ++k) atomicAdd(&hist[bucket(k, n)], 1);
  }
  __syncthreads();
  // base[k]: the tiles of the buckets above k. Each thread sums a chunk of buckets; suffix sums
  // of the chunks (Hillis-Steele), then each thread fills its own chunk.
  const int chunk = (K + nt - 1) / nt, k0 = min(K, tid * chunk), k1 = min(K, k0 + chunk);
  int sum = 0;
  for (int k = k0; k < k1; ++k) sum += hist[k];
  part[tid] = sum;
  __syncthreads();
  for (int off = 1; off < nt; off <<= 1) {
    const int v = tid + off < nt ? part[tid + off] : 0;
    __syncthreads();
    part[tid] += v;
    __syncthreads();
  }
  int above = tid + 1 < nt ? part[tid + 1] : 0;
  for (int k = k1 - 1; k >= k0; --k) {
    base[k] = above;
    above += hist[k];
  }
  if (tid == 0) count[b] = part[0];
  __syncthreads();
  for (int k = tid; k < K; k += nt) hist[k] = 0;  // now each bucket's cursor
  __syncthreads();
  for (int i = tid; i < T; i += nt) {
    if (i > 0 && sg[i] == sg[i - 1]) continue;
    const int e = lst[i] + 1, n = (e - i + TILE - 1) / TILE;
    for (int k = 0; k < n; ++k) {
      const int c = bucket(k, n);
      out[base[c] + atomicAdd(&hist[c], 1)] = make_int4(i + k * TILE, i, e, 0);
    }
  }
}

// One block's work: query rows [i0, i0 + BM) (forward, dQ) or keys [i0, i0 + BN) (dK/dV) of
// the run [s, e) of batch row b: positions before s are not visible to it, positions from e on
// are treated as absent (zero-filled, never stored). Rows with non-decreasing segment ids (what
// rig's packer makes) get tiles that start at their segment's start (tile_list_kernel), so a
// tile never holds two segments and only the causal diagonal is masked. Otherwise s = 0, e = T,
// and segments, if any, are masked per element (`masked`).
struct Work {
  int i0, s, e;
  bool masked;
};
// Blocks without a tile list (no segments): tile y of T from the end, longest rows first.
__device__ __forceinline__ Work plain_work(int T, int tile, int y_from_end) {
  return Work{y_from_end * tile, 0, T, false};
}
__device__ __forceinline__ Work listed_work(const int4* tiles, int it) {
  const int4 t = tiles[it];
  return Work{t.x, t.y, t.z, t.w != 0};
}

// Query rows' segment facts for masked work (forward and dQ): each position's `first`, so two
// positions share a segment iff their `first` agree. Warp range of rows [r0, r1]: lo = the first
// key tile position any of them can see (INT_MAX past e: nothing to do), hi = from where on key
// sub-tiles need no segment mask (INT_MAX when masked: every tile is checked).
struct QuerySeg {
  const int* first = nullptr;  // this batch row's `first` when the work is masked
  __device__ QuerySeg(const FlashParams& p, int b, const Work& wk) {
    if (wk.masked) first = p.first + int64_t(b) * p.T;
  }
  __device__ void warp_range(int r0, int e, int& lo, int& hi) const {
    lo = r0 >= e ? INT_MAX : 0;
    hi = first ? INT_MAX : 0;
  }
};
// Copies `first` of positions [r0, r0+R) into shared ints (past T: 0, masked causally anyway).
template <int R, int NT>
__device__ __forceinline__ void load_first(int* dst, const int* first, int r0, int T, int tid) {
  for (int x = tid; x < R; x += NT) {
    const bool ok = r0 + x < T;
    cp_async4(smem_u32(dst + x), first + (ok ? r0 + x : 0), ok);
  }
}

// ================================================================ forward

// MT m16 row tiles per warp, NW warps: BM = 16*MT*NW query rows; key tiles of BN, double-buffered,
// computed BNS keys at a time (a smaller S in registers: at D=128 the 128 accumulators of O leave
// no room for a 64-wide S). Shared rows: Q [0, BM), buffer c: K at BM + 2BN c, V after it; then
// the segment ids (`first`) of the Q rows [BM] and of each buffer's keys [2][BN], and each warp's
// QuerySeg range [NW][2] (kept there, not in registers: at D=128 there are none to spare).
// Long on purpose: one tile's loads, products, softmax and stores share dozens of register
// arrays (the accumulators), which helpers would have to pass by reference through every stage.
template <int D, int MT, int NW, int BN, int BNS>
__device__ __forceinline__ void fwd_tile(const FlashParams& p, unsigned char* smem, int b, int h,
                                         const Work& wk) {
  constexpr int BM = 16 * MT * NW, NT = NW * 32, KS = D / 16, NN = BNS / 8, ND = D / 8;
  constexpr int RB = Tile<D>::kRowBytes;
  static_assert(BN % BNS == 0 && BNS % 16 == 0, "sub-tiles of whole k16 steps");
  const uint32_t s0 = smem_u32(smem);
  auto sK = [&](int c) { return s0 + uint32_t((BM + 2 * BN * c) * RB); };
  auto sV = [&](int c) { return sK(c) + uint32_t(BN * RB); };
  int* sFq = reinterpret_cast<int*>(smem + (BM + 4 * BN) * RB);
  int* sFk = sFq + BM;
  int* sW = sFk + 2 * BN;

  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  // T is the layout's stride; E bounds the rows and keys that exist for this work.
  const int T = p.T, E = wk.e, hk = h / p.group, i0 = wk.i0;
  const int i_last = min(i0 + BM, E) - 1;
  const QuerySeg qs(p, b, wk);
  const int jb = wk.s, n_end = (i_last - jb) / BN + 1;  // key tiles at jb + n*BN

  const int64_t qstride = int64_t(p.Hq) * D, kstride = int64_t(p.Hk) * D;
  const bf16* kg = p.k + (int64_t(b) * T * p.Hk + hk) * D;
  const bf16* vg = p.v + (int64_t(b) * T * p.Hk + hk) * D;
  load_tile<D, BM, NT>(s0, p.q + (int64_t(b) * T * p.Hq + h) * D, qstride, i0, E, tid);
  load_tile<D, BN, NT>(sK(0), kg, kstride, jb, E, tid);
  load_tile<D, BN, NT>(sV(0), vg, kstride, jb, E, tid);
  if (qs.first) {
    load_first<BM, NT>(sFq, qs.first, i0, E, tid);
    load_first<BN, NT>(sFk, qs.first, jb, E, tid);
  }
  cp_commit();

  const int wr0 = i0 + w * 16 * MT;  // the warp's first query row
  if (lane == 0) qs.warp_range(wr0, E, sW[2 * w], sW[2 * w + 1]);
  const Lanes<D> lq0(w * 16 * MT + (lane & 15), lane >> 4), lk0 = lanes_bn<D>(lane),
      lv0 = lanes_a<D>(lane);

  float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < ND; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }
  cp_wait<0>();
  __syncthreads();

  for (int n = 0; n < n_end; ++n) {
    const int cur = n & 1, j0 = jb + n * BN;
    if (n + 1 < n_end) {
      load_tile<D, BN, NT>(sK(cur ^ 1), kg, kstride, j0 + BN, E, tid);
      load_tile<D, BN, NT>(sV(cur ^ 1), vg, kstride, j0 + BN, E, tid);
      if (qs.first) load_first<BN, NT>(sFk + (cur ^ 1) * BN, qs.first, j0 + BN, E, tid);
    }
    cp_commit();
    const uint32_t sk = sK(cur), sv = sV(cur);
    const int* fk = sFk + cur * BN - j0;  // fk[col]: the key's segment
#pragma unroll
    for (int sub = 0; sub < BN / BNS; ++sub) {
      const int js = j0 + sub * BNS;
      if (js > wr0 + 16 * MT - 1) break;  // no key from here on is visible to this warp's rows
      if (js + BNS - 1 < sW[2 * w]) continue;  // all before the segments of this warp's rows
      const Lanes<D> lq = lq0.fresh(), lk = lk0.fresh();
      float s[MT][NN][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldsm4(a[mt], lq(s0, mt * 16, 2 * kk));
#pragma unroll
        for (int np = 0; np < NN / 2; ++np) {
          uint32_t bb[4];
          ldsm4(bb, lk(sk, sub * BNS + np * 16, 2 * kk));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma(s[mt][2 * np], a[mt], bb[0], bb[1]);
            mma(s[mt][2 * np + 1], a[mt], bb[2], bb[3]);
          }
        }
      }

      if (js + BNS - 1 > wr0 || sW[2 * w + 1] > js) {
#pragma unroll
        for (int nt = 0; nt < NN; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = js + nt * 8 + 2 * t4 + e;
            const int ks = qs.first ? fk[col] : 0;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const int row = wr0 + mt * 16 + g + 8 * r;
                const int rs = qs.first ? sFq[row - i0] : 0;
                if (!(col <= row && ks == rs)) s[mt][nt][2 * r + e] = -INFINITY;
              }
          }
      }

      // Online softmax on unscaled scores; each row lives in one quad.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < NN; ++nt)
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mn = fmaxf(m[mt][r], mx);
          const float mu = mn == -INFINITY ? 0.0f : mn;  // a row with nothing visible yet
          const float corr = ex2((m[mt][r] - mu) * p.sl2);
          m[mt][r] = mn;
          const float off = mu * p.sl2;
          float rs = 0.0f;
#pragma unroll
          for (int nt = 0; nt < NN; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = ex2(fmaf(s[mt][nt][2 * r + e], p.sl2, -off));
              s[mt][nt][2 * r + e] = pv;
              rs += pv;
            }
          l[mt][r] = l[mt][r] * corr + rs;  // this thread's columns; the quad sums at the end
#pragma unroll
          for (int nt = 0; nt < ND; ++nt) {
            o[mt][nt][2 * r] *= corr;
            o[mt][nt][2 * r + 1] *= corr;
          }
        }

      // O += P V; the S accumulators already are P's A-operand layout.
      const Lanes<D> lv = lv0.fresh();
#pragma unroll
      for (int kk = 0; kk < BNS / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          uint32_t bb[4];
          ldsm4t(bb, lv(sv, sub * BNS + kk * 16, 2 * np));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma(o[mt][2 * np], a[mt], bb[0], bb[1]);
            mma(o[mt][2 * np + 1], a[mt], bb[2], bb[3]);
          }
        }
      }
    }
    cp_wait<0>();
    __syncthreads();  // next tile landed; every warp is done with this one
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lt = l[mt][r];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const int row = wr0 + mt * 16 + g + 8 * r;
      if (row >= E) continue;
      const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
      bf16* orow = p.out + ((int64_t(b) * T + row) * p.Hq + h) * D;
#pragma unroll
      for (int nt = 0; nt < ND; ++nt)
        *reinterpret_cast<uint32_t*>(orow + nt * 8 + 2 * t4) =
            pack_bf16(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv);
      if (t4 == 0)
        p.lse[(int64_t(b) * p.Hq + h) * T + row] =
            lt > 0.0f ? m[mt][r] * p.scale + logf(lt) : -INFINITY;
    }
}

// Grid (B * Hq, Y): without a tile list, block y takes query tile Y-1-y; with one, the listed
// tiles y, y + Y, ... of its batch row (the list is sorted longest first).
template <int D, int MT, int NW, int BN, int BNS>
__global__ void __launch_bounds__(NW * 32) flash_fwd_kernel(const FlashParams p) {
  constexpr int BM = 16 * MT * NW;
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
  if (!p.fwd_tiles) {
    fwd_tile<D, MT, NW, BN, BNS>(p, smem, b, h, plain_work(p.T, BM, gridDim.y - 1 - blockIdx.y));
    return;
  }
  const int4* tiles = p.fwd_tiles + int64_t(b) * p.fwd_cap;
  for (int it = blockIdx.y; it < p.fwd_count[b]; it += gridDim.y) {
    fwd_tile<D, MT, NW, BN, BNS>(p, smem, b, h, listed_work(tiles, it));
    __syncthreads();  // the next tile reuses shared memory
  }
}

// ================================================================ backward: delta

// delta = sum_d dout * out in fp32 for every (b, t, h) row, in 16-byte loads: a row is C = D/8
// lanes (several rows a warp when C divides 32, else one row a warp).
template <int D>
__global__ void delta_kernel(const bf16* dout, const bf16* out, float* delta, int64_t rows, int T,
                             int Hq) {
  constexpr int C = D / 8, RPW = 32 % C == 0 ? 32 / C : 1, G = RPW > 1 ? C : 32;
  const int lane = threadIdx.x & 31, c = lane % G;
  const int64_t row = ((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * RPW + lane / G;
  float acc = 0.0f;
  if (row < rows && c < C) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(dout + row * D) + c);
    const uint4 o = __ldg(reinterpret_cast<const uint4*>(out + row * D) + c);
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const float2 fa = __bfloat1622float2(a2[x]), fo = __bfloat1622float2(o2[x]);
      acc = fmaf(fa.x, fo.x, fmaf(fa.y, fo.y, acc));
    }
  }
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (c == 0 && row < rows) {
    const int h = int(row % Hq);
    const int64_t bt = row / Hq;
    delta[(bt / T * Hq + h) * T + bt % T] = acc;
  }
}

// ================================================================ backward: dQ

// NW warps x 16 query rows; key tiles of BN double-buffered. Shared rows: buffer c holds K at
// [2BN c, 2BN c + BN) and V after it; buffer 1 first holds Q and dO, which move to registers.
// Then the segment ids (`first`) of the Q rows [BM] and of each buffer's keys [2][BN].
// Long on purpose: one tile's loads, products, softmax and stores share dozens of register
// arrays (the accumulators), which helpers would have to pass by reference through every stage.
template <int D, int NW, int BN>
__device__ __forceinline__ void dq_tile(const FlashParams& p, unsigned char* smem, int b, int h,
                                        const Work& wk) {
  constexpr int BM = 16 * NW, NT = NW * 32, KS = D / 16, NN = BN / 8, ND = D / 8;
  constexpr int RB = Tile<D>::kRowBytes;
  static_assert(BM <= BN, "Q and dO borrow the second K/V buffer");
  const uint32_t s0 = smem_u32(smem);
  auto sK = [&](int c) { return s0 + uint32_t(c * 2 * BN * RB); };
  auto sV = [&](int c) { return sK(c) + uint32_t(BN * RB); };
  int* sFq = reinterpret_cast<int*>(smem + 4 * BN * RB);
  int* sFk = sFq + BM;

  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  // T is the layout's stride; E bounds the rows and keys that exist for this work.
  const int T = p.T, E = wk.e, hk = h / p.group, i0 = wk.i0;
  const int i_last = min(i0 + BM, E) - 1;
  const QuerySeg qs(p, b, wk);
  const int jb = wk.s, n_end = (i_last - jb) / BN + 1;  // key tiles at jb + n*BN

  const int64_t qstride = int64_t(p.Hq) * D, kstride = int64_t(p.Hk) * D;
  const int64_t qoff = (int64_t(b) * T * p.Hq + h) * D, koff = (int64_t(b) * T * p.Hk + hk) * D;
  load_tile<D, BM, NT>(sK(1), p.q + qoff, qstride, i0, E, tid);
  load_tile<D, BM, NT>(sV(1), p.dout + qoff, qstride, i0, E, tid);
  load_tile<D, BN, NT>(sK(0), p.k + koff, kstride, jb, E, tid);
  load_tile<D, BN, NT>(sV(0), p.v + koff, kstride, jb, E, tid);
  if (qs.first) {
    load_first<BM, NT>(sFq, qs.first, i0, E, tid);
    load_first<BN, NT>(sFk, qs.first, jb, E, tid);
  }
  cp_commit();

  const int wr0 = i0 + w * 16;
  int lo_w, hi_w;
  qs.warp_range(wr0, E, lo_w, hi_w);
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wr0 + g + 8 * r;
    const bool ok = row < E;
    const int64_t ri = (int64_t(b) * p.Hq + h) * T + row;
    lse2[r] = ok ? p.lse_in[ri] * kLog2e : 0.0f;
    dl[r] = ok ? p.delta[ri] : 0.0f;
  }

  cp_wait<0>();
  __syncthreads();
  uint32_t qf[KS][4], df[KS][4];
  {
    const Lanes<D> la(w * 16 + (lane & 15), lane >> 4);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      ldsm4(qf[kk], la(s0, 2 * BN, 2 * kk));
      ldsm4(df[kk], la(s0, 3 * BN, 2 * kk));
    }
  }
  __syncthreads();  // buffer 1 is free for K/V
  const Lanes<D> lb0 = lanes_bn<D>(lane), lt0 = lanes_a<D>(lane);

  float acc[ND][4];
#pragma unroll
  for (int nt = 0; nt < ND; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.0f;

  for (int n = 0; n < n_end; ++n) {
    const int cur = n & 1, j0 = jb + n * BN;
    if (n + 1 < n_end) {
      load_tile<D, BN, NT>(sK(cur ^ 1), p.k + koff, kstride, j0 + BN, E, tid);
      load_tile<D, BN, NT>(sV(cur ^ 1), p.v + koff, kstride, j0 + BN, E, tid);
      if (qs.first) load_first<BN, NT>(sFk + (cur ^ 1) * BN, qs.first, j0 + BN, E, tid);
    }
    cp_commit();
    if (j0 <= wr0 + 15 && j0 + BN - 1 >= lo_w) {  // some key of the tile visible to the warp
      const uint32_t sb = sK(cur);
      const Lanes<D> lb = lb0.fresh();
      float s[NN][4], dp[NN][4];
#pragma unroll
      for (int nt = 0; nt < NN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int np = 0; np < NN / 2; ++np) {
          uint32_t bb[4];
          ldsm4(bb, lb(sb, np * 16, 2 * kk));
          mma(s[2 * np], qf[kk], bb[0], bb[1]);
          mma(s[2 * np + 1], qf[kk], bb[2], bb[3]);
          ldsm4(bb, lb(sb, BN + np * 16, 2 * kk));
          mma(dp[2 * np], df[kk], bb[0], bb[1]);
          mma(dp[2 * np + 1], df[kk], bb[2], bb[3]);
        }
      if (j0 + BN - 1 > wr0 || hi_w > j0) {
        const int* fk = sFk + cur * BN;
#pragma unroll
        for (int nt = 0; nt < NN; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = nt * 8 + 2 * t4 + e;
            const int ks = qs.first ? fk[c] : 0;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = wr0 + g + 8 * r;
              const int rs = qs.first ? sFq[row - i0] : 0;
              if (!(j0 + c <= row && ks == rs)) s[nt][2 * r + e] = -INFINITY;
            }
          }
      }
      // dS = P (dP - delta), kept in dp; the 1/sqrt(D) goes on dQ at the end.
#pragma unroll
      for (int nt = 0; nt < NN; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pv = ex2(fmaf(s[nt][e], p.sl2, -lse2[e >> 1]));
          dp[nt][e] = pv * (dp[nt][e] - dl[e >> 1]);
        }
      const Lanes<D> lt = lt0.fresh();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[4];
        a[0] = pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
        a[1] = pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
        a[2] = pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
        a[3] = pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
          uint32_t bb[4];
          ldsm4t(bb, lt(sb, kk * 16, 2 * np));
          mma(acc[2 * np], a, bb[0], bb[1]);
          mma(acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
    }
    cp_wait<0>();
    __syncthreads();  // next tile landed; every warp is done with this one
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wr0 + g + 8 * r;
    if (row >= E) continue;
    bf16* dst = p.dq + ((int64_t(b) * T + row) * p.Hq + h) * D;
#pragma unroll
    for (int nt = 0; nt < ND; ++nt)
      *reinterpret_cast<uint32_t*>(dst + nt * 8 + 2 * t4) =
          pack_bf16(acc[nt][2 * r] * p.scale, acc[nt][2 * r + 1] * p.scale);
  }
}

// Grid (B * Hq, Y), as the forward's.
template <int D, int NW, int BN>
__global__ void __launch_bounds__(NW * 32) flash_bwd_dq_kernel(const FlashParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
  if (!p.dq_tiles) {
    dq_tile<D, NW, BN>(p, smem, b, h, plain_work(p.T, 16 * NW, gridDim.y - 1 - blockIdx.y));
    return;
  }
  const int4* tiles = p.dq_tiles + int64_t(b) * p.bwd_cap;
  for (int it = blockIdx.y; it < p.dq_count[b]; it += gridDim.y) {
    dq_tile<D, NW, BN>(p, smem, b, h, listed_work(tiles, it));
    __syncthreads();
  }
}

// ================================================================ backward: dK, dV

// NW warps x 16 keys (BN = 16*NW); query tiles of BM double-buffered with their lse and delta.
// Shared rows: K [0, BN), V [BN, 2BN), stage c: Q at 2BN + 2BM c, dO after it; then per stage the
// queries' lse, delta and segment ids (`first`), [2][BM] each.
// Long on purpose: one tile's loads, products, softmax and stores share dozens of register
// arrays (the accumulators), which helpers would have to pass by reference through every stage.
template <int D, int NW, int BM>
__device__ __forceinline__ void dkdv_tile(const FlashParams& p, unsigned char* smem, int b, int hk,
                                          const Work& wk) {
  constexpr int BN = 16 * NW, NT = NW * 32, KS = D / 16, NM = BM / 8, ND = D / 8;
  constexpr int RB = Tile<D>::kRowBytes;
  const uint32_t s0 = smem_u32(smem), sK = s0, sV = s0 + BN * RB;
  auto sQ = [&](int c) { return s0 + uint32_t((2 * BN + 2 * BM * c) * RB); };
  auto sD = [&](int c) { return sQ(c) + uint32_t(BM * RB); };
  float* sL = reinterpret_cast<float*>(smem + (2 * BN + 4 * BM) * RB);  // [2][BM] lse
  float* sDl = sL + 2 * BM;                                             // [2][BM] delta
  int* sFq = reinterpret_cast<int*>(sDl + 2 * BM);                      // [2][BM] first

  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  // T is the layout's stride; E bounds the keys and queries that exist for this work. Query
  // tiles start at the first key j0: no earlier query sees any of its keys.
  const int T = p.T, E = wk.e, j0 = wk.i0;
  const int* first = wk.masked ? p.first + int64_t(b) * T : nullptr;
  const int nm = (E - j0 + BM - 1) / BM, total = nm * p.group;

  const int64_t qstride = int64_t(p.Hq) * D, kstride = int64_t(p.Hk) * D;
  const int64_t koff = (int64_t(b) * T * p.Hk + hk) * D;
  load_tile<D, BN, NT>(sK, p.k + koff, kstride, j0, E, tid);
  load_tile<D, BN, NT>(sV, p.v + koff, kstride, j0, E, tid);
  // Stage c <- (query head hk*group + it / nm, query tile it % nm).
  auto load_stage = [&](int c, int it) {
    const int h = hk * p.group + it / nm, i0 = j0 + (it % nm) * BM;
    const int64_t qoff = (int64_t(b) * T * p.Hq + h) * D;
    load_tile<D, BM, NT>(sQ(c), p.q + qoff, qstride, i0, E, tid);
    load_tile<D, BM, NT>(sD(c), p.dout + qoff, qstride, i0, E, tid);
    const int64_t roff = (int64_t(b) * p.Hq + h) * T;
    for (int x = tid; x < 2 * BM; x += NT) {
      const int r = x % BM, row = i0 + r;
      const bool ok = row < E;
      const float* src = (x < BM ? p.lse_in : p.delta) + roff + (ok ? row : 0);
      cp_async4(smem_u32((x < BM ? sL : sDl) + c * BM + r), src, ok);
    }
    if (first) load_first<BM, NT>(sFq + c * BM, first, i0, E, tid);
  };
  load_stage(0, 0);
  cp_commit();

  // The warp's keys [wk0, wk0+15]; masked work checks every query tile's segments.
  const int wk0 = j0 + w * 16;
  const int q_end = E - 1;
  const int seg_end = first ? -1 : INT_MAX;
  int kseg[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = wk0 + g + 8 * r;
    kseg[r] = (first && key < E) ? first[key] : 0;
  }
  const Lanes<D> lkv0(w * 16 + (lane & 15), lane >> 4);
  const Lanes<D> lb0 = lanes_bn<D>(lane), lt0 = lanes_a<D>(lane);
  float dk[ND][4], dv[ND][4];
#pragma unroll
  for (int nt = 0; nt < ND; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.0f;

  for (int it = 0; it < total; ++it) {
    const int cur = it & 1, i0 = j0 + (it % nm) * BM;
    cp_wait<0>();
    __syncthreads();  // stage cur landed; every warp is done with stage cur^1
    if (it + 1 < total) load_stage(cur ^ 1, it + 1);
    cp_commit();
    if (wk0 >= E || i0 + BM - 1 < wk0 || i0 > q_end) continue;  // no query sees the warp's keys

    // S^T = K Q^T and dP^T = V dO^T: rows are this warp's 16 keys, columns the BM queries.
    const uint32_t sb = sQ(cur);
    const Lanes<D> lb = lb0.fresh(), lkv = lkv0.fresh();
    float st[NM][4], dpt[NM][4];
#pragma unroll
    for (int nt = 0; nt < NM; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t ka[4], va[4];
      ldsm4(ka, lkv(s0, 0, 2 * kk));
      ldsm4(va, lkv(s0, BN, 2 * kk));
#pragma unroll
      for (int np = 0; np < NM / 2; ++np) {
        uint32_t bb[4];
        ldsm4(bb, lb(sb, np * 16, 2 * kk));
        mma(st[2 * np], ka, bb[0], bb[1]);
        mma(st[2 * np + 1], ka, bb[2], bb[3]);
        ldsm4(bb, lb(sb, BM + np * 16, 2 * kk));
        mma(dpt[2 * np], va, bb[0], bb[1]);
        mma(dpt[2 * np + 1], va, bb[2], bb[3]);
      }
    }
    if (i0 < wk0 + 15 || i0 + BM > E || seg_end < i0 + BM - 1) {
      const int* fq = sFq + cur * BM;
#pragma unroll
      for (int nt = 0; nt < NM; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * t4 + e, q = i0 + c;
          const int qseg = first ? fq[c] : 0;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int key = wk0 + g + 8 * r;
            if (!(key <= q && q < E && qseg == kseg[r])) st[nt][2 * r + e] = -INFINITY;
          }
        }
    }
    const float* lsc = sL + cur * BM;
    const float* dlc = sDl + cur * BM;
#pragma unroll
    for (int nt = 0; nt < NM; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + 2 * t4 + e;
        const float l2 = lsc[c] * kLog2e, dlt = dlc[c];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float pv = ex2(fmaf(st[nt][2 * r + e], p.sl2, -l2));
          st[nt][2 * r + e] = pv;
          dpt[nt][2 * r + e] = pv * (dpt[nt][2 * r + e] - dlt);
        }
      }
    // dV += P^T dO, dK += dS^T Q (B operands transposed out of the row-major Q / dO tiles).
    const Lanes<D> lt = lt0.fresh();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t pa[4], da[4];
      pa[0] = pack_bf16(st[2 * kk][0], st[2 * kk][1]);
      pa[1] = pack_bf16(st[2 * kk][2], st[2 * kk][3]);
      pa[2] = pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      pa[3] = pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      da[0] = pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]);
      da[1] = pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]);
      da[2] = pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      da[3] = pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < ND / 2; ++np) {
        uint32_t bb[4];
        ldsm4t(bb, lt(sb, BM + kk * 16, 2 * np));
        mma(dv[2 * np], pa, bb[0], bb[1]);
        mma(dv[2 * np + 1], pa, bb[2], bb[3]);
        ldsm4t(bb, lt(sb, kk * 16, 2 * np));
        mma(dk[2 * np], da, bb[0], bb[1]);
        mma(dk[2 * np + 1], da, bb[2], bb[3]);
      }
    }
  }
  cp_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = wk0 + g + 8 * r;
    if (key >= E) continue;
    const int64_t off = ((int64_t(b) * T + key) * p.Hk + hk) * D;
#pragma unroll
    for (int nt = 0; nt < ND; ++nt) {
      *reinterpret_cast<uint32_t*>(p.dk + off + nt * 8 + 2 * t4) =
          pack_bf16(dk[nt][2 * r] * p.scale, dk[nt][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(p.dv + off + nt * 8 + 2 * t4) =
          pack_bf16(dv[nt][2 * r], dv[nt][2 * r + 1]);
    }
  }
}

// Grid (B * Hk, Y): without a tile list, block y takes key tile y (key tile 0 sees the most
// queries: longest first); with one, the listed tiles y, y + Y, ... of its batch row.
template <int D, int NW, int BM>
__global__ void __launch_bounds__(NW * 32) flash_bwd_dkdv_kernel(const FlashParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hk, hk = blockIdx.x % p.Hk;
  if (!p.kv_tiles) {
    dkdv_tile<D, NW, BM>(p, smem, b, hk, plain_work(p.T, 16 * NW, blockIdx.y));
    return;
  }
  const int4* tiles = p.kv_tiles + int64_t(b) * p.bwd_cap;
  for (int it = blockIdx.y; it < p.kv_count[b]; it += gridDim.y) {
    dkdv_tile<D, NW, BM>(p, smem, b, hk, listed_work(tiles, it));
    __syncthreads();
  }
}

// ================================================================ tile configurations

// Forward: 4 warps x 32 rows, 128 x 64 tiles (FlashAttention-2's choice on sm_80), S computed 32
// keys at a time at D >= 96. Listed tiles (packed rows) take 64 rows (MT = 1) at D <= 64, where
// that was 7% faster on segments of average length 512 (each segment's last tile is on average
// half empty), and 128 at D = 128, where 64 rows were 14% slower (H200, 2026-12-04).
template <int D, int MT_ = 2>
struct FwdCfg {
  static constexpr int MT = MT_, NW = 4, BN = 64, BNS = D >= 96 ? 32 : 64, BM = 16 * MT * NW;
  static constexpr size_t smem =
      size_t(BM + 4 * BN) * Tile<D>::kRowBytes + (BM + 2 * BN + 2 * NW) * sizeof(int);
};
// dQ: 4 warps x 16 rows, 64-key tiles double-buffered.
template <int D>
struct DqCfg {
  static constexpr int NW = 4, BN = 64, BM = 16 * NW;
  static constexpr size_t smem = size_t(4 * BN) * Tile<D>::kRowBytes + (BM + 2 * BN) * sizeof(int);
};
// dK/dV: 4 warps x 16 keys, 64-query tiles double-buffered.
template <int D>
struct DkvCfg {
  static constexpr int NW = 4, BM = 64, BN = 16 * NW;
  static constexpr size_t smem = size_t(BN + 2 * BM) * 2 * Tile<D>::kRowBytes + 6 * BM * sizeof(float);
};

template <typename Kern>
cudaError_t allow_smem(Kern kern, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

// ================================================================ workspace

constexpr size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

// Tile sizes of the tile lists: the forward's query rows, dQ's query rows and dK/dV's keys.
template <int D>
using FwdListedCfg = FwdCfg<D, D <= 64 ? 1 : 2>;
constexpr int kFwdTileMin = 64, kBwdTile = 64;
static_assert(FwdListedCfg<64>::BM == kFwdTileMin && FwdListedCfg<128>::BM >= kFwdTileMin, "tiles");
static_assert(DqCfg<64>::BM == kBwdTile && DkvCfg<64>::BN == kBwdTile, "backward tiles");
// A row has at most ceil(T / tile) tiles plus one per segment.
int list_cap(int T, int tile) {
  return (T + tile - 1) / tile + T;
}
int list_buckets(int T, int tile) {
  return std::min((T + tile - 1) / tile, 4096);
}

struct Workspace {
  bool bwd;
  size_t delta, mono, start, end, tiles_a, count_a, tiles_b, count_b, total;
};
Workspace layout(const AttnDims& d, bool has_seg, bool bwd) {
  Workspace w{};
  w.bwd = bwd;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  if (bwd) w.delta = take(sizeof(float) * size_t(d.B) * d.Hq * d.T);
  if (has_seg) {
    w.mono = take(sizeof(int) * size_t(d.B));
    w.start = take(sizeof(int) * size_t(d.B) * d.T);
    w.end = take(sizeof(int) * size_t(d.B) * d.T);
    // Forward: its list in a. Backward: dQ's in a, dK/dV's in b.
    const size_t cap = size_t(list_cap(d.T, bwd ? kBwdTile : kFwdTileMin));
    w.tiles_a = take(sizeof(int4) * size_t(d.B) * cap);
    w.count_a = take(sizeof(int) * size_t(d.B));
    if (bwd) {
      w.tiles_b = take(sizeof(int4) * size_t(d.B) * cap);
      w.count_b = take(sizeof(int) * size_t(d.B));
    }
  }
  w.total = off;
  return w;
}

FlashParams make_params(const AttnDims& d, const int64_t* seg, void* ws, const Workspace& w) {
  FlashParams p{};
  p.B = d.B;
  p.T = d.T;
  p.Hq = d.Hq;
  p.Hk = d.Hk;
  p.group = d.Hq / d.Hk;
  p.scale = 1.0f / sqrtf(float(d.D));
  p.sl2 = p.scale * kLog2e;
  p.seg = seg;
  if (seg) {
    auto* base = static_cast<unsigned char*>(ws);
    p.mono = reinterpret_cast<const int*>(base + w.mono);
    p.first = reinterpret_cast<const int*>(base + w.start);
    p.last = reinterpret_cast<const int*>(base + w.end);
    auto tiles = [&](size_t at) { return reinterpret_cast<const int4*>(base + at); };
    auto count = [&](size_t at) { return reinterpret_cast<const int*>(base + at); };
    if (w.bwd) {
      p.dq_tiles = tiles(w.tiles_a);
      p.dq_count = count(w.count_a);
      p.kv_tiles = tiles(w.tiles_b);
      p.kv_count = count(w.count_b);
      p.bwd_cap = list_cap(d.T, kBwdTile);
    } else {
      p.fwd_tiles = tiles(w.tiles_a);
      p.fwd_count = count(w.count_a);
      p.fwd_cap = list_cap(d.T, kFwdTileMin);  // enough for any head dim's tile
    }
  }
  return p;
}

cudaError_t run_seg_info(const FlashParams& p, void* ws, const Workspace& w, cudaStream_t s) {
  if (!p.seg) return cudaSuccess;
  auto* base = static_cast<unsigned char*>(ws);
  dim3 grid(unsigned((p.T + kSegThreads - 1) / kSegThreads), unsigned(p.B));
  seg_info_kernel<<<grid, kSegThreads, 0, s>>>(p.seg, p.T, reinterpret_cast<int*>(base + w.mono),
                                      reinterpret_cast<int*>(base + w.start),
                                      reinterpret_cast<int*>(base + w.end));
  return cudaGetLastError();
}

// Builds one tile list (after run_seg_info, on the same stream).
template <int TILE, bool REMAINING>
cudaError_t run_tile_list(const FlashParams& p, int cap, const int4* tiles, const int* count,
                          cudaStream_t s) {
  const int K = list_buckets(p.T, TILE);
  tile_list_kernel<TILE, REMAINING><<<unsigned(p.B), 1024, size_t(2 * K) * sizeof(int), s>>>(
      p.seg, p.T, p.mono, p.last, K, cap, const_cast<int4*>(tiles), const_cast<int*>(count));
  return cudaGetLastError();
}

template <typename C, int D>
cudaError_t fwd_launch(const FlashParams& p, unsigned blocks_y, cudaStream_t s) {
  auto kern = flash_fwd_kernel<D, C::MT, C::NW, C::BN, C::BNS>;
  cudaError_t e = allow_smem(kern, C::smem);
  if (e != cudaSuccess) return e;
  kern<<<dim3(unsigned(p.B * p.Hq), blocks_y), C::NW * 32, C::smem, s>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t fwd_d(const FlashParams& p, cudaStream_t s) {
  using Plain = FwdCfg<D>;
  using Listed = FwdListedCfg<D>;
  if (!p.fwd_tiles) return fwd_launch<Plain, D>(p, unsigned((p.T + Plain::BM - 1) / Plain::BM), s);
  cudaError_t e = run_tile_list<Listed::BM, false>(p, p.fwd_cap, p.fwd_tiles, p.fwd_count, s);
  if (e != cudaSuccess) return e;
  // Twice the plain count of blocks, each looping over its share of the list.
  return fwd_launch<Listed, D>(p, unsigned(2 * ((p.T + Listed::BM - 1) / Listed::BM)), s);
}

template <int D>
cudaError_t bwd_d(const FlashParams& p, cudaStream_t s) {
  using Q = DqCfg<D>;
  using K = DkvCfg<D>;
  constexpr int C = D / 8, RPW = 32 % C == 0 ? 32 / C : 1;
  const int64_t rows = int64_t(p.B) * p.T * p.Hq, warps = (rows + RPW - 1) / RPW;
  delta_kernel<D><<<unsigned((warps + 7) / 8), 256, 0, s>>>(p.dout, p.o, p.delta, rows, p.T, p.Hq);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  auto kq = flash_bwd_dq_kernel<D, Q::NW, Q::BN>;
  auto kkv = flash_bwd_dkdv_kernel<D, K::NW, K::BM>;
  e = allow_smem(kq, Q::smem);
  if (e == cudaSuccess) e = allow_smem(kkv, K::smem);
  if (e != cudaSuccess) return e;
  // dK/dV first: its blocks are the longest (key tile 0 sees every query), so start them early.
  const int kv_tiles = (p.T + K::BN - 1) / K::BN, q_tiles = (p.T + Q::BM - 1) / Q::BM;
  dim3 gkv(unsigned(p.B * p.Hk), unsigned(p.kv_tiles ? 2 * kv_tiles : kv_tiles));
  kkv<<<gkv, K::NW * 32, K::smem, s>>>(p);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  dim3 gq(unsigned(p.B * p.Hq), unsigned(p.dq_tiles ? 2 * q_tiles : q_tiles));
  kq<<<gq, Q::NW * 32, Q::smem, s>>>(p);
  return cudaGetLastError();
}

// The runtime head dim as a template argument.
template <typename F>
cudaError_t by_head_dim(int D, F&& f) {
  switch (D) {
    case 64: return f.template operator()<64>();
    case 80: return f.template operator()<80>();
    case 96: return f.template operator()<96>();
    case 128: return f.template operator()<128>();
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool flash_supports(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;
}

size_t flash_fwd_workspace(AttnDims d, bool has_seg) { return layout(d, has_seg, false).total; }
size_t flash_bwd_workspace(AttnDims d, bool has_seg) { return layout(d, has_seg, true).total; }

cudaError_t flash_fwd(const void* q, const void* k, const void* v, const int64_t* seg, void* out,
                      float* lse, AttnDims d, void* workspace, cudaStream_t s) {
  if (d.B == 0 || d.T == 0 || d.Hq == 0) return cudaSuccess;
  if (!flash_supports(d.D) || d.Hk <= 0 || d.Hq % d.Hk != 0) return cudaErrorInvalidValue;
  const Workspace w = layout(d, seg != nullptr, false);
  FlashParams p = make_params(d, seg, workspace, w);
  p.q = static_cast<const bf16*>(q);
  p.k = static_cast<const bf16*>(k);
  p.v = static_cast<const bf16*>(v);
  p.out = static_cast<bf16*>(out);
  p.lse = lse;
  cudaError_t e = run_seg_info(p, workspace, w, s);
  if (e != cudaSuccess) return e;
  return by_head_dim(d.D, [&]<int D>() { return fwd_d<D>(p, s); });
}

cudaError_t flash_bwd(const void* dout, const void* q, const void* k, const void* v,
                      const int64_t* seg, const void* out, const float* lse, void* dq, void* dk,
                      void* dv, AttnDims d, void* workspace, cudaStream_t s) {
  if (d.B == 0 || d.T == 0 || d.Hq == 0) return cudaSuccess;
  if (!flash_supports(d.D) || d.Hk <= 0 || d.Hq % d.Hk != 0) return cudaErrorInvalidValue;
  const Workspace w = layout(d, seg != nullptr, true);
  FlashParams p = make_params(d, seg, workspace, w);
  p.q = static_cast<const bf16*>(q);
  p.k = static_cast<const bf16*>(k);
  p.v = static_cast<const bf16*>(v);
  p.o = static_cast<const bf16*>(out);
  p.dout = static_cast<const bf16*>(dout);
  p.dq = static_cast<bf16*>(dq);
  p.dk = static_cast<bf16*>(dk);
  p.dv = static_cast<bf16*>(dv);
  p.lse_in = lse;
  p.delta = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + w.delta);
  cudaError_t e = run_seg_info(p, workspace, w, s);
  if (e == cudaSuccess && seg)
    e = run_tile_list<kBwdTile, false>(p, p.bwd_cap, p.dq_tiles, p.dq_count, s);
  if (e == cudaSuccess && seg)
    e = run_tile_list<kBwdTile, true>(p, p.bwd_cap, p.kv_tiles, p.kv_count, s);
  if (e != cudaSuccess) return e;
  return by_head_dim(d.D, [&]<int D>() { return bwd_d<D>(p, s); });
}

}  // namespace rig::ops::cuda::k
