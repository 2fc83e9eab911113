// Host wrappers of the CUDA ops: argument checks with messages that name the op and the tensor,
// the device guard, scratch buffers, then one launcher call whose status is checked.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <cmath>
#include <mutex>
#include <vector>

#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/cuda_ops.h"

namespace rig::ops::cuda {

// ---- context ------------------------------------------------------------------------------

cudaStream_t stream_for(int /*device*/) { return cudaStreamLegacy; }

DeviceGuard::DeviceGuard(int device) {
  RIG_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device) RIG_CUDA_CHECK(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
}

k::DeviceError* device_error(int device) {
  static std::mutex mu;
  static auto* recs = new std::vector<k::DeviceError*>();  // never freed: outlives static teardown
  std::lock_guard<std::mutex> g(mu);
  if (size_t(device) >= recs->size()) recs->resize(size_t(device) + 1, nullptr);
  auto& r = (*recs)[size_t(device)];
  if (!r) {
    DeviceGuard dg(device);
    RIG_CUDA_CHECK(cudaMalloc(&r, sizeof(k::DeviceError)));
    RIG_CUDA_CHECK(cudaMemset(r, 0, sizeof(k::DeviceError)));
  }
  return r;
}

void raise_device_errors(int device) {
  k::DeviceError* d = device_error(device);
  k::DeviceError h{};
  RIG_CUDA_CHECK(cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, stream_for(device)));
  RIG_CUDA_CHECK(cudaStreamSynchronize(stream_for(device)));
  if (h.code == k::kNoError) return;
  RIG_CUDA_CHECK(cudaMemsetAsync(d, 0, sizeof(h), stream_for(device)));
  switch (h.code) {
    case k::kBadTokenId:
      bad_input("token id {} at position {} is outside the vocabulary of {}", h.value, h.where,
                h.limit);
    case k::kBadLabel:
      bad_input("label {} at position {} is outside the vocabulary of {}", h.value, h.where,
                h.limit);
    case k::kBadRopePos:
      bad_input("position {} of row {} is outside the rope table ({})", h.value, h.where, h.limit);
    default:
      fail("a CUDA kernel reported bad input (code {}, at {}: {} vs {})", h.code, h.where, h.value,
           h.limit);
  }
}

k::T ktype(const Tensor& t, const char* op, const char* arg) {
  if (t.dtype() == DType::F32) return k::T::F32;
  if (t.dtype() == DType::BF16) return k::T::BF16;
  fail("{}: {} must be F32 or BF16 on CUDA, got {}", op, arg, dtype_name(t.dtype()));
}

void check_on(const Tensor& t, int dev, const char* op, const char* arg) {
  RIG_CHECK(t.defined(), "{}: {} is undefined", op, arg);
  RIG_CHECK(t.device() == Device::cuda(dev), "{}: {} is on {}, expected cuda:{}", op, arg,
            t.device().str(), dev);
}

void check_dtype(const Tensor& t, DType dt, const char* op, const char* arg) {
  RIG_CHECK(t.dtype() == dt, "{}: {} must be {}, got {}", op, arg, dtype_name(dt),
            dtype_name(t.dtype()));
}

void check_status(cudaError_t e, const char* op) {
  if (e != cudaSuccess) fail("{}: CUDA kernel launch failed: {}", op, cudaGetErrorString(e));
}

void same_shape(const Tensor& a, const Tensor& b, const char* op, const char* an, const char* bn) {
  RIG_CHECK(a.shape() == b.shape(), "{}: {} {} and {} {} differ", op, an, shape_str(a.shape()), bn,
            shape_str(b.shape()));
}

Tensor scratch(const Shape& s, DType dt, int dev, const char* what) {
  return Tensor::empty(s, dt, Device::cuda(dev), what);
}

// ---- bias -----------------------------------------------------------------------------------

