// Shared by flash_fwd.cu and flash_bwd.cu (rig's tensor-core attention): parameters, PTX
// wrappers, shared-memory tiles, the segment pre-passes, tile configurations and the workspace.
// Everything sits in an unnamed namespace: each of the two files compiles its own copy.
//
// Tensor-core causal attention, FlashAttention-2 style: bf16 operands, fp32 accumulation,
// mma.sync.m16n8k16 fed by ldmatrix from shared memory, cp.async tile loads. Runs on sm_80..sm_90
// (no wgmma: the RTX 4090 has none). Never stores a T x T matrix.
//
// Layout: q/out/dout/dq [B,T,Hq,D], k/v/dk/dv [B,T,Hk,D] bf16; lse/delta [B,Hq,T] fp32.
// Query i sees key j iff j <= i and (no seg, or seg[b,j] == seg[b,i]).
//
// Kernels
//  seg_plan   one block per batch row, with segments: each position's `first` (first position
//             with the same id: equal `first` <=> same segment, an int32 compare) and, when the
//             ids never decrease (what rig's packer makes), each segment's last position; then
//             the tiles the blocks take, longest first. Ids that never decrease: tiles cut from
//             each segment's start, so no tile holds two segments and only the causal diagonal is
//             masked (varlen scheduling). Otherwise tiles of [0, T), every element masked by
//             segment: still exact, no skipping.
//  fwd        one block per (b, query head, 128 query rows), or per (b, query head) share of
//             the tile list; walks key tiles left to right with the online softmax. Each warp
//             owns two blocks of 16 full query rows, one from each end of the tile (balanced on
//             the diagonal), so row max / sum need only a quad shuffle. K/V tiles
//             double-buffered: tile n+1 loads under tile n's math.
//  bwd_dq     one block per (b, query head, 16*NW query rows), key tiles double-buffered:
//             delta = rowsum(dO * O) first (fp32, also written to the workspace for dK/dV, which
//             runs after), then S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K. Q and
//             dO live in registers.
//  bwd_dkdv   one block per (b, kv head, 16*NW keys); each warp owns 16 keys ("keys as rows"), so
//             P^T and dS^T come out of the MMA already in the A-operand layout of dV += P^T dO and
//             dK += dS^T Q: nothing goes through shared memory but Q, dO, K, V. Loops over every
//             query head of the group and the query tiles in a fixed order: deterministic.
//
// Outputs (O, dQ, dK, dV) leave through shared memory: each warp writes its bf16 rows into its
// own rows of an input tile it has finished with, then copies them out in 16-byte stores (H200,
// 2026-12-04: +2-3% on packed rows, where a block's stores weigh most).
//
// Masks: a tile is masked per element only on the causal diagonal, at its run's end (T or the
// segment's end), or in rows whose ids are not sorted; everything else runs the unmasked path.
#pragma once
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
  const int *first, *last;  // seg_plan_kernel's output, nullptr without seg
  // seg_plan_kernel's tile lists with seg, nullptr without: per batch row, `cap` int4 {i0, s, e,
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

// Outputs leave in two steps, so that a warp's accumulators are dead before the copy-out:
// stage_rows16 writes one warp's 16 rows of an fp32 accumulator (mma C layout: lane g, t4 holds
// rows g and g + 8, columns 2 t4 of each 8-column block), times mul[r], as bf16 rows
// r0 + [0, 16) of the shared tile at `tile`; after a __syncwarp, copy_rows16 copies them out
// with 16-byte stores, whole rows per group of lanes (4-byte global stores from the C layout
// half-fill each 32-byte sector). The rows must be the warp's own: nothing but this warp reads
// them until the block's next barrier.
template <int D>
__device__ __forceinline__ void stage_rows16(unsigned char* tile, int r0,
                                             const float (&acc)[D / 8][4], const float (&mul)[2],
                                             int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
      *reinterpret_cast<uint32_t*>(tile + Tile<D>::off(r0 + g + 8 * r, nt) + 4 * t4) =
          pack_bf16(acc[nt][2 * r] * mul[r], acc[nt][2 * r + 1] * mul[r]);
}
// Global row x of the run is g_rows + x * stride; tile row r0 + r goes to row grow0 + r, rows
// from `end` on are not stored.
template <int D>
__device__ __forceinline__ void copy_rows16(const unsigned char* tile, int r0, bf16* g_rows,
                                            int64_t stride, int grow0, int end, int lane) {
  constexpr int C = D / 8;
#pragma unroll 2  // unrolled whole, dK/dV at d96 spilled on sm_80
  for (int x = lane; x < 16 * C; x += 32) {
    const int r = x / C, c = x % C;
    if (grow0 + r < end)
      *reinterpret_cast<uint4*>(g_rows + int64_t(grow0 + r) * stride + c * 8) =
          *reinterpret_cast<const uint4*>(tile + Tile<D>::off(r0 + r, c));
  }
}

// ================================================================ segment pre-pass

