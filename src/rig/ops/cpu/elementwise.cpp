#include <algorithm>
#include <cmath>
#include <random>

#include "rig/ops/cpu/cpu_ops.h"

namespace rig::ops::cpu {

void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& a) {
  const int64_t n = g.numel();
  const float *pg = g.f32(), *pu = u.f32();
  float* pa = a.f32();
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    float s = pg[i] / (1.0f + std::exp(-pg[i]));
    pa[i] = s * pu[i];
  }
}

void swiglu_backward(const Tensor& da, const Tensor& g, const Tensor& u, Tensor& dg, Tensor& du) {
  const int64_t n = g.numel();
  const float *pda = da.f32(), *pg = g.f32(), *pu = u.f32();
  float *pdg = dg.f32(), *pdu = du.f32();
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    float sig = 1.0f / (1.0f + std::exp(-pg[i]));
    float silu = pg[i] * sig;
    pdu[i] = pda[i] * silu;
    pdg[i] = pda[i] * pu[i] * sig * (1.0f + pg[i] * (1.0f - sig));
  }
}

void cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor* dlogits,
                   Tensor& row_loss) {
  const int64_t rows = logits.dim(0), V = logits.dim(1);
  RIG_CHECK(targets.numel() == rows && row_loss.numel() == rows,
            "cross_entropy: logits {} targets {} row_loss {}", shape_str(logits.shape()),
            shape_str(targets.shape()), shape_str(row_loss.shape()));
  const float* pl = logits.f32();
  float* pd = dlogits ? dlogits->f32() : nullptr;
  float* pr = row_loss.f32();
  const int64_t* pt = targets.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    if (pt[r] != -100 && (pt[r] < 0 || pt[r] >= V))
      bad_input("label {} at position {} is outside the vocabulary of {}", pt[r], r, V);
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = pl + r * V;
    float* dx = pd ? pd + r * V : nullptr;
    if (pt[r] == -100) {
      if (dx) std::fill_n(dx, V, 0.0f);
      pr[r] = 0.0f;
      continue;
    }
    float mx = x[0];
    for (int64_t j = 1; j < V; ++j) mx = std::max(mx, x[j]);
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(double(x[j] - mx));
    const double lse = double(mx) + std::log(sum);
    pr[r] = float(lse - double(x[pt[r]]));
    if (dx) {
      for (int64_t j = 0; j < V; ++j) dx[j] = float(std::exp(double(x[j]) - lse)) * grad_scale;
      dx[pt[r]] -= grad_scale;
    }
  }
}

void cross_entropy_slice(const Tensor& logits, const Tensor& targets, int64_t v0, Tensor& stats) {
  const int64_t rows = logits.dim(0), Vc = logits.dim(1);
  RIG_CHECK(targets.numel() == rows && stats.numel() == 3 * rows,
            "cross_entropy_slice: logits {} targets {} stats {}", shape_str(logits.shape()),
            shape_str(targets.shape()), shape_str(stats.shape()));
  const float* pl = logits.f32();
  float* ps = stats.f32();
  const int64_t* pt = targets.data<int64_t>();
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = pl + r * Vc;
    float* st = ps + 3 * r;
    float mx = st[0];
    for (int64_t j = 0; j < Vc; ++j) mx = std::max(mx, x[j]);
    if (mx == -INFINITY) continue;
    double sum = st[0] == -INFINITY ? 0.0 : double(st[1]) * std::exp(double(st[0] - mx));
    for (int64_t j = 0; j < Vc; ++j) sum += std::exp(double(x[j] - mx));
    st[0] = mx;
    st[1] = float(sum);
    if (pt[r] >= v0 && pt[r] < v0 + Vc) st[2] = x[pt[r] - v0];
  }
}

void cross_entropy_finish(Tensor& stats, const Tensor& targets, int64_t V, Tensor& row_loss) {
  const int64_t rows = targets.numel();
  RIG_CHECK(stats.numel() == 3 * rows && row_loss.numel() == rows,
            "cross_entropy_finish: stats {} targets {} row_loss {}", shape_str(stats.shape()),
            shape_str(targets.shape()), shape_str(row_loss.shape()));
  float *ps = stats.f32(), *pr = row_loss.f32();
  const int64_t* pt = targets.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    if (pt[r] != -100 && (pt[r] < 0 || pt[r] >= V))
      bad_input("label {} at position {} is outside the vocabulary of {}", pt[r], r, V);
    const double lse = double(ps[3 * r]) + std::log(double(ps[3 * r + 1]));
    pr[r] = pt[r] == -100 ? 0.0f : float(lse - double(ps[3 * r + 2]));
    ps[3 * r] = float(lse);
  }
}