void add_bias(Tensor& y, const Tensor& bias) {
  const char* op = "add_bias";
  const int dev = y.device().index;
  check_on(bias, dev, op, "bias");
  RIG_CHECK(y.ndim() == 2 && bias.numel() == y.dim(1), "{}: y {} with bias {}", op,
            shape_str(y.shape()), shape_str(bias.shape()));
  DeviceGuard g(dev);
  check_status(k::add_bias(ktype(y, op, "y"), y.raw(), ktype(bias, op, "bias"), bias.raw(), y.dim(0),
                           y.dim(1), stream_for(dev)),
               op);
}

void bias_backward(const Tensor& dy, Tensor& dbias) {
  const char* op = "bias_backward";
  const int dev = dy.device().index;
  check_on(dbias, dev, op, "dbias");
  RIG_CHECK(dy.ndim() == 2 && dbias.numel() == dy.dim(1), "{}: dy {} with dbias {}", op,
            shape_str(dy.shape()), shape_str(dbias.shape()));
  DeviceGuard g(dev);
  Tensor partial = scratch({k::colsum_chunks(dy.dim(0)), dy.dim(1)}, DType::F32, dev,
                           "bias_backward partial sums");
  check_status(k::bias_bwd(ktype(dy, op, "dy"), dy.raw(), ktype(dbias, op, "dbias"), dbias.raw(),
                           partial.f32(), dy.dim(0), dy.dim(1), stream_for(dev)),
               op);
}

// ---- embedding ----------------------------------------------------------------------------

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const char* op = "embedding_forward";
  const int dev = out.device().index;
  check_on(ids, dev, op, "ids");
  check_on(table, dev, op, "table");
  check_dtype(ids, DType::I64, op, "ids");
  RIG_CHECK(table.ndim() == 2 && out.numel() == ids.numel() * table.dim(1),
            "{}: ids {} table {} out {}", op, shape_str(ids.shape()), shape_str(table.shape()),
            shape_str(out.shape()));
  DeviceGuard g(dev);
  check_status(k::embedding_fwd(ids.data<int64_t>(), ids.numel(), ktype(table, op, "table"),
                                table.raw(), table.dim(0), table.dim(1), ktype(out, op, "out"),
                                out.raw(), device_error(dev), stream_for(dev)),
               op);
  // A bad token id is raised by the next op that checks the device (sum_squares, ...), so the
  // step does not stall here; the model checks its batch's ids on the host first.
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const char* op = "embedding_backward";
  const int dev = dout.device().index;
  check_on(ids, dev, op, "ids");
  check_on(dtable, dev, op, "dtable");
  check_dtype(ids, DType::I64, op, "ids");
  RIG_CHECK(dtable.ndim() == 2 && dout.numel() == ids.numel() * dtable.dim(1),
            "{}: ids {} dout {} dtable {}", op, shape_str(ids.shape()), shape_str(dout.shape()),
            shape_str(dtable.shape()));
  RIG_CHECK(ids.numel() < (int64_t(1) << 31), "{}: {} rows (at most 2^31 - 1)", op, ids.numel());
  DeviceGuard g(dev);
  Tensor scratch_t = scratch({int64_t(k::embedding_bwd_scratch_bytes(ids.numel()))}, DType::U8, dev,
                             "embedding_backward sort");
  check_status(k::embedding_bwd(ids.data<int64_t>(), ids.numel(), ktype(dout, op, "dout"),
                                dout.raw(), ktype(dtable, op, "dtable"), dtable.raw(),
                                dtable.dim(0), dtable.dim(1), scratch_t.raw(), stream_for(dev)),
               op);
}

