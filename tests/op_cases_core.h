// The generic op harness's pieces: a case, its inputs, how they travel, how outputs are compared.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "rig/core/tensor.h"
#include "rig/ops/ops.h"

namespace rig::test {

using Tensors = std::map<std::string, Tensor>;

// How an input is drawn and how it travels to the backend under test.
enum class Kind {
  Data,  // normal(shift, scale), stored in the dtype under test (activations, their gradients)
  F32,   // normal(shift, scale), float32 on every backend (parameters, gradient accumulators)
  Ids,   // int64 uniform in [0, hi)
};
struct In {
  std::string name;
  Shape shape;
  Kind kind = Kind::Data;
  float scale = 1.0f, shift = 0.0f;
  int64_t hi = 0;
};

// Where a case runs: the device, and the dtype of its Data tensors.
struct Ctx {
  Device dev;
  DType dt;
  Tensor data(const Shape& s) const { return Tensor::empty(s, dt, dev); }
  Tensor f32(const Shape& s) const { return Tensor::empty(s, DType::F32, dev); }
};

using OpFn = std::function<Tensors(const Tensors&, const Ctx&)>;

// d loss / d input, where the backward writes it into `output`; an accumulating output starts
// from the input `start`; `scale` is what the op multiplies the gradient by (cross_entropy's).
struct Grad {
  std::string input, output, start;
  double scale = 1.0;
};

struct OpCase {
  std::string op;     // the op-table row under test
  std::string shape;  // what this case varies
  std::vector<In> in;
  // Extra inputs that are not random draws (rope tables, positions, segments, targets); float
  // ones stay F32, integer ones int64.
  std::function<void(Tensors&, std::mt19937&)> make;
  OpFn forward;
  // Reads the inputs, the CPU forward's outputs (in the dtypes the backend's forward wrote) and
  // the upstream gradients (inputs named in `seeds`).
  OpFn backward;
  // The finite-difference loss: sum over {forward output, upstream gradient input} of
  // <output, gradient>; an empty gradient name weighs a scalar output by 1.
  std::vector<std::pair<std::string, std::string>> seeds;
  std::vector<Grad> grads;
  std::vector<DType> dtypes{DType::F32, DType::BF16};  // those the CUDA backend takes
  // Outputs that are float32 reductions of identical inputs on every backend, held to the F32
  // tolerance whatever the dtype under test; `exact` ones must match exactly (copies, counts).
  std::set<std::string> f32_outputs, exact;
  // For an output that is a sum of terms which can cancel, the per-element size of those terms
  // (from the backward's inputs, as doubles): its rounding is relative to them, not to the sum,
  // so the normalised error divides by this instead of by the result.
  std::map<std::string, std::function<std::vector<double>(const Tensors&)>> term_size;
  // An independent float64 implementation of the forward (plain loops over the CPU inputs) that
  // tests/unit/op_reference_test.cpp holds the CPU forward to, for ops without a backward for the
  // finite differences to check.
  std::function<Tensors(const Tensors&)> reference;
};

// Tolerances on the normalised error ||got - want|| / ||want||.
//  F32: both backends compute in float32 and differ only in summation order and fused
//  multiply-adds: ~2^-24 per operation, grown with the reduction length; 1e-5 bounds sums of
//  ~10^4 terms with room to spare.
//  BF16: the inputs are rounded identically for both backends, so only the kernel's own roundings
//  count: every stored bf16 value carries up to 2^-9 relative error (2^-8 ulp, round to nearest),
//  and the kernels round a few intermediates too (attention's P and dS, rmsnorm's x*rstd before
//  the weight, as Hugging Face does); a handful of 2^-8 roundings accumulated is ~1e-2, and 2e-2
//  leaves headroom while a wrong index or a missing term (errors of order 1) still fails.
inline double tolerance(DType dt) {
  return dt == DType::F32 ? 1e-5 : 2e-2;
}
inline const char* dtype_str(DType dt) {
  return dt == DType::F32 ? "F32" : "BF16";
}

inline Tensor scalar(double v) {
  Tensor t = Tensor::empty({1}, DType::F64);
  t.data<double>()[0] = v;
  return t;
}

// A host copy of any tensor as doubles (F64 kept exact).
inline std::vector<double> values(const Tensor& t) {
  Tensor c = t.to(Device::cpu());
  std::vector<double> v(size_t(c.numel()));
  if (c.dtype() == DType::F64) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = c.data<double>()[i];
    return v;
  }
  if (c.dtype() == DType::I64) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = double(c.data<int64_t>()[i]);
    return v;
  }
  const Tensor f = c.to_dtype(DType::F32);
  for (size_t i = 0; i < v.size(); ++i) v[i] = f.f32()[i];
  return v;
}

