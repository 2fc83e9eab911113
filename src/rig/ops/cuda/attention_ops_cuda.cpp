// Host wrappers of the attention ops: argument checks, then cuDNN's fused SDPA, rig's flash
// kernel or the fp32 reference kernel, whichever applies first (or the one RIG_ATTENTION forces).
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/cuda_ops.h"
#include "rig/ops/cuda/flash_attention.h"
#include "rig/ops/cuda/sdpa_cudnn.h"

namespace rig::ops::cuda {

// ---- attention ----------------------------------------------------------------------------

namespace {
k::AttnDims attn_dims(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                      const char* op) {
  RIG_CHECK(q.ndim() == 4 && k.ndim() == 4, "{}: expects [B,T,H,D] tensors, got q {} k {}", op,
            shape_str(q.shape()), shape_str(k.shape()));
  same_shape(k, v, op, "k", "v");
  RIG_CHECK(k.dim(0) == q.dim(0) && k.dim(1) == q.dim(1) && k.dim(3) == q.dim(3),
            "{}: q {} and k {} disagree", op, shape_str(q.shape()), shape_str(k.shape()));
  RIG_CHECK(k.dim(2) > 0 && q.dim(2) % k.dim(2) == 0, "{}: kv heads {} do not divide query heads {}",
            op, k.dim(2), q.dim(2));
  RIG_CHECK(q.dim(3) <= k::attention_max_head_dim(), "{}: head_dim {} above the supported {}", op,
            q.dim(3), k::attention_max_head_dim());
  RIG_CHECK(q.dim(1) < (int64_t(1) << 31) && q.dim(0) < 65536 && q.dim(2) < 65536,
            "{}: q {} too large", op, shape_str(q.shape()));
  if (seg.defined()) {
    check_dtype(seg, DType::I64, op, "seg");
    RIG_CHECK(seg.numel() == q.dim(0) * q.dim(1), "{}: seg {} for q {}", op,
              shape_str(seg.shape()), shape_str(q.shape()));
  }
  return k::AttnDims{int(q.dim(0)), int(q.dim(1)), int(q.dim(2)), int(k.dim(2)), int(q.dim(3))};
}
}  // namespace

namespace {

// Which implementation runs attention: the RIG_ATTENTION environment variable (auto, cudnn,
// flash, reference) or set_attention_impl; "auto" takes cuDNN (packed rows with head_dim 96 and
// up as ragged batches, where the runtime has them), then rig's flash kernel, then the fp32
// reference kernel, each where it supports the call.
std::string& impl_setting() {
  static std::string s = [] {
    const char* e = std::getenv("RIG_ATTENTION");
    return std::string(e && *e ? e : "auto");
  }();
  return s;
}
std::string g_last_impl[2];
bool g_deterministic = false;

enum class Impl { Cudnn, Flash, Reference };
const char* impl_name(Impl i) {
  return i == Impl::Cudnn ? "cudnn" : i == Impl::Flash ? "flash" : "reference";
}

// The implementations to try for this call, in order. A forced one that cannot run is an error.
std::vector<Impl> candidates(const Tensor& q, const Tensor& seg, const k::AttnDims& d,
                             const char* op) {
  const std::string& want = impl_setting();
  const bool bf16 = q.dtype() == DType::BF16;
  const bool flash_ok = bf16 && k::flash_supports(d.D);
  if (want == "reference") return {Impl::Reference};
  if (want == "cudnn") {
    RIG_CHECK(bf16, "{}: RIG_ATTENTION=cudnn needs bf16", op);
    return {Impl::Cudnn};
  }
  if (want == "flash") {
    RIG_CHECK(flash_ok, "{}: RIG_ATTENTION=flash needs bf16 and a head_dim of 64, 80, 96 or 128 "
              "(got {} {})", op, dtype_name(q.dtype()), d.D);
    return {Impl::Flash};
  }
  RIG_CHECK(want == "auto", "RIG_ATTENTION={}: expected auto, cudnn, flash or reference", want);
  std::vector<Impl> c;
  // Packed rows: cuDNN's ragged batches against the flash kernel on the H200 (docs/perf-notes.md,
  // session 10), forward / backward: d64 0.90-1.0×, d80 0.99× / 0.98×, d96 1.21× / 1.03×, d128
  // 1.35× / 1.15×. Below 96 the flash kernel keeps them.
  if (bf16 && (!seg.defined() || d.D >= 96)) c.push_back(Impl::Cudnn);
  if (flash_ok) c.push_back(Impl::Flash);
  c.push_back(Impl::Reference);
  return c;
}

Tensor flash_workspace(size_t bytes, int dev) {
  return Tensor::empty({int64_t(std::max<size_t>(bytes, 1))}, DType::U8, Device::cuda(dev),
                       "flash attention workspace");
}

}  // namespace

void set_attention_impl(const std::string& impl) { impl_setting() = impl; }
const std::string& attention_impl() { return impl_setting(); }
const std::string& last_attention_impl(bool backward) { return g_last_impl[backward ? 1 : 0]; }
void set_deterministic(bool on) { g_deterministic = on; }
bool deterministic() {
  return g_deterministic;
}

namespace {

// The checks both directions share (q/k/v/out/lse and seg); returns the call's dimensions.
k::AttnDims check_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       const Tensor& out, const Tensor& lse, const char* op) {
  const int dev = q.device().index;
  for (auto [t, n] : {std::pair{&k, "k"}, {&v, "v"}, {&out, "out"}, {&lse, "lse"}})
    check_on(*t, dev, op, n);
  if (seg.defined()) check_on(seg, dev, op, "seg");
  const k::AttnDims d = attn_dims(q, k, v, seg, op);
  same_shape(q, out, op, "q", "out");
  check_dtype(lse, DType::F32, op, "lse");
  RIG_CHECK(lse.numel() == q.dim(0) * q.dim(1) * q.dim(2), "{}: lse {} for q {}", op,
            shape_str(lse.shape()), shape_str(q.shape()));
  for (auto [x, n] : {std::pair{&k, "k"}, {&v, "v"}, {&out, "out"}})
    RIG_CHECK(x->dtype() == q.dtype(), "{}: {} is {} but q is {}", op, n, dtype_name(x->dtype()),
              dtype_name(q.dtype()));
  return d;
}

// Runs the first candidate implementation that takes the call. run(impl, &why) returns false
// when cuDNN declines; a forced implementation that declines is an error.
template <typename Run>
void run_first(const Tensor& q, const Tensor& seg, const k::AttnDims& d, const char* op,
               bool backward, Run run) {
  DeviceGuard g(q.device().index);
  std::string why;
  for (Impl impl : candidates(q, seg, d, op)) {
    if (run(impl, &why)) {
      g_last_impl[backward ? 1 : 0] = impl_name(impl);
      return;
    }
    RIG_CHECK(impl_setting() != impl_name(impl),
              "{}: RIG_ATTENTION={} but it declined the call: {}", op, impl_name(impl), why);
  }
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       Tensor& out, Tensor& lse) {
  const char* op = "attention_forward";
  const k::AttnDims d = check_call(q, k, v, seg, out, lse, op);
  const k::T t = ktype(q, op, "q");
  const int dev = q.device().index;
  const int64_t* segp = seg.defined() ? seg.data<int64_t>() : nullptr;
  run_first(q, seg, d, op, false, [&](Impl impl, std::string* why) {
    if (impl == Impl::Cudnn)
      return seg.defined() ? sdpa_cudnn::forward_packed(q, k, v, seg, out, lse, why)
                           : sdpa_cudnn::forward(q, k, v, out, lse, why);
    if (impl == Impl::Flash) {
      Tensor ws = flash_workspace(k::flash_fwd_workspace(d, segp != nullptr), dev);
      check_status(k::flash_fwd(q.raw(), k.raw(), v.raw(), segp, out.raw(), lse.f32(), d, ws.raw(),
                                stream_for(dev)),
                   op);
    } else {
      check_status(k::attention_fwd(t, q.raw(), k.raw(), v.raw(), segp, out.raw(), lse.f32(), d,
                                    stream_for(dev)),
                   op);
    }
    return true;
  });
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& seg, const Tensor& out, const Tensor& lse, Tensor& dq,
                        Tensor& dk, Tensor& dv) {
  const char* op = "attention_backward";
  const k::AttnDims d = check_call(q, k, v, seg, out, lse, op);
  const int dev = q.device().index;
  for (auto [x, n] : {std::pair{&dout, "dout"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}) {
    check_on(*x, dev, op, n);
    RIG_CHECK(x->dtype() == q.dtype(), "{}: {} is {} but q is {}", op, n, dtype_name(x->dtype()),
              dtype_name(q.dtype()));
  }
  same_shape(q, dout, op, "q", "dout");
  same_shape(q, dq, op, "q", "dq");
  same_shape(k, dk, op, "k", "dk");
  same_shape(k, dv, op, "k", "dv");
  const k::T t = ktype(q, op, "q");
  const int64_t* segp = seg.defined() ? seg.data<int64_t>() : nullptr;
  run_first(q, seg, d, op, true, [&](Impl impl, std::string* why) {
    if (impl == Impl::Cudnn)
      return seg.defined() ? sdpa_cudnn::backward_packed(dout, q, k, v, seg, out, lse, dq, dk, dv,
                                                         g_deterministic, why)
                           : sdpa_cudnn::backward(dout, q, k, v, out, lse, dq, dk, dv,
                                                  g_deterministic, why);
    if (impl == Impl::Flash) {
      Tensor ws = flash_workspace(k::flash_bwd_workspace(d, segp != nullptr), dev);
      check_status(k::flash_bwd(dout.raw(), q.raw(), k.raw(), v.raw(), segp, out.raw(), lse.f32(),
                                dq.raw(), dk.raw(), dv.raw(), d, ws.raw(), stream_for(dev)),
                   op);
    } else {
      Tensor delta = scratch(lse.shape(), DType::F32, dev, "attention_backward delta");
      check_status(k::attention_bwd(t, dout.raw(), q.raw(), k.raw(), v.raw(), segp, out.raw(),
                                    lse.f32(), delta.f32(), dq.raw(), dk.raw(), dv.raw(), d,
                                    stream_for(dev)),
                   op);
    }
    return true;
  });
}

}  // namespace rig::ops::cuda