// ---- rmsnorm ------------------------------------------------------------------------------

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd) {
  const char* op = "rmsnorm_forward";
  const int dev = x.device().index;
  check_on(w, dev, op, "w");
  check_on(y, dev, op, "y");
  check_on(rstd, dev, op, "rstd");
  check_dtype(rstd, DType::F32, op, "rstd");
  RIG_CHECK(x.ndim() == 2 && w.numel() == x.dim(1) && rstd.numel() == x.dim(0),
            "{}: x {} w {} rstd {}", op, shape_str(x.shape()), shape_str(w.shape()),
            shape_str(rstd.shape()));
  same_shape(x, y, op, "x", "y");
  DeviceGuard g(dev);
  check_status(k::rmsnorm_fwd(ktype(x, op, "x"), x.raw(), ktype(w, op, "w"), w.raw(), eps,
                              ktype(y, op, "y"), y.raw(), rstd.f32(), x.dim(0), x.dim(1),
                              stream_for(dev)),
               op);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw) {
  const char* op = "rmsnorm_backward";
  const int dev = x.device().index;
  for (auto [t, n] : {std::pair{&dy, "dy"}, {&w, "w"}, {&rstd, "rstd"}, {&dx, "dx"}, {&dw, "dw"}})
    check_on(*t, dev, op, n);
  check_dtype(rstd, DType::F32, op, "rstd");
  RIG_CHECK(x.ndim() == 2 && w.numel() == x.dim(1) && dw.numel() == x.dim(1) &&
                rstd.numel() == x.dim(0),
            "{}: x {} w {} dw {} rstd {}", op, shape_str(x.shape()), shape_str(w.shape()),
            shape_str(dw.shape()), shape_str(rstd.shape()));
  same_shape(x, dy, op, "x", "dy");
  same_shape(x, dx, op, "x", "dx");
  DeviceGuard g(dev);
  Tensor partial = scratch({k::colsum_chunks(x.dim(0)), x.dim(1)}, DType::F32, dev,
                           "rmsnorm_backward partial sums");
  check_status(k::rmsnorm_bwd(ktype(dy, op, "dy"), dy.raw(), ktype(x, op, "x"), x.raw(),
                              ktype(w, op, "w"), w.raw(), rstd.f32(), ktype(dx, op, "dx"), dx.raw(),
                              ktype(dw, op, "dw"), dw.raw(), partial.f32(), x.dim(0), x.dim(1),
                              stream_for(dev)),
               op);
}

void rmsnorm_backward_add(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                          Tensor& dh, Tensor* dh_copy, Tensor* dw) {
  const char* op = "rmsnorm_backward_add";
  const int dev = x.device().index;
  for (auto [t, n] : {std::pair{&dy, "dy"}, {&w, "w"}, {&rstd, "rstd"}, {&dh, "dh"}})
    check_on(*t, dev, op, n);
  check_dtype(rstd, DType::F32, op, "rstd");
  check_dtype(dh, DType::F32, op, "dh");
  RIG_CHECK(x.ndim() == 2 && w.numel() == x.dim(1) && rstd.numel() == x.dim(0),
            "{}: x {} w {} rstd {}", op, shape_str(x.shape()), shape_str(w.shape()),
            shape_str(rstd.shape()));
  same_shape(x, dy, op, "x", "dy");
  same_shape(x, dh, op, "x", "dh");
  if (dh_copy) {
    check_on(*dh_copy, dev, op, "dh_copy");
    same_shape(x, *dh_copy, op, "x", "dh_copy");
    RIG_CHECK(dh_copy->raw() != dh.raw(), "{}: dh_copy must not be dh", op);
  }
  if (dw) {
    check_on(*dw, dev, op, "dw");
    RIG_CHECK(dw->numel() == x.dim(1), "{}: dw {} for x {}", op, shape_str(dw->shape()),
              shape_str(x.shape()));
  }
  DeviceGuard g(dev);
  Tensor partial;
  if (dw)
    partial = scratch({k::colsum_chunks(x.dim(0)), x.dim(1)}, DType::F32, dev,
                      "rmsnorm_backward partial sums");
  check_status(
      k::rmsnorm_bwd_add(ktype(dy, op, "dy"), dy.raw(), ktype(x, op, "x"), x.raw(),
                         ktype(w, op, "w"), w.raw(), rstd.f32(), dh.f32(),
                         dh_copy ? ktype(*dh_copy, op, "dh_copy") : k::T::F32,
                         dh_copy ? dh_copy->raw() : nullptr, dw ? ktype(*dw, op, "dw") : k::T::F32,
                         dw ? dw->raw() : nullptr, dw ? partial.f32() : nullptr, x.dim(0), x.dim(1),
                         stream_for(dev)),
      op);
}

