// Routes each op of op_table.inc to its backend by the device of one of its tensors.
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

// The table's RIG_OP and RIG_OP_VIA rows: route by the device of `device_of`.
#define RIG_OP(ret, name, category, device_of, params, args) \
  ret name params {                                          \
    RIG_DISPATCH_AS(category, device_of, name args);         \
  }
#define RIG_OP_VIA(ret, name, category, device_of, params, backend_call) \
  ret name params {                                                      \
    RIG_DISPATCH_AS(category, device_of, backend_call);                  \
  }
#include "rig/ops/op_table.inc"

// The table's RIG_OP_CUSTOM rows, routed by hand.
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
std::vector<double> sum_squares_list(const std::vector<Tensor>& ts) {
  if (ts.empty()) return {};
  RIG_DISPATCH_AS("optimizer", ts.front(), sum_squares_list(ts));
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
