#include <cmath>

#include "rig/ops/cpu/cpu_ops.h"

namespace rig::ops::cpu {

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  const int64_t rows = x.dim(0), h = x.dim(1);
  const float *px = x.f32(), *pw = w.f32();
  float *py = y.f32(), *pr = rstd.f32();
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = px + r * h;
    float ss = 0;
    for (int64_t j = 0; j < h; ++j) ss += xr[j] * xr[j];
    float rs = 1.0f / std::sqrt(ss / float(h) + eps);
    pr[r] = rs;
    float* yr = py + r * h;
    // Hugging Face multiplies the normalised value by the weight after rounding to the input dtype.
    for (int64_t j = 0; j < h; ++j) yr[j] = pw[j] * (xr[j] * rs);
  }
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  const int64_t rows = x.dim(0), h = x.dim(1);
  const float *px = x.f32(), *pw = w.f32(), *pdy = dy.f32(), *pr = rstd.f32();
  float *pdx = dx.f32(), *pdw = dw.f32();
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = px + r * h, *dyr = pdy + r * h;
    float rs = pr[r];
    double dot = 0;
    for (int64_t j = 0; j < h; ++j) dot += double(dyr[j]) * pw[j] * xr[j];
    float c = float(dot / double(h)) * rs * rs;
    float* dxr = pdx + r * h;
    for (int64_t j = 0; j < h; ++j) dxr[j] = rs * (dyr[j] * pw[j] - xr[j] * c);
  }
#pragma omp parallel for
  for (int64_t j = 0; j < h; ++j) {
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) s += double(pdy[r * h + j]) * px[r * h + j] * pr[r];
    pdw[j] += float(s);
  }
}

void rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                          Tensor& dh, Tensor* dh_copy, Tensor* dw) {
  RIG_CHECK(dh.shape() == x.shape(), "rmsnorm_backward_add: dh {} for x {}", shape_str(dh.shape()),
            shape_str(x.shape()));
  Tensor dx = Tensor::empty(x.shape(), DType::F32, Device::cpu(), "rmsnorm dx");
  Tensor unused = Tensor::zeros(w.shape(), DType::F32, Device::cpu(), "rmsnorm dw");
  rmsnorm_backward(dy, x, w, rstd, dx, dw ? *dw : unused);
  add_(dh, dx, 1.0f);
  if (dh_copy && dh_copy->raw() != dh.raw()) dh_copy->copy_from(dh);
}

}  // namespace rig::ops::cpu