// ---- rope ---------------------------------------------------------------------------------

void rope(Tensor& x, const Tensor& pos, const Tensor& cos, const Tensor& sin, int heads,
          bool backward) {
  const char* op = backward ? "rope_backward" : "rope_forward";
  const int dev = x.device().index;
  check_on(pos, dev, op, "pos");
  check_on(cos, dev, op, "cos");
  check_on(sin, dev, op, "sin");
  check_dtype(pos, DType::I64, op, "pos");
  RIG_CHECK(cos.dtype() == sin.dtype(), "{}: cos and sin tables differ in dtype", op);
  RIG_CHECK(x.ndim() == 2 && heads > 0 && x.dim(1) % heads == 0, "{}: x {} with {} heads", op,
            shape_str(x.shape()), heads);
  const int64_t d = x.dim(1) / heads;
  RIG_CHECK(d % 2 == 0 && cos.ndim() == 2 && cos.dim(1) == d / 2 && sin.shape() == cos.shape(),
            "{}: rope table {} for head_dim {}", op, shape_str(cos.shape()), d);
  RIG_CHECK(pos.numel() == x.dim(0), "{}: pos {} for {} rows", op, shape_str(pos.shape()), x.dim(0));
  DeviceGuard g(dev);
  // Positions are checked on the device; a bad one is reported at the next synchronising op
  // (sum_squares, sum_squares_list) rather than stalling every layer here.
  check_status(k::rope(ktype(x, op, "x"), x.raw(), pos.data<int64_t>(), x.dim(0), heads, d,
                       ktype(cos, op, "cos"), cos.raw(), sin.raw(), cos.dim(0), backward,
                       device_error(dev), stream_for(dev)),
               op);
}

// ---- swiglu -------------------------------------------------------------------------------

void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& a) {
  const char* op = "swiglu_forward";
  const int dev = g.device().index;
  check_on(u, dev, op, "u");
  check_on(a, dev, op, "a");
  same_shape(g, u, op, "g", "u");
  same_shape(g, a, op, "g", "a");
  RIG_CHECK(u.dtype() == g.dtype() && a.dtype() == g.dtype(), "{}: g, u and a must share a dtype",
            op);
  DeviceGuard dg(dev);
  check_status(k::swiglu_fwd(ktype(g, op, "g"), g.raw(), u.raw(), a.raw(), g.numel(),
                             stream_for(dev)),
               op);
}

void swiglu_backward(const Tensor& da, const Tensor& g, const Tensor& u, Tensor& dg, Tensor& du) {
  const char* op = "swiglu_backward";
  const int dev = g.device().index;
  for (auto [t, n] : {std::pair{&da, "da"}, {&u, "u"}, {&dg, "dg"}, {&du, "du"}})
    check_on(*t, dev, op, n);
  for (auto [t, n] : {std::pair{&da, "da"}, {&u, "u"}, {&dg, "dg"}, {&du, "du"}}) {
    same_shape(g, *t, op, "g", n);
    RIG_CHECK(t->dtype() == g.dtype(), "{}: {} is {} but g is {}", op, n, dtype_name(t->dtype()),
              dtype_name(g.dtype()));
  }
  DeviceGuard dgd(dev);
  check_status(k::swiglu_bwd(ktype(g, op, "g"), da.raw(), g.raw(), u.raw(), dg.raw(), du.raw(),
                             g.numel(), stream_for(dev)),
               op);
}