// The comparison of one output; empty when it passes, else a message naming everything.
struct Compared {
  double err = 0, max_abs = 0, tol = 0;
  int64_t worst = -1;
  double got_at = 0, want_at = 0;
  std::string failure;
};

inline Compared compare(const Tensor& got, const Tensor& want, double tol,
                        const std::vector<double>* terms = nullptr) {
  Compared c;
  c.tol = tol;
  if (got.shape() != want.shape()) {
    c.failure = "shape " + shape_str(got.shape()) + ", expected " + shape_str(want.shape());
    return c;
  }
  const std::vector<double> g = values(got), w = values(want);
  double num = 0, den = 0, got_sq = 0;
  bool finite = true;
  for (size_t i = 0; i < g.size(); ++i) {
    const double d = std::abs(g[i] - w[i]);
    if (!std::isfinite(g[i]) || !std::isfinite(w[i])) finite = finite && g[i] == w[i];
    if (!(d <= c.max_abs) || c.worst < 0) {
      c.max_abs = std::isfinite(d) ? std::max(c.max_abs, d) : INFINITY;
      c.worst = int64_t(i);
      c.got_at = g[i];
      c.want_at = w[i];
    }
    num += d * d;
    den += terms && i < terms->size() ? (*terms)[i] * (*terms)[i] : w[i] * w[i];
    got_sq += g[i] * g[i];
  }
  const double n = double(std::max<size_t>(g.size(), 1));
  if (tol == 0) {
    c.err = c.max_abs;
  } else if (std::sqrt(den / n) < 1e-5) {
    // A result that is zero in exact arithmetic (attention's dq and dk when every query sees one
    // key) is rounding noise on both sides: a relative error means nothing there; the backend's
    // must be noise too, RMS under 1e-3 (inputs are O(1)).
    c.err = std::sqrt(got_sq / n);
    c.tol = 1e-3;
  } else {
    c.err = std::sqrt(num) / std::sqrt(den);
  }
  if (!finite || !(c.err <= c.tol))
    c.failure = fmt::format(
        "{} {:.3g} > tolerance {:.3g}; max |diff| {:.3g} at element {} (got {:.7g}, want {:.7g})",
        tol == 0 ? "max |diff|" : "normalised error", c.err, c.tol, c.max_abs, c.worst, c.got_at,
        c.want_at);
  return c;
}

// ---- inputs ----------------------------------------------------------------------------------

inline Tensor randn(const Shape& s, std::mt19937& g, float scale = 1.0f, float shift = 0.0f) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = shift + scale * n(g);
  return Tensor::from_f32(v, s);
}
inline Tensor ints(const std::vector<int64_t>& v, const Shape& s) {
  Tensor t = Tensor::empty(s, DType::I64);
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}

// The case's inputs on the CPU in float32, each Data one already holding only values that `dt`
// can hold (so both backends see the same numbers and the comparison measures the kernel).
inline Tensors make_inputs(const OpCase& c, DType dt, uint32_t seed) {
  std::mt19937 g(seed);
  Tensors t;
  for (const In& in : c.in) {
    if (in.kind == Kind::Ids) {
      std::uniform_int_distribution<int64_t> u(0, in.hi - 1);
      std::vector<int64_t> v(size_t(shape_numel(in.shape)));
      for (auto& x : v) x = u(g);
      t[in.name] = ints(v, in.shape);
      continue;
    }
    Tensor x = randn(in.shape, g, in.scale, in.shift);
    if (in.kind == Kind::Data && dt != DType::F32) x = x.to_dtype(dt).to_dtype(DType::F32);
    t[in.name] = x;
  }
  if (c.make) c.make(t, g);
  return t;
}

inline bool is_data(const OpCase& c, const std::string& name) {
  for (const In& in : c.in)
    if (in.name == name) return in.kind == Kind::Data;
  return false;
}

// A copy of a CPU tensor for `ctx` in `dt` (float tensors converted, others as they are).
inline Tensor place(const Tensor& t, DType dt, Device dev) {
  if (t.dtype() != DType::F32 || dt == DType::F32) return t.to(dev);
  return t.to_dtype(dt).to(dev);
}
inline Tensors place_inputs(const OpCase& c, const Tensors& cpu, const Ctx& ctx) {
  Tensors t;
  for (const auto& [name, x] : cpu)
    t[name] = place(x, is_data(c, name) ? ctx.dt : DType::F32, ctx.dev);
  return t;
}

}  // namespace rig::test
