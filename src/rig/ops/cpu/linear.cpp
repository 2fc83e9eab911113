#include <cblas.h>

#include <algorithm>

#include "rig/ops/cpu/cpu_ops.h"

namespace rig::ops::cpu {

void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
  RIG_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2, "gemm needs 2-D tensors");
  const int64_t m = ta ? a.dim(1) : a.dim(0), k = ta ? a.dim(0) : a.dim(1);
  const int64_t kb = tb ? b.dim(1) : b.dim(0), n = tb ? b.dim(0) : b.dim(1);
  RIG_CHECK(k == kb && c.dim(0) == m && c.dim(1) == n, "gemm shapes {}{} x {}{} -> {}",
            shape_str(a.shape()), ta ? "^T" : "", shape_str(b.shape()), tb ? "^T" : "",
            shape_str(c.shape()));
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0) c.zero_(); else scale_(c, beta);
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              int(m), int(n), int(k), alpha, a.f32(), int(a.dim(1)), b.f32(), int(b.dim(1)), beta,
              c.f32(), int(n));
}

void gemm_plus(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& src, Tensor& out,
               float alpha, float beta) {
  RIG_CHECK(src.shape() == out.shape(), "gemm_plus: src {} but out {}", shape_str(src.shape()),
            shape_str(out.shape()));
  if (src.raw() != out.raw()) out.copy_from(src);
  gemm(a, ta, b, tb, out, alpha, beta);
}

void gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, const Tensor& bias) {
  gemm(a, ta, b, tb, c, 1.0f, 0.0f);
  add_bias(c, bias);
}

void add_bias(Tensor& y, const Tensor& bias) {
  const int64_t rows = y.dim(0), n = y.dim(1);
  float* p = y.f32();
  const float* b = bias.f32();
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) p[r * n + j] += b[j];
}

void bias_backward(const Tensor& dy, Tensor& dbias) {
  const int64_t rows = dy.dim(0), n = dy.dim(1);
  const float* p = dy.f32();
  float* d = dbias.f32();
#pragma omp parallel for
  for (int64_t j = 0; j < n; ++j) {
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) s += p[r * n + j];
    d[j] += float(s);
  }
}

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const int64_t rows = ids.numel(), h = table.dim(1), vocab = table.dim(0);
  const int64_t* id = ids.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    if (id[r] < 0 || id[r] >= vocab)
      bad_input("token id {} at position {} is outside the vocabulary of {}", id[r], r, vocab);
  const float* t = table.f32();
  float* o = out.f32();
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) std::copy_n(t + id[r] * h, h, o + r * h);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const int64_t rows = ids.numel(), h = dtable.dim(1);
  const int64_t* id = ids.data<int64_t>();
  const float* d = dout.f32();
  float* t = dtable.f32();
  // Rows sharing a token must add in order: parallel over columns, not rows.
#pragma omp parallel for
  for (int64_t j = 0; j < h; ++j)
    for (int64_t r = 0; r < rows; ++r) t[id[r] * h + j] += d[r * h + j];
}

}  // namespace rig::ops::cpu