// ---- cross-entropy ------------------------------------------------------------------------

void cross_entropy(const Tensor& logits, const Tensor& targets, float grad_scale, Tensor* dlogits,
                   Tensor& row_loss) {
  const char* op = "cross_entropy";
  const int dev = logits.device().index;
  check_on(targets, dev, op, "targets");
  check_on(row_loss, dev, op, "row_loss");
  check_dtype(targets, DType::I64, op, "targets");
  check_dtype(row_loss, DType::F32, op, "row_loss");
  RIG_CHECK(
      logits.ndim() == 2 && targets.numel() == logits.dim(0) && row_loss.numel() == logits.dim(0),
      "{}: logits {} targets {} row_loss {}", op, shape_str(logits.shape()),
      shape_str(targets.shape()), shape_str(row_loss.shape()));
  const k::T t = ktype(logits, op, "logits");
  if (dlogits) {
    check_on(*dlogits, dev, op, "dlogits");
    same_shape(logits, *dlogits, op, "logits", "dlogits");
    RIG_CHECK(dlogits->raw() != logits.raw() || dlogits->dtype() == logits.dtype(),
              "{}: dlogits in place must keep the logits' dtype", op);
  }
  DeviceGuard g(dev);
  // Nothing is read back: a bad label is raised by the next op that checks (sum_squares, ...).
  check_status(
      k::cross_entropy(t, logits.raw(), targets.data<int64_t>(), logits.dim(0), logits.dim(1),
                       grad_scale, dlogits ? ktype(*dlogits, op, "dlogits") : t,
                       dlogits ? dlogits->raw() : nullptr, row_loss.f32(), device_error(dev),
                       stream_for(dev)),
      op);
}

// A vocabulary slice's logits [rows, Vc], its targets and the running statistics [rows, 3], on
// one device; returns the device.
static int check_slice_operands(const Tensor& logits, const Tensor& targets, const Tensor& stats,
                                const char* op) {
  const int dev = logits.device().index;
  check_on(targets, dev, op, "targets");
  check_on(stats, dev, op, "stats");
  check_dtype(targets, DType::I64, op, "targets");
  check_dtype(stats, DType::F32, op, "stats");
  RIG_CHECK(
      logits.ndim() == 2 && targets.numel() == logits.dim(0) && stats.numel() == 3 * logits.dim(0),
      "{}: logits {} targets {} stats {}", op, shape_str(logits.shape()),
      shape_str(targets.shape()), shape_str(stats.shape()));
  return dev;
}

void cross_entropy_slice(const Tensor& logits, const Tensor& targets, int64_t v0, Tensor& stats) {
  const char* op = "cross_entropy_slice";
  const int dev = check_slice_operands(logits, targets, stats, op);
  DeviceGuard g(dev);
  check_status(
      k::cross_entropy_slice(ktype(logits, op, "logits"), logits.raw(), targets.data<int64_t>(),
                             logits.dim(0), logits.dim(1), v0, stats.f32(), stream_for(dev)),
      op);
}

void cross_entropy_finish(Tensor& stats, const Tensor& targets, int64_t V, Tensor& row_loss) {
  const char* op = "cross_entropy_finish";
  const int dev = stats.device().index;
  check_on(targets, dev, op, "targets");
  check_on(row_loss, dev, op, "row_loss");
  check_dtype(stats, DType::F32, op, "stats");
  check_dtype(targets, DType::I64, op, "targets");
  check_dtype(row_loss, DType::F32, op, "row_loss");
  RIG_CHECK(stats.numel() == 3 * targets.numel() && row_loss.numel() == targets.numel(),
            "{}: stats {} targets {} row_loss {}", op, shape_str(stats.shape()),
            shape_str(targets.shape()), shape_str(row_loss.shape()));
  DeviceGuard g(dev);
  check_status(k::cross_entropy_finish(stats.f32(), targets.data<int64_t>(), targets.numel(), V,
                                       row_loss.f32(), device_error(dev), stream_for(dev)),
               op);
}

