// rig's flash attention, backward (the design is at the top of flash_common.cuh).
#include "rig/ops/cuda/flash_common.cuh"

namespace rig::ops::cuda::k {

namespace {

// ================================================================ backward: dQ

// NW warps x 16 query rows; key tiles of BN double-buffered. Shared rows: buffer c holds K at
// [2BN c, 2BN c + BN) and V after it; buffer 1 first holds Q and dO, which move to registers;
// O [4BN, 4BN + BM). Then the segment ids (`first`) of the Q rows [BM] and of each buffer's
// keys [2][BN], and the rows' delta [BM] (computed here: a separate pass read O and dO again).
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
  const uint32_t sO = s0 + uint32_t(4 * BN * RB);
  int* sFq = reinterpret_cast<int*>(smem + (4 * BN + BM) * RB);
  int* sFk = sFq + BM;
  float* sDl = reinterpret_cast<float*>(sFk + 2 * BN);

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
  load_tile<D, BM, NT>(sO, p.o + qoff, qstride, i0, E, tid);
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
  cp_wait<0>();
  __syncthreads();
  {  // delta = rowsum(dO * O) in fp32: two threads a row, every other 16-byte chunk each
    static_assert(NT == 2 * BM, "two threads per row");
    const int r = tid >> 1;
    const unsigned char* drow = smem + 3 * BN * RB;  // dO, in buffer 1's V rows
    const unsigned char* orow = smem + 4 * BN * RB;
    float acc = 0.0f;
#pragma unroll
    for (int c = tid & 1; c < D / 8; c += 2) {
      const uint4 a = *reinterpret_cast<const uint4*>(drow + Tile<D>::off(r, c));
      const uint4 o = *reinterpret_cast<const uint4*>(orow + Tile<D>::off(r, c));
      const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
      const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float2 fa = __bfloat1622float2(a2[x]), fo = __bfloat1622float2(o2[x]);
        acc = fmaf(fa.x, fo.x, fmaf(fa.y, fo.y, acc));
      }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if ((tid & 1) == 0) {
      sDl[r] = acc;
      if (i0 + r < E) p.delta[(int64_t(b) * p.Hq + h) * T + i0 + r] = acc;
    }
  }
  __syncthreads();
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wr0 + g + 8 * r;
    lse2[r] = row < E ? p.lse_in[(int64_t(b) * p.Hq + h) * T + row] * kLog2e : 0.0f;
    dl[r] = sDl[w * 16 + g + 8 * r];
  }
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

  // The warp's own rows of the O tile (read only for delta) take its dQ rows on the way out.
  const float mul[2] = {p.scale, p.scale};
  unsigned char* tile = smem + 4 * BN * RB;
  stage_rows16<D>(tile, w * 16, acc, mul, lane);
  __syncwarp();
  copy_rows16<D>(tile, w * 16, p.dq + qoff, qstride, wr0, E, lane);
}

// Grid (B * Hq, Y), as the forward's: block y takes query tile Y-1-y.
template <int D, int NW, int BN>
__global__ void __launch_bounds__(NW * 32) flash_bwd_dq_kernel(const FlashParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
  dq_tile<D, NW, BN>(p, smem, b, h, plain_work(p.T, 16 * NW, gridDim.y - 1 - blockIdx.y));
}

// Packed rows: block y takes the listed tiles y, y + Y, ... (a kernel of its own, as the
// forward's: the loop in one kernel with the plain path made the d128 tile spill on sm_90).
template <int D, int NW, int BN>
__global__ void __launch_bounds__(NW * 32) flash_bwd_dq_listed_kernel(const FlashParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
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
  // Each warp's own K and V rows take its dK and dV on the way out.
  const float mk[2] = {p.scale, p.scale}, mv[2] = {1.0f, 1.0f};
  __syncwarp();
  stage_rows16<D>(smem, w * 16, dk, mk, lane);
  stage_rows16<D>(smem + BN * RB, w * 16, dv, mv, lane);
  __syncwarp();
  copy_rows16<D>(smem, w * 16, p.dk + koff, kstride, wk0, E, lane);
  copy_rows16<D>(smem + BN * RB, w * 16, p.dv + koff, kstride, wk0, E, lane);
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

template <int D>
cudaError_t bwd_d(const FlashParams& p, cudaStream_t s) {
  using Q = DqCfg<D>;
  using K = DkvCfg<D>;
  auto kq = p.dq_tiles ? flash_bwd_dq_listed_kernel<D, Q::NW, Q::BN>
                       : flash_bwd_dq_kernel<D, Q::NW, Q::BN>;
  auto kkv = flash_bwd_dkdv_kernel<D, K::NW, K::BM>;
  cudaError_t e = allow_smem(kq, Q::smem);
  if (e == cudaSuccess) e = allow_smem(kkv, K::smem);
  if (e != cudaSuccess) return e;
  // dQ first: it computes every row's delta, which dK/dV reads.
  const int kv_tiles = (p.T + K::BN - 1) / K::BN, q_tiles = (p.T + Q::BM - 1) / Q::BM;
  dim3 gq(unsigned(p.B * p.Hq), unsigned(p.dq_tiles ? 2 * q_tiles : q_tiles));
  kq<<<gq, Q::NW * 32, Q::smem, s>>>(p);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  dim3 gkv(unsigned(p.B * p.Hk), unsigned(p.kv_tiles ? 2 * kv_tiles : kv_tiles));
  kkv<<<gkv, K::NW * 32, K::smem, s>>>(p);
  return cudaGetLastError();
}

}  // namespace

size_t flash_bwd_workspace(AttnDims d, bool has_seg) { return layout(d, has_seg, true).total; }

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
  if (seg) {
    const cudaError_t e = run_seg_plan<kBwdTile, false, kBwdTile, true>(
        p, p.bwd_cap, p.dq_tiles, p.dq_count, p.kv_tiles, p.kv_count, s);
    if (e != cudaSuccess) return e;
  }
  return by_head_dim(d.D, [&]<int D>() { return bwd_d<D>(p, s); });
}


}  // namespace rig::ops::cuda::k
