// Causal attention, one (batch, head) at a time. Backward recomputes the probabilities from the
// saved log-sum-exp rather than keeping the [T, T] matrix, as the GPU kernels do.
#include <cmath>
#include <limits>
#include <vector>

#include "rig/ops/cpu/cpu_ops.h"

namespace rig::ops::cpu {

namespace {
struct Dims {
  int64_t B, T, Hq, Hk, D;
};
Dims dims_of(const Tensor& q, const Tensor& k) {
  RIG_CHECK(q.ndim() == 4 && k.ndim() == 4, "attention expects [B,T,H,D] tensors");
  Dims d{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3)};
  RIG_CHECK(d.Hq % d.Hk == 0, "kv heads {} do not divide query heads {}", d.Hk, d.Hq);
  return d;
}
inline bool visible(const int64_t* seg, int64_t b, int64_t T, int64_t i, int64_t j) {
  return j <= i && (!seg || seg[b * T + j] == seg[b * T + i]);
}
}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       Tensor& out, Tensor& lse) {
  const Dims d = dims_of(q, k);
  const float scale = 1.0f / std::sqrt(float(d.D));
  const float *pq = q.f32(), *pk = k.f32(), *pv = v.f32();
  float *po = out.f32(), *pl = lse.f32();
  const int64_t* ps = seg.defined() ? seg.data<int64_t>() : nullptr;
  const int64_t group = d.Hq / d.Hk;
#pragma omp parallel
  {
    std::vector<float> s(size_t(d.T));
#pragma omp for collapse(2)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.Hq; ++h) {
        const int64_t hk = h / group;
        for (int64_t i = 0; i < d.T; ++i) {
          const float* qi = pq + ((b * d.T + i) * d.Hq + h) * d.D;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j <= i; ++j) {
            if (!visible(ps, b, d.T, i, j)) continue;
            const float* kj = pk + ((b * d.T + j) * d.Hk + hk) * d.D;
            float dot = 0;
            for (int64_t x = 0; x < d.D; ++x) dot += qi[x] * kj[x];
            s[size_t(j)] = dot * scale;
            mx = std::max(mx, s[size_t(j)]);
          }
          double sum = 0;
          for (int64_t j = 0; j <= i; ++j)
            if (visible(ps, b, d.T, i, j)) sum += std::exp(double(s[size_t(j)] - mx));
          const float l = mx + float(std::log(sum));
          pl[(b * d.Hq + h) * d.T + i] = l;
          float* oi = po + ((b * d.T + i) * d.Hq + h) * d.D;
          std::fill_n(oi, d.D, 0.0f);
          for (int64_t j = 0; j <= i; ++j) {
            if (!visible(ps, b, d.T, i, j)) continue;
            const float p = std::exp(s[size_t(j)] - l);
            const float* vj = pv + ((b * d.T + j) * d.Hk + hk) * d.D;
            for (int64_t x = 0; x < d.D; ++x) oi[x] += p * vj[x];
          }
        }
      }
  }
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& seg, const Tensor& out, const Tensor& lse, Tensor& dq,
                        Tensor& dk, Tensor& dv) {
  const Dims d = dims_of(q, k);
  const float scale = 1.0f / std::sqrt(float(d.D));
  const float *pq = q.f32(), *pk = k.f32(), *pv = v.f32(), *po = out.f32(), *pl = lse.f32(),
              *pdo = dout.f32();
  float *pdq = dq.f32(), *pdk = dk.f32(), *pdv = dv.f32();
  const int64_t* ps = seg.defined() ? seg.data<int64_t>() : nullptr;
  const int64_t group = d.Hq / d.Hk;
  dq.zero_();
  dk.zero_();
  dv.zero_();
  // Each (batch, kv head) owns its dk/dv rows and the dq rows of its query heads.
#pragma omp parallel for collapse(2)
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t hk = 0; hk < d.Hk; ++hk)
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i = 0; i < d.T; ++i) {
          const int64_t qi_off = ((b * d.T + i) * d.Hq + h) * d.D;
          const float *qi = pq + qi_off, *doi = pdo + qi_off, *oi = po + qi_off;
          float* dqi = pdq + qi_off;
          const float l = pl[(b * d.Hq + h) * d.T + i];
          float delta = 0;
          for (int64_t x = 0; x < d.D; ++x) delta += doi[x] * oi[x];
          for (int64_t j = 0; j <= i; ++j) {
            if (!visible(ps, b, d.T, i, j)) continue;
            const int64_t kj_off = ((b * d.T + j) * d.Hk + hk) * d.D;
            const float *kj = pk + kj_off, *vj = pv + kj_off;
            float dot = 0, dp = 0;
            for (int64_t x = 0; x < d.D; ++x) {
              dot += qi[x] * kj[x];
              dp += doi[x] * vj[x];
            }
            const float p = std::exp(dot * scale - l);
            const float ds = p * (dp - delta) * scale;
            float *dkj = pdk + kj_off, *dvj = pdv + kj_off;
            for (int64_t x = 0; x < d.D; ++x) {
              dqi[x] += ds * kj[x];
              dkj[x] += ds * qi[x];
              dvj[x] += p * doi[x];
            }
          }
        }
}

}  // namespace rig::ops::cpu