void cross_entropy_slice_backward(Tensor& logits, const Tensor& targets, int64_t v0,
                                  const Tensor& stats, float grad_scale) {
  const char* op = "cross_entropy_slice_backward";
  const int dev = check_slice_operands(logits, targets, stats, op);
  DeviceGuard g(dev);
  check_status(k::cross_entropy_slice_backward(
                   ktype(logits, op, "logits"), logits.raw(), targets.data<int64_t>(),
                   logits.dim(0), logits.dim(1), v0, stats.f32(), grad_scale, stream_for(dev)),
               op);
}

// ---- element-wise -------------------------------------------------------------------------

void add_(Tensor& a, const Tensor& b, float alpha) {
  const char* op = "add_";
  const int dev = a.device().index;
  check_on(b, dev, op, "b");
  RIG_CHECK(b.numel() == a.numel(), "add_: {} vs {}", shape_str(a.shape()), shape_str(b.shape()));
  DeviceGuard g(dev);
  check_status(k::add(ktype(a, op, "a"), a.raw(), ktype(b, op, "b"), b.raw(), alpha, a.numel(),
                      stream_for(dev)),
               op);
}

void scale_(Tensor& a, float s) {
  const char* op = "scale_";
  const int dev = a.device().index;
  DeviceGuard g(dev);
  check_status(k::scale(ktype(a, op, "a"), a.raw(), s, a.numel(), stream_for(dev)), op);
}

double sum_squares(const Tensor& a) {
  const char* op = "sum_squares";
  const int dev = a.device().index;
  const k::T t = ktype(a, op, "a");
  DeviceGuard g(dev);
  const int blocks = int(std::clamp<int64_t>((a.numel() + 255) / 256, 1, 1024));
  Tensor partial = scratch({blocks + 1}, DType::F64, dev, "sum_squares partial sums");
  double* p = partial.data<double>();
  check_status(k::sum_squares_partial(t, a.raw(), a.numel(), p, blocks, stream_for(dev)), op);
  check_status(k::sum_doubles(p, blocks, p + blocks, stream_for(dev)), op);
  double h = 0;
  RIG_CUDA_CHECK(cudaMemcpyAsync(&h, p + blocks, sizeof(h), cudaMemcpyDeviceToHost, stream_for(dev)));
  RIG_CUDA_CHECK(cudaStreamSynchronize(stream_for(dev)));
  raise_device_errors(dev);
  return h;
}

std::vector<double> sum_squares_list(const std::vector<Tensor>& ts) {
  const char* op = "sum_squares_list";
  if (ts.empty()) return {};
  const int dev = ts.front().device().index;
  const int64_t n = int64_t(ts.size());
  std::vector<int> blocks(ts.size());
  int64_t total = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    check_on(ts[i], dev, op, "tensor");
    blocks[i] = int(std::clamp<int64_t>((ts[i].numel() + 255) / 256, 1, 1024));
    total += blocks[i];
  }
  DeviceGuard g(dev);
  // Partials of every tensor, then the n sums at the end: one copy back, one synchronisation.
  Tensor scratch_t = scratch({total + n}, DType::F64, dev, "sum_squares_list partial sums");
  double* p = scratch_t.data<double>();
  double* sums = p + total;
  std::vector<k::SumSqSlot> slots(ts.size());
  for (size_t i = 0; i < ts.size(); ++i)
    slots[i] = {ts[i].raw(), ts[i].numel(), ktype(ts[i], op, "tensor"), blocks[i]};
  int64_t at = 0;
  for (size_t i = 0; i < ts.size(); i += k::kSumSqSlotsPerLaunch) {
    const int count = int(std::min<size_t>(k::kSumSqSlotsPerLaunch, ts.size() - i));
    check_status(k::sum_squares_multi(slots.data() + i, count, p + at, sums + i, stream_for(dev)),
                 op);
    for (int j = 0; j < count; ++j) at += blocks[i + size_t(j)];
  }
  std::vector<double> out(ts.size());
  RIG_CUDA_CHECK(cudaMemcpyAsync(out.data(), sums, sizeof(double) * ts.size(),
                                 cudaMemcpyDeviceToHost, stream_for(dev)));
  RIG_CUDA_CHECK(cudaStreamSynchronize(stream_for(dev)));
  raise_device_errors(dev);
  return out;
}

