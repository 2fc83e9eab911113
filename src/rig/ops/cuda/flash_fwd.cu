// rig's flash attention, forward (the design is at the top of flash_common.cuh).
#include "rig/ops/cuda/flash_common.cuh"

namespace rig::ops::cuda::k {

namespace {

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

// Grid (B * Hq, Y): block y takes query tile Y-1-y (longest rows first).
template <int D, int MT, int NW, int BN, int BNS>
__global__ void __launch_bounds__(NW * 32) flash_fwd_kernel(const FlashParams p) {
  constexpr int BM = 16 * MT * NW;
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
  fwd_tile<D, MT, NW, BN, BNS>(p, smem, b, h, plain_work(p.T, BM, gridDim.y - 1 - blockIdx.y));
}

// Packed rows: grid (B * Hq, Y), block y takes the listed tiles y, y + Y, ... of its batch row
// (the list is sorted longest first). A kernel of its own: the loop in the plain kernel made
// the d128 tile spill on sm_89.
template <int D, int MT, int NW, int BN, int BNS>
__global__ void __launch_bounds__(NW * 32) flash_fwd_listed_kernel(const FlashParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int b = blockIdx.x / p.Hq, h = blockIdx.x % p.Hq;
  const int4* tiles = p.fwd_tiles + int64_t(b) * p.fwd_cap;
  for (int it = blockIdx.y; it < p.fwd_count[b]; it += gridDim.y) {
    fwd_tile<D, MT, NW, BN, BNS>(p, smem, b, h, listed_work(tiles, it));
    __syncthreads();  // the next tile reuses shared memory
  }
}

template <typename C, int D, bool LISTED>
cudaError_t fwd_launch(const FlashParams& p, unsigned blocks_y, cudaStream_t s) {
  auto kern = LISTED ? flash_fwd_listed_kernel<D, C::MT, C::NW, C::BN, C::BNS>
                     : flash_fwd_kernel<D, C::MT, C::NW, C::BN, C::BNS>;
  cudaError_t e = allow_smem(kern, C::smem);
  if (e != cudaSuccess) return e;
  kern<<<dim3(unsigned(p.B * p.Hq), blocks_y), C::NW * 32, C::smem, s>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t fwd_d(const FlashParams& p, cudaStream_t s) {
  using Plain = FwdCfg<D>;
  using Listed = FwdListedCfg<D>;
  if (!p.fwd_tiles)
    return fwd_launch<Plain, D, false>(p, unsigned((p.T + Plain::BM - 1) / Plain::BM), s);
  cudaError_t e = run_tile_list<Listed::BM, false>(p, p.fwd_cap, p.fwd_tiles, p.fwd_count, s);
  if (e != cudaSuccess) return e;
  // Twice the plain count of blocks, each looping over its share of the list.
  return fwd_launch<Listed, D, true>(p, unsigned(2 * ((p.T + Listed::BM - 1) / Listed::BM)), s);
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
  cudaError_t e = run_seg_info(p, workspace, w, s);
  if (e != cudaSuccess) return e;
  return by_head_dim(d.D, [&]<int D>() { return fwd_d<D>(p, s); });
}


}  // namespace rig::ops::cuda::k