// The segment pre-pass: one kernel, one block of kPlanThreads per batch row. Each thread owns a
// contiguous chunk of positions; scans carry across chunks through `part`.
constexpr int kPlanThreads = 1024;

enum class Scan { kMax, kMin, kSum };
template <Scan OP>
__device__ __forceinline__ int scan_op(int a, int b) {
  if constexpr (OP == Scan::kMax)
    return max(a, b);
  else if constexpr (OP == Scan::kMin)
    return min(a, b);
  else
    return a + b;
}
// Exclusive scan over the block's threads (a multiple of 32, at most 1024): OP of v over the
// threads before this one, or after it with SUFFIX; `none` (OP's identity) where there are none.
// Shuffles within warps, then one warp scans the warp totals in part[32]: three barriers.
template <Scan OP, bool SUFFIX>
__device__ int block_scan_excl(int v, int none, int* part) {
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
  auto warp_incl = [&](int x) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y =
          SUFFIX ? __shfl_down_sync(0xffffffffu, x, off) : __shfl_up_sync(0xffffffffu, x, off);
      if (SUFFIX ? lane + off < 32 : lane >= off) x = scan_op<OP>(x, y);
    }
    return x;
  };
  const int x = warp_incl(v);
  if (lane == (SUFFIX ? 0 : 31)) part[wid] = x;  // the warp's total
  __syncthreads();
  if (wid == 0) part[lane] = warp_incl(lane < nw ? part[lane] : none);
  __syncthreads();
  int in_warp = SUFFIX ? __shfl_down_sync(0xffffffffu, x, 1) : __shfl_up_sync(0xffffffffu, x, 1);
  if (lane == (SUFFIX ? 31 : 0)) in_warp = none;
  const int other =
      SUFFIX ? (wid + 1 < nw ? part[wid + 1] : none) : (wid > 0 ? part[wid - 1] : none);
  __syncthreads();  // part is free again
  return scan_op<OP>(in_warp, other);
}

// Each position's segment facts; returns whether the ids never decrease. first[i]: the first
// position of the row holding seg[i]'s id, so two positions share a segment iff their `first`
// agree (int32 compares, whatever the ids are). Non-decreasing ids (the packer's): first and
// last[i], the segment's last position, from the chunks' segment starts and ends; the tile loops
// start and stop there. Otherwise first by a linear search and last = T-1: no skipping.
__device__ bool plan_positions(const int64_t* sg, int T, int* first, int* last, int* part) {
  const int tid = threadIdx.x, nt = blockDim.x;
  int bad = 0;
  for (int i = tid + 1; i < T; i += nt) bad |= sg[i] < sg[i - 1];
  const bool ok = __syncthreads_and(!bad);
  if (!ok) {
    for (int i = tid; i < T; i += nt) {
      int lo = i;
      for (int j = 0; j < i; ++j)
        if (sg[j] == sg[i]) {
          lo = j;
          break;
        }
      first[i] = lo;
      last[i] = T - 1;
    }
    __syncthreads();
    return false;
  }
  const int chunk = (T + nt - 1) / nt, c0 = min(T, tid * chunk), c1 = min(T, c0 + chunk);
  auto starts = [&](int i) { return i == 0 || sg[i] != sg[i - 1]; };
  auto ends = [&](int i) { return i == T - 1 || sg[i] != sg[i + 1]; };
  int my_start = -1, my_end = INT_MAX;  // the chunk's last segment start, first segment end
  for (int i = c0; i < c1; ++i) {
    if (starts(i)) my_start = i;
    if (ends(i) && my_end == INT_MAX) my_end = i;
  }
  int cur = block_scan_excl<Scan::kMax, false>(my_start, -1, part);
  for (int i = c0; i < c1; ++i) first[i] = cur = starts(i) ? i : cur;
  cur = block_scan_excl<Scan::kMin, true>(my_end, INT_MAX, part);
  for (int i = c1 - 1; i >= c0; --i) last[i] = cur = ends(i) ? i : cur;
  __syncthreads();  // first and last are read by other threads next
  return true;
}

// One batch row's tiles of TILE positions for a kernel's blocks, longest first, as int4
// {i0, s, e, masked} (see Work). Sorted ids: each segment [s, e) is cut into tiles from s,
// bucketed by cost (the forward and dQ: tile k of a segment sees k + 1 key tiles; dK/dV,
// REMAINING: n - k query tiles) with a counting sort; the order inside a bucket is whatever the
// atomics give, which changes no result (every tile is computed alone). Otherwise TILE tiles of
// [0, T), masked. K buckets (the costliest are merged into the last) in hist and base.
template <int TILE, bool REMAINING>
__device__ void plan_tiles(const int64_t* sg, int T, bool ok, const int* lst, int K, int4* out,
                           int* count, int* hist, int* base, int* part) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if (!ok) {
    const int n = (T + TILE - 1) / TILE;
    for (int k = tid; k < n; k += nt) {
      const int t = REMAINING ? k : n - 1 - k;
      out[k] = make_int4(t * TILE, 0, T, 1);
    }
    if (tid == 0) *count = n;
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
  // of the chunks, then each thread fills its own chunk.
  const int chunk = (K + nt - 1) / nt, k0 = min(K, tid * chunk), k1 = min(K, k0 + chunk);
  int sum = 0;
  for (int k = k0; k < k1; ++k) sum += hist[k];
  int above = block_scan_excl<Scan::kSum, true>(sum, 0, part);
  if (tid == 0) *count = above + sum;
  for (int k = k1 - 1; k >= k0; --k) {
    base[k] = above;
    above += hist[k];
  }
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
  __syncthreads();  // hist and base are free again
}