void cast(const Tensor& src, Tensor& dst) {
  const char* op = "cast";
  const int dev = dst.device().index;
  check_on(src, dev, op, "src");
  RIG_CHECK(src.numel() == dst.numel(), "cast: {} into {}", shape_str(src.shape()), shape_str(dst.shape()));
  DeviceGuard g(dev);
  check_status(k::cast(ktype(src, op, "src"), src.raw(), ktype(dst, op, "dst"), dst.raw(), src.numel(),
                       stream_for(dev)),
               op);
}

void dropout(const Tensor& x, float p, uint64_t seed, Tensor& out) {
  const char* op = "dropout";
  const int dev = x.device().index;
  check_on(out, dev, op, "out");
  RIG_CHECK(out.numel() == x.numel(), "dropout: x {} out {}", shape_str(x.shape()),
            shape_str(out.shape()));
  RIG_CHECK(p >= 0.0f && p < 1.0f, "dropout: p = {} outside [0, 1)", p);
  DeviceGuard g(dev);
  check_status(k::dropout(ktype(x, op, "x"), x.raw(), ktype(out, op, "out"), out.raw(), p, seed,
                          x.numel(), stream_for(dev)),
               op);
}

// ---- AdamW --------------------------------------------------------------------------------

namespace {
// Bias-corrected step size and sqrt of the second-moment correction, exactly as the CPU oracle
// computes them.
struct AdamWScalars {
  float step_size, bc2_sqrt;
};
AdamWScalars adamw_scalars(const AdamWParams& h, const char* op) {
  RIG_CHECK(h.step >= 1, "{}: step {} (counts from 1)", op, h.step);
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(h.step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(h.step));
  return {float(double(h.lr) / bc1), float(std::sqrt(bc2))};
}
// grad, m and v on the parameter's device with its element count; m and v float32.
void check_adamw_operands(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                          int dev, const char* op) {
  for (auto [t, n] : {std::pair{&grad, "grad"}, {&m, "m"}, {&v, "v"}}) {
    check_on(*t, dev, op, n);
    RIG_CHECK(t->numel() == param.numel(), "{}: {} {} for param {}", op, n, shape_str(t->shape()),
              shape_str(param.shape()));
  }
  check_dtype(m, DType::F32, op, "m");
  check_dtype(v, DType::F32, op, "v");
}
}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& h) {
  const char* op = "adamw_step";
  const int dev = param.device().index;
  check_adamw_operands(param, grad, m, v, dev, op);
  const AdamWScalars a = adamw_scalars(h, op);
  const float decay = 1.0f - h.lr * h.weight_decay;
  DeviceGuard g(dev);
  check_status(k::adamw(ktype(param, op, "param"), param.raw(), ktype(grad, op, "grad"), grad.raw(),
                        m.f32(), v.f32(), param.numel(), decay, 1.0f - h.beta1, h.beta2,
                        1.0f - h.beta2, a.bc2_sqrt, h.eps, a.step_size, stream_for(dev)),
               op);
}

