// rig's flash attention, forward (the design is at the top of flash_common.cuh).
#include "rig/ops/cuda/flash_common.cuh"

namespace rig::ops::cuda::k {

namespace {

// ================================================================ forward

// One query tile of BM = 32*NW rows; key tiles of BN, double-buffered, computed BNS keys at a
// time (a smaller S in registers: at D=128 the 128 accumulators of O leave no room for a 64-wide
// S). Shared rows: Q [0, BM), buffer c: K at BM + 2BN c, V after it; then the segment ids
// (`first`) of the Q rows [BM] and of each buffer's keys [2][BN].
// Balanced rows: warp w owns the m16 row blocks w and 2NW-1-w, one from each end of the tile, and
// each block skips the key sub-tiles it cannot see on its own, so the causal diagonal and a
// segment's part-empty last tile load the warps evenly (with contiguous rows, the first warps
// idled at every barrier: 3% of plain causal, 9% of packed rows at d64, H200 2026-12-04). A
// sub-tile runs one of three bodies (both blocks, the later one, the earlier one): a branch per
// block inside the product loops stalled the tensor-core pipeline (plain causal 22% slower).
// Long on purpose: one tile's loads, products, softmax and stores share dozens of register
// arrays (the accumulators), which helpers would have to pass by reference through every stage.
template <int D, int NW, int BN, int BNS>
__device__ __forceinline__ void fwd_tile(const FlashParams& p, unsigned char* smem, int b, int h,
                                         const Work& wk) {
  constexpr int MT = 2, BM = 16 * MT * NW, NT = NW * 32, KS = D / 16, NN = BNS / 8, ND = D / 8;
  constexpr int RB = Tile<D>::kRowBytes;
  static_assert(BN % BNS == 0 && BNS % 16 == 0, "sub-tiles of whole k16 steps");
  const uint32_t s0 = smem_u32(smem);
  auto sK = [&](int c) { return s0 + uint32_t((BM + 2 * BN * c) * RB); };
  auto sV = [&](int c) { return sK(c) + uint32_t(BN * RB); };
  int* sFq = reinterpret_cast<int*>(smem + (BM + 4 * BN) * RB);
  int* sFk = sFq + BM;

  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int T = p.T, E = wk.e, hk = h / p.group, i0 = wk.i0;
  const int i_last = min(i0 + BM, E) - 1;
  const QuerySeg qs(p, b, wk);
  const bool masked = qs.first != nullptr;
  const int jb = wk.s, n_end = (i_last - jb) / BN + 1;

  const int64_t qstride = int64_t(p.Hq) * D, kstride = int64_t(p.Hk) * D;
  const bf16* kg = p.k + (int64_t(b) * T * p.Hk + hk) * D;
  const bf16* vg = p.v + (int64_t(b) * T * p.Hk + hk) * D;
  load_tile<D, BM, NT>(s0, p.q + (int64_t(b) * T * p.Hq + h) * D, qstride, i0, E, tid);
  load_tile<D, BN, NT>(sK(0), kg, kstride, jb, E, tid);
  load_tile<D, BN, NT>(sV(0), vg, kstride, jb, E, tid);
  if (masked) {
    load_first<BM, NT>(sFq, qs.first, i0, E, tid);
    load_first<BN, NT>(sFk, qs.first, jb, E, tid);
  }
  cp_commit();

  const int qr[MT] = {16 * w, 16 * (2 * NW - 1 - w)};  // each block's first row in the tile
  const Lanes<D> lq0 = lanes_a<D>(lane), lk0 = lanes_bn<D>(lane), lv0 = lanes_a<D>(lane);

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
      if (masked) load_first<BN, NT>(sFk + (cur ^ 1) * BN, qs.first, j0 + BN, E, tid);
    }
    cp_commit();
    const uint32_t sk = sK(cur), sv = sV(cur);
    const int* fk = sFk + cur * BN - j0;  // fk[col]: the key's segment
    // Blocks [M0, M1) against keys [js, js + BNS).
    auto step = [&]<int M0, int M1>(int sub) {
      const int js = j0 + sub * BNS;
      const Lanes<D> lq = lq0.fresh(), lk = lk0.fresh();
      float s[MT][NN][4];
#pragma unroll
      for (int mt = M0; mt < M1; ++mt)
#pragma unroll
        for (int nt = 0; nt < NN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = M0; mt < M1; ++mt) ldsm4(a[mt], lq(s0, qr[mt], 2 * kk));
#pragma unroll
        for (int np = 0; np < NN / 2; ++np) {
          uint32_t bb[4];
          ldsm4(bb, lk(sk, sub * BNS + np * 16, 2 * kk));
#pragma unroll
          for (int mt = M0; mt < M1; ++mt) {
            mma(s[mt][2 * np], a[mt], bb[0], bb[1]);
            mma(s[mt][2 * np + 1], a[mt], bb[2], bb[3]);
          }
        }
      }
#pragma unroll
      for (int mt = M0; mt < M1; ++mt) {
        if (!masked && js + BNS - 1 <= i0 + qr[mt]) continue;  // all visible
#pragma unroll
        for (int nt = 0; nt < NN; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = js + nt * 8 + 2 * t4 + e;
            const int ks = masked ? fk[col] : 0;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = i0 + qr[mt] + g + 8 * r;
              const int rs = masked ? sFq[row - i0] : 0;
              if (!(col <= row && ks == rs)) s[mt][nt][2 * r + e] = -INFINITY;
            }
          }
      }
#pragma unroll
      for (int mt = M0; mt < M1; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < NN; ++nt)
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mn = fmaxf(m[mt][r], mx);
          const float mu = mn == -INFINITY ? 0.0f : mn;
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
          l[mt][r] = l[mt][r] * corr + rs;
#pragma unroll
          for (int nt = 0; nt < ND; ++nt) {
            o[mt][nt][2 * r] *= corr;
            o[mt][nt][2 * r + 1] *= corr;
          }
        }
      const Lanes<D> lv = lv0.fresh();
