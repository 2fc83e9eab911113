// Routes each op to its backend by the device of its first tensor.
#include "rig/ops/cpu/cpu_ops.h"
#include "rig/ops/ops.h"

#include "rig/ops/profile.h"

// Every op records its span under a category while a profile is open (rig bench train --profile).
#ifdef RIG_WITH_CUDA
#include "rig/ops/cuda/cuda_ops.h"
#define RIG_DISPATCH_AS(category, t, call)                                         \
  do {                                                                             \
    OpScope rig_scope_(__func__, category, (t).device().is_cuda(), (t).device().index); \
    if ((t).device().is_cuda()) return cuda::call;                                 \
    return cpu::call;                                                              \
  } while (0)
#else
#define RIG_DISPATCH_AS(category, t, call)                   \
  do {                                                       \
    OpScope rig_scope_(__func__, category, false, -1);       \
    return cpu::call;                                        \
  } while (0)
#endif

namespace rig::ops {

void set_deterministic(bool on) {
#ifdef RIG_WITH_CUDA
  cuda::set_deterministic(on);
#else
  (void)on;
#endif
}

void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
  if (profiling()) {
    // Each product shape on its own line of the profile: m x n x k, the dtypes, accumulation.
    const std::string name = fmt::format(
        "gemm {}x{}x{} {}{}{} {}", c.dim(0), c.dim(1), ta ? a.dim(0) : a.dim(1),
        dtype_name(a.dtype()), c.dtype() == a.dtype() ? "" : "->", c.dtype() == a.dtype() ? "" : dtype_name(c.dtype()),
        beta == 0.0f ? "" : "+=");
    OpScope scope(name.c_str(), "matmul", c.device().is_cuda(), c.device().index);
#ifdef RIG_WITH_CUDA
    if (c.device().is_cuda()) return cuda::gemm(a, ta, b, tb, c, alpha, beta);
#endif
    return cpu::gemm(a, ta, b, tb, c, alpha, beta);
  }
  RIG_DISPATCH_AS("matmul", c, gemm(a, ta, b, tb, c, alpha, beta));
}
void gemm_plus(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& src, Tensor& out,
               float alpha, float beta) {
  RIG_DISPATCH_AS("matmul", out, gemm_plus(a, ta, b, tb, src, out, alpha, beta));
}
void gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, const Tensor& bias) {
  RIG_DISPATCH_AS("matmul", c, gemm_bias(a, ta, b, tb, c, bias));
}
void add_bias(Tensor& y, const Tensor& bias) { RIG_DISPATCH_AS("elementwise", y, add_bias(y, bias)); }
void bias_backward(const Tensor& dy, Tensor& db) { RIG_DISPATCH_AS("elementwise", dy, bias_backward(dy, db)); }
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  RIG_DISPATCH_AS("elementwise", out, embedding_forward(ids, table, out));
}
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  RIG_DISPATCH_AS("elementwise", dout, embedding_backward(ids, dout, dtable));
}
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  RIG_DISPATCH_AS("norm", x, rmsnorm_forward(x, w, eps, y, rstd));
}
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  RIG_DISPATCH_AS("norm", x, rmsnorm_backward(dy, x, w, rstd, dx, dw));
}
void rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                          Tensor& dh, Tensor* dh_copy, Tensor* dw) {
  RIG_DISPATCH_AS("norm", x, rmsnorm_backward_add(dy, x, w, rstd, dh, dh_copy, dw));
}
void rope_forward(Tensor& x, const Tensor& pos, const Tensor& cos, const Tensor& sin, int heads) {
  RIG_DISPATCH_AS("elementwise", x, rope(x, pos, cos, sin, heads, false));
}
void rope_backward(Tensor& dx, const Tensor& pos, const Tensor& cos, const Tensor& sin, int heads) {
  RIG_DISPATCH_AS("elementwise", dx, rope(dx, pos, cos, sin, heads, true));
}
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       Tensor& out, Tensor& lse) {
  RIG_DISPATCH_AS("attention", q, attention_forward(q, k, v, seg, out, lse));
}
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& seg, const Tensor& out, const Tensor& lse, Tensor& dq,
                        Tensor& dk, Tensor& dv) {
  RIG_DISPATCH_AS("attention", q, attention_backward(dout, q, k, v, seg, out, lse, dq, dk, dv));
}
void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& a) {
  RIG_DISPATCH_AS("elementwise", g, swiglu_forward(g, u, a));
}
void swiglu_backward(const Tensor& da, const Tensor& g, const Tensor& u, Tensor& dg, Tensor& du) {
  RIG_DISPATCH_AS("elementwise", g, swiglu_backward(da, g, u, dg, du));
}
double cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale,
                     Tensor* dlogits, int64_t* valid) {
  RIG_DISPATCH_AS("loss", logits, cross_entropy(logits, targets, grad_scale, dlogits, valid));
}
void add_(Tensor& a, const Tensor& b, float alpha) { RIG_DISPATCH_AS("elementwise", a, add_(a, b, alpha)); }
void scale_(Tensor& a, float s) { RIG_DISPATCH_AS("elementwise", a, scale_(a, s)); }
double sum_squares(const Tensor& a) { RIG_DISPATCH_AS("optimizer", a, sum_squares(a)); }
std::vector<double> sum_squares_list(const std::vector<Tensor>& ts) {
  if (ts.empty()) return {};
  RIG_DISPATCH_AS("optimizer", ts.front(), sum_squares_list(ts));
}
void cast(const Tensor& src, Tensor& dst) { RIG_DISPATCH_AS("elementwise", dst, cast(src, dst)); }
void dropout(const Tensor& x, float p, uint64_t seed, Tensor& out) {
  RIG_DISPATCH_AS("elementwise", x, dropout(x, p, seed, out));
}
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& h) {
  RIG_DISPATCH_AS("optimizer", param, adamw_step(param, grad, m, v, h));
}
void adamw_step_list(std::vector<AdamWSlot>& slots, const AdamWParams& h, float grad_scale) {
  if (slots.empty()) return;
  RIG_DISPATCH_AS("optimizer", slots.front().param, adamw_step_list(slots, h, grad_scale));
}

namespace {
// The guard's list ops run where the first tensor lives; every other one must be there too.
Device list_device(const std::vector<Tensor>& ts, const char* op) {
  Device d = Device::cpu();
  for (size_t i = 0; i < ts.size(); ++i) {
    RIG_CHECK(ts[i].defined(), "{}: tensor {} of the list is undefined", op, i);
    if (i == 0) d = ts[i].device();
    RIG_CHECK(ts[i].device() == d, "{}: tensor {} is on {}, the first on {}", op, i,
              ts[i].device().str(), d.str());
  }
  return d;
}
}  // namespace

int64_t count_bad_values(const std::vector<Tensor>& ts, double max_abs) {
  [[maybe_unused]] const Device d = list_device(ts, "count_bad_values");
#ifdef RIG_WITH_CUDA
  if (d.is_cuda()) return cuda::count_bad_values(ts, max_abs);
#endif
  return cpu::count_bad_values(ts, max_abs);
}
uint64_t hash64(const std::vector<Tensor>& ts) {
  [[maybe_unused]] const Device d = list_device(ts, "hash64");
#ifdef RIG_WITH_CUDA
  if (d.is_cuda()) return cuda::hash64(ts);
#endif
  return cpu::hash64(ts);
}

}  // namespace rig::ops