void cross_entropy_slice_backward(Tensor& logits, const Tensor& targets, int64_t v0,
                                  const Tensor& stats, float grad_scale) {
  const int64_t rows = logits.dim(0), Vc = logits.dim(1);
  RIG_CHECK(targets.numel() == rows && stats.numel() == 3 * rows,
            "cross_entropy_slice_backward: logits {} targets {} stats {}",
            shape_str(logits.shape()), shape_str(targets.shape()), shape_str(stats.shape()));
  float* pl = logits.f32();
  const float* ps = stats.f32();
  const int64_t* pt = targets.data<int64_t>();
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    float* x = pl + r * Vc;
    if (pt[r] == -100) {
      std::fill_n(x, Vc, 0.0f);
      continue;
    }
    const double lse = ps[3 * r];
    for (int64_t j = 0; j < Vc; ++j) x[j] = float(std::exp(double(x[j]) - lse)) * grad_scale;
    if (pt[r] >= v0 && pt[r] < v0 + Vc) x[pt[r] - v0] -= grad_scale;
  }
}

void add_(Tensor& a, const Tensor& b, float alpha) {
  const int64_t n = a.numel();
  RIG_CHECK(b.numel() == n, "add_: {} vs {}", shape_str(a.shape()), shape_str(b.shape()));
  float* pa = a.f32();
  const float* pb = b.f32();
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) pa[i] += alpha * pb[i];
}

void scale_(Tensor& a, float s) {
  const int64_t n = a.numel();
  float* pa = a.f32();
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) pa[i] *= s;
}

void cast(const Tensor& src, Tensor& dst) {
  RIG_CHECK(src.numel() == dst.numel() && src.device() == dst.device(), "cast: {} {} into {} {}",
            src.device().str(), shape_str(src.shape()), dst.device().str(), shape_str(dst.shape()));
  if (src.dtype() == dst.dtype()) {
    copy_bytes(dst.raw(), dst.device(), src.raw(), src.device(), src.nbytes());
    return;
  }
  RIG_CHECK(src.dtype() == DType::F32 || dst.dtype() == DType::F32, "cast: {} to {} is not supported",
            dtype_name(src.dtype()), dtype_name(dst.dtype()));
  // Chunks in parallel: model-sized casts (billions of elements) happen at load time.
  constexpr int64_t kChunk = int64_t(1) << 20;
  const int64_t n = src.numel(), chunks = (n + kChunk - 1) / kChunk;
  auto* in = static_cast<const char*>(src.raw());
  auto* out = static_cast<char*>(dst.raw());
#pragma omp parallel for
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk, len = std::min(kChunk, n - b);
    const void* i = in + dtype_nbytes(src.dtype(), b);
    void* o = out + dtype_nbytes(dst.dtype(), b);
    if (dst.dtype() == DType::F32) {
      convert_to_f32(src.dtype(), i, static_cast<float*>(o), size_t(len));
    } else {
      convert_from_f32(dst.dtype(), static_cast<const float*>(i), o, size_t(len));
    }
  }
}

double sum_squares(const Tensor& a) {
  const int64_t n = a.numel();
  const float* pa = a.f32();
  double s = 0;
#pragma omp parallel for reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += double(pa[i]) * pa[i];
  return s;
}

std::vector<double> sum_squares_list(const std::vector<Tensor>& ts) {
  std::vector<double> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(sum_squares(t));
  return out;
}

void dropout(const Tensor& x, float p, uint64_t seed, Tensor& out) {
  const int64_t n = x.numel();
  const float* px = x.f32();
  float* po = out.f32();
  if (p <= 0) {
    std::copy_n(px, n, po);
    return;
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  const float keep = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < n; ++i) po[i] = uni(rng) < p ? 0.0f : px[i] * keep;
}

namespace {
void adamw_scaled(Tensor& param, const Tensor& grad, float grad_scale, Tensor& m, Tensor& v,
                  const AdamWParams& h) {
  const int64_t n = param.numel();
  RIG_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n,
            "adamw_step: param {} grad {} m {} v {}", shape_str(param.shape()),
            shape_str(grad.shape()), shape_str(m.shape()), shape_str(v.shape()));
  float *pp = param.f32(), *pm = m.f32(), *pv = v.f32();
  const float* pg = grad.f32();
  // The same order of operations as torch's single-tensor AdamW.
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(h.step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(h.step));
  const float step_size = float(double(h.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float decay = 1.0f - h.lr * h.weight_decay;
  const float w1 = 1.0f - h.beta1, w2 = 1.0f - h.beta2;
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    const float g = pg[i] * grad_scale;  // as clip_grad_norm_ leaves it (x1: unchanged)
    pp[i] *= decay;
    pm[i] += w1 * (g - pm[i]);
    pv[i] = pv[i] * h.beta2 + w2 * g * g;
    const float denom = std::sqrt(pv[i]) / bc2_sqrt + h.eps;
    pp[i] -= step_size * (pm[i] / denom);
  }
}
}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& h) {
  adamw_scaled(param, grad, 1.0f, m, v, h);
}

void adamw_step_list(std::vector<AdamWSlot>& slots, const AdamWParams& h, float grad_scale) {
  for (auto& s : slots) {
    AdamWParams hs = h;
    hs.weight_decay = s.weight_decay;
    adamw_scaled(s.param, s.grad, grad_scale, s.m, s.v, hs);
    if (s.copy.defined()) cast(s.param, s.copy);
  }
}

}  // namespace rig::ops::cpu