void adamw_step_list(std::vector<AdamWSlot>& slots, const AdamWParams& h, float grad_scale) {
  const char* op = "adamw_step_list";
  const int dev = slots.front().param.device().index;
  const AdamWScalars a = adamw_scalars(h, op);
  std::vector<k::AdamWSlot> ks;
  ks.reserve(slots.size());
  for (auto& s : slots) {
    check_on(s.param, dev, op, "param");
    check_adamw_operands(s.param, s.grad, s.m, s.v, dev, op);
    if (s.copy.defined()) {
      check_on(s.copy, dev, op, "copy");
      check_dtype(s.copy, DType::BF16, op, "copy");
      RIG_CHECK(s.copy.numel() == s.param.numel(), "{}: copy {} for param {}", op,
                shape_str(s.copy.shape()), shape_str(s.param.shape()));
    }
    ks.push_back(k::AdamWSlot{s.param.raw(), s.grad.raw(), s.m.f32(), s.v.f32(),
                              s.copy.defined() ? s.copy.raw() : nullptr, s.param.numel(),
                              1.0f - h.lr * s.weight_decay, ktype(s.param, op, "param"),
                              ktype(s.grad, op, "grad")});
  }
  DeviceGuard g(dev);
  for (size_t at = 0; at < ks.size(); at += k::kAdamWSlotsPerLaunch) {
    const int count = int(std::min<size_t>(k::kAdamWSlotsPerLaunch, ks.size() - at));
    check_status(k::adamw_list(ks.data() + at, count, grad_scale, 1.0f - h.beta1, h.beta2,
                               1.0f - h.beta2, a.bc2_sqrt, h.eps, a.step_size, stream_for(dev)),
                 op);
  }
}

// ---- guard ------------------------------------------------------------------------------------

namespace {
// One zeroed device counter for a list op, read back once after every kernel was queued.
template <typename Launch>
uint64_t accumulate_on_device(const std::vector<Tensor>& ts, const char* op, Launch launch) {
  const int dev = ts.front().device().index;
  DeviceGuard g(dev);
  Tensor acc = scratch({1}, DType::I64, dev, "guard counter");
  auto* p = static_cast<unsigned long long*>(acc.raw());
  RIG_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(*p), stream_for(dev)));
  for (size_t i = 0; i < ts.size(); ++i) check_status(launch(i, ts[i], p, stream_for(dev)), op);
  unsigned long long h = 0;
  RIG_CUDA_CHECK(cudaMemcpyAsync(&h, p, sizeof(h), cudaMemcpyDeviceToHost, stream_for(dev)));
  RIG_CUDA_CHECK(cudaStreamSynchronize(stream_for(dev)));
  return uint64_t(h);
}
}  // namespace

int64_t count_bad_values(const std::vector<Tensor>& ts, double max_abs) {
  const char* op = "count_bad_values";
  for (const Tensor& t : ts)
    RIG_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16 || t.dtype() == DType::I64 ||
                  t.dtype() == DType::I32 || t.dtype() == DType::U8,
              "{}: {} tensors are not supported on CUDA", op, dtype_name(t.dtype()));
  // Above FLT_MAX every finite float passes, as it should.
  const float limit = max_abs > 0 ? float(std::min(max_abs, 3.0e38)) : 0.0f;
  return int64_t(accumulate_on_device(
      ts, op, [&](size_t, const Tensor& t, unsigned long long* c, cudaStream_t s) {
        // Integers and bytes (4-bit codes, sharded units of bytes) hold no floats to judge.
        if (t.dtype() != DType::F32 && t.dtype() != DType::BF16) return cudaSuccess;
        return k::count_bad(ktype(t, op, "tensor"), t.raw(), t.numel(), limit, c, s);
      }));
}

uint64_t hash64(const std::vector<Tensor>& ts) {
  return accumulate_on_device(
      ts, "hash64", [](size_t i, const Tensor& t, unsigned long long* sum, cudaStream_t s) {
        return k::hash_bytes(t.raw(), int64_t(t.nbytes()), uint64_t(i), sum, s);
      });
}

}  // namespace rig::ops::cuda