#pragma unroll
      for (int kk = 0; kk < BNS / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = M0; mt < M1; ++mt) {
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
          for (int mt = M0; mt < M1; ++mt) {
            mma(o[mt][2 * np], a[mt], bb[0], bb[1]);
            mma(o[mt][2 * np + 1], a[mt], bb[2], bb[3]);
          }
        }
      }
    };
#pragma unroll
    for (int sub = 0; sub < BN / BNS; ++sub) {
      const int js = j0 + sub * BNS;
      const bool a0 = i0 + qr[0] < E && js <= i0 + qr[0] + 15;
      const bool a1 = i0 + qr[1] < E && js <= i0 + qr[1] + 15;
      if (a0 && a1)
        step.template operator()<0, 2>(sub);
      else if (a1)
        step.template operator()<1, 2>(sub);
      else if (a0)
        step.template operator()<0, 1>(sub);
      else
        break;  // no key from here on is visible to this warp's rows
    }
    cp_wait<0>();
    __syncthreads();
  }

  float inv[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lt = l[mt][r];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      inv[mt][r] = lt > 0.0f ? 1.0f / lt : 0.0f;
      const int row = i0 + qr[mt] + g + 8 * r;
      if (row < E && t4 == 0)
        p.lse[(int64_t(b) * p.Hq + h) * T + row] =
            lt > 0.0f ? m[mt][r] * p.scale + logf(lt) : -INFINITY;
    }
  bf16* orows = p.out + (int64_t(b) * T * p.Hq + h) * D;
  // Each warp's own Q rows take its O rows on the way out (the loop ended on a barrier).
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) stage_rows16<D>(smem, qr[mt], o[mt], inv[mt], lane);
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    copy_rows16<D>(smem, qr[mt], orows, qstride, i0 + qr[mt], E, lane);
}

// Grid (B * Hq, Y): block y takes query tile Y-1-y (longest rows first).
template <int D, int NW, int BN, int BNS>
__global__ void __launch_bounds__(NW * 32) flash_fwd_kernel(const FlashParams p) {
  constexpr int BM = 32 * NW;
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
  fwd_tile<D, NW, BN, BNS>(p, smem, b, h, plain_work(p.T, BM, gridDim.y - 1 - blockIdx.y));
}

// Packed rows: grid (B * Hq, Y), block y takes the listed tiles y, y + Y, ... of its batch row
// (the list is sorted longest first). A kernel of its own: the loop in the plain kernel made
// the d128 tile spill on sm_89.
template <int D, int NW, int BN, int BNS>
__global__ void __launch_bounds__(NW * 32) flash_fwd_listed_kernel(const FlashParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
  const int4* tiles = p.fwd_tiles + int64_t(b) * p.fwd_cap;
  for (int it = blockIdx.y; it < p.fwd_count[b]; it += gridDim.y) {
    fwd_tile<D, NW, BN, BNS>(p, smem, b, h, listed_work(tiles, it));
    __syncthreads();  // the next tile reuses shared memory
  }
}

template <typename C, int D, bool LISTED>
cudaError_t fwd_launch(const FlashParams& p, unsigned blocks_y, cudaStream_t s) {
  auto kern = LISTED ? flash_fwd_listed_kernel<D, C::NW, C::BN, C::BNS>
                     : flash_fwd_kernel<D, C::NW, C::BN, C::BNS>;
  cudaError_t e = allow_smem(kern, C::smem);
  if (e != cudaSuccess) return e;
  kern<<<dim3(unsigned(p.B * p.Hq), blocks_y), C::NW * 32, C::smem, s>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t fwd_d(const FlashParams& p, cudaStream_t s) {
  using C = FwdCfg<D>;
  const unsigned tiles = unsigned((p.T + C::BM - 1) / C::BM);
  if (!p.fwd_tiles) return fwd_launch<C, D, false>(p, tiles, s);
  cudaError_t e =
      run_seg_plan<C::BM, false>(p, p.fwd_cap, p.fwd_tiles, p.fwd_count, nullptr, nullptr, s);
  if (e != cudaSuccess) return e;
  // Twice the plain count of blocks, each looping over its share of the list.
  return fwd_launch<C, D, true>(p, 2 * tiles, s);
}

}  // namespace

bool flash_supports(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;
}

size_t flash_fwd_workspace(AttnDims d, bool has_seg) { return layout(d, has_seg, false).total; }

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
  return by_head_dim(d.D, [&]<int D>() { return fwd_d<D>(p, s); });
}


}  // namespace rig::ops::cuda::k