// Grid B: the positions' facts, then one tile list (TB = 0) or two (the backward's dQ and dK/dV
// lists), in one launch: 12.5 us forward and 16.2 us backward on the H200 at B = 2, T = 4096,
// where separate kernels (position facts, then each list) took 17.2 and 25.3 us, mostly latency.
// Dynamic shared memory: 2 max(Ka, Kb) ints.
template <int TA, bool RA, int TB, bool RB>
__global__ void __launch_bounds__(kPlanThreads)
    seg_plan_kernel(const int64_t* seg, int T, int* first, int* last, int cap, int Ka,
                    int4* tiles_a, int* count_a, int Kb, int4* tiles_b, int* count_b) {
  extern __shared__ int sh[];
  __shared__ int part[32];
  const int b = blockIdx.x;
  const int64_t* sg = seg + int64_t(b) * T;
  int* lst = last + int64_t(b) * T;
  const bool ok = plan_positions(sg, T, first + int64_t(b) * T, lst, part);
  plan_tiles<TA, RA>(sg, T, ok, lst, Ka, tiles_a + int64_t(b) * cap, count_a + b, sh, sh + Ka,
                     part);
  if constexpr (TB > 0)
    plan_tiles<TB, RB>(sg, T, ok, lst, Kb, tiles_b + int64_t(b) * cap, count_b + b, sh, sh + Kb,
                       part);
}

// One block's work: query rows [i0, i0 + BM) (forward, dQ) or keys [i0, i0 + BN) (dK/dV) of
// the run [s, e) of batch row b: positions before s are not visible to it, positions from e on
// are treated as absent (zero-filled, never stored). Rows with non-decreasing segment ids (what
// rig's packer makes) get tiles that start at their segment's start (seg_plan_kernel), so a
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

// ================================================================ tile configurations

// Forward: 4 warps x 32 rows, 128 x 64 tiles (FlashAttention-2's choice on sm_80), S computed 32
// keys at a time at D >= 96. Packed rows take the same tiles: with balanced rows, 128-row tiles
// beat 64-row ones at d64 too (H200, 2026-12-04).
template <int D>
struct FwdCfg {
  static constexpr int NW = 4, BN = 64, BNS = D >= 96 ? 32 : 64, BM = 32 * NW;
  static constexpr size_t smem =
      size_t(BM + 4 * BN) * Tile<D>::kRowBytes + (BM + 2 * BN) * sizeof(int);
};
// dQ: 4 warps x 16 rows, 64-key tiles double-buffered; the O rows for delta.
template <int D>
struct DqCfg {
  static constexpr int NW = 4, BN = 64, BM = 16 * NW;
  static constexpr size_t smem =
      size_t(4 * BN + BM) * Tile<D>::kRowBytes + (BM + 2 * BN) * sizeof(int) + BM * sizeof(float);
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
constexpr int kFwdTile = 128, kBwdTile = 64;
static_assert(FwdCfg<64>::BM == kFwdTile && FwdCfg<128>::BM == kFwdTile, "forward tiles");
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
  size_t delta, start, end, tiles_a, count_a, tiles_b, count_b, total;
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
    w.start = take(sizeof(int) * size_t(d.B) * d.T);
    w.end = take(sizeof(int) * size_t(d.B) * d.T);
    // Forward: its list in a. Backward: dQ's in a, dK/dV's in b.
    const size_t cap = size_t(list_cap(d.T, bwd ? kBwdTile : kFwdTile));
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
      p.fwd_cap = list_cap(d.T, kFwdTile);
    }
  }
  return p;
}

// The segment pre-pass: positions' facts and the tile list(s) a and (TB > 0) b.
template <int TA, bool RA, int TB = 0, bool RB = false>
cudaError_t run_seg_plan(const FlashParams& p, int cap, const int4* ta, const int* ca,
                         const int4* tb, const int* cb, cudaStream_t s) {
  const int Ka = list_buckets(p.T, TA), Kb = TB > 0 ? list_buckets(p.T, TB) : 0;
  const size_t smem = size_t(2 * std::max(Ka, Kb)) * sizeof(int);
  seg_plan_kernel<TA, RA, TB, RB><<<unsigned(p.B), kPlanThreads, smem, s>>>(
      p.seg, p.T, const_cast<int*>(p.first), const_cast<int*>(p.last), cap, Ka,
      const_cast<int4*>(ta), const_cast<int*>(ca), Kb, const_cast<int4*>(tb), const_cast<int*>(cb));
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

}  // namespace rig::ops::cuda::k
