// The generic op harness (after ggml's test-backend-ops): one table of cases, each an op of
// src/rig/ops/op_table.inc at one shape, with its forward and (where the op has one) backward.
// tests/gpu/op_backend_test.cpp runs every case on every backend and dtype against the CPU
// float32 oracle; tests/unit/op_gradient_test.cpp checks the CPU backward of the small cases
// against central finite differences of the CPU forward. Adding an op = one case per shape.
//
// Not cases here, because the comparison they need is not "same values within a tolerance":
// cast (bitwise), dropout (the CUDA mask differs from the CPU one by design), adamw_step and the
// list ops (multi-step state, the update compared rather than the parameter; sum_squares_list,
// count_bad_values, hash64) and the forced attention implementations: their own tests in
// tests/gpu/op_harness_test.cpp and tests/unit.
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

// ---- cases -----------------------------------------------------------------------------------

inline Tensor rope_table(int64_t positions, int64_t half, bool is_sin) {
  std::vector<float> v(size_t(positions * half));
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double inv = std::pow(10000.0, -2.0 * double(i) / double(2 * half));
      v[size_t(p * half + i)] =
          float(is_sin ? std::sin(double(p) * inv) : std::cos(double(p) * inv));
    }
  return Tensor::from_f32(v, {positions, half});
}

// Documents of uneven lengths per batch row (some of length 1).
inline Tensor segments(int64_t B, int64_t T) {
  std::vector<int64_t> v(size_t(B * T));
  const int64_t lens[] = {17, 1, 40, 3, 64, 29};
  for (int64_t b = 0; b < B; ++b) {
    int64_t s = 0, left = lens[b % 6];
    for (int64_t t = 0; t < T; ++t) {
      if (left-- == 0) {
        ++s;
        left = lens[size_t((b + s) % 6)] - 1;
      }
      v[size_t(b * T + t)] = s;
    }
  }
  return ints(v, {B, T});
}

inline void add_gemm_cases(std::vector<OpCase>& cs) {
  struct G {
    int64_t m, n, k;
    bool ta, tb;
    float alpha, beta;
  };
  const G shapes[] = {
      {111, 989, 80, false, false, 1.0f, 0.0f}, {111, 989, 80, false, true, 0.5f, 0.0f},
      {989, 111, 64, true, false, 1.0f, 1.0f},  {80, 111, 989, true, true, -2.0f, 1.0f},
      {1, 1000, 111, false, true, 1.0f, 0.0f},  {111, 80, 1, false, false, 1.0f, 0.5f},
      {1, 1, 1, false, false, 1.0f, 0.0f},      {7, 9, 5, true, true, 1.0f, 1.0f},
      {17, 33, 65, false, true, 1.0f, 0.0f},
  };
  for (const G& s : shapes)
    for (bool c_f32 : {false, true}) {  // C in the dtype under test, or float32 from bf16 A/B
      OpCase c;
      c.op = "gemm";
      c.shape = fmt::format("m={} n={} k={} ta={} tb={} alpha={} beta={}{}", s.m, s.n, s.k, s.ta,
                            s.tb, s.alpha, s.beta, c_f32 ? " C=F32" : "");
      c.in = {{"a", {s.ta ? s.k : s.m, s.ta ? s.m : s.k}},
              {"b", {s.tb ? s.n : s.k, s.tb ? s.k : s.n}},
              {"c0", {s.m, s.n}, c_f32 ? Kind::F32 : Kind::Data}};
      if (c_f32) c.dtypes = {DType::BF16};
      c.forward = [s](const Tensors& t, const Ctx&) {
        Tensor out = t.at("c0").clone();
        ops::gemm(t.at("a"), s.ta, t.at("b"), s.tb, out, s.alpha, s.beta);
        return Tensors{{"c", out}};
      };
      cs.push_back(c);
    }
  // out = alpha A B^T + beta src, into a new tensor and in place (the residual add).
  for (auto [m, n, k] :
       {std::tuple<int64_t, int64_t, int64_t>{989, 111, 80}, {1, 1, 1}, {7, 33, 9}})
    for (int variant = 0; variant < 4; ++variant) {
      const bool in_place = variant % 2 == 1, src_f32 = variant >= 2;  // src: float32 residual
      OpCase c;
      c.op = "gemm_plus";
      c.shape = fmt::format("m={} n={} k={}{}{}", m, n, k, in_place ? " in place" : "",
                            src_f32 ? " src=F32" : "");
      c.in = {
          {"a", {m, k}}, {"b", {n, k}}, {"src", {m, n}, src_f32 ? Kind::F32 : Kind::Data, 4.0f}};
      if (src_f32) c.dtypes = {DType::BF16};
      c.forward = [in_place](const Tensors& t, const Ctx&) {
        Tensor src = t.at("src").clone();
        Tensor out = in_place ? src : Tensor::empty(src.shape(), src.dtype(), src.device());
        ops::gemm_plus(t.at("a"), false, t.at("b"), true, src, out, 0.5f, 1.0f);
        Tensors r{{"out", out}};
        if (!in_place) r["src"] = src;  // untouched
        return r;
      };
      c.exact = {"src"};
      cs.push_back(c);
    }
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{989, 80, 111},
                         {111, 1000, 64},
                         {1, 64, 80},
                         {7, 5, 3}}) {
    OpCase c;
    c.op = "gemm_bias";
    c.shape = fmt::format("m={} n={} k={}", m, n, k);
    c.in = {{"x", {m, k}}, {"w", {n, k}}, {"bias", {n}}};
    c.forward = [](const Tensors& t, const Ctx& x) {
      Tensor y = x.data({t.at("x").dim(0), t.at("w").dim(0)});
      ops::gemm_bias(t.at("x"), false, t.at("w"), true, y, t.at("bias"));
      return Tensors{{"y", y}};
    };
    cs.push_back(c);
  }
}

inline void add_elementwise_cases(std::vector<OpCase>& cs) {
  for (auto [rows, n] :
       {std::pair<int64_t, int64_t>{111, 1000}, {989, 1000}, {1, 1}, {7, 9}, {3, 1}}) {
    OpCase c;
    c.op = "add_bias";
    c.shape = fmt::format("rows={} n={}", rows, n);
    c.in = {{"x", {rows, n}}, {"bias", {n}, Kind::F32}, {"dy", {rows, n}}, {"db0", {n}, Kind::F32}};
    c.forward = [](const Tensors& t, const Ctx&) {
      Tensor y = t.at("x").clone();
      ops::add_bias(y, t.at("bias"));
      return Tensors{{"y", y}};
    };
    c.backward = [](const Tensors& t, const Ctx&) {
      Tensor db = t.at("db0").clone();
      ops::bias_backward(t.at("dy"), db);
      return Tensors{{"db", db}};
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"bias", "db", "db0"}};  // dx is dy itself: no op computes it
    c.f32_outputs = {"db"};             // a float32 accumulator: only the summation order differs
    cs.push_back(c);
  }
  for (auto [vocab, h, rows] :
       {std::tuple<int64_t, int64_t, int64_t>{50, 80, 989}, {1, 1, 1}, {7, 9, 13}, {3, 4, 2}}) {
    OpCase c;
    c.op = "embedding";
    c.shape = fmt::format("vocab={} h={} rows={}", vocab, h, rows);  // few ids: rows share one
    c.in = {{"ids", {rows}, Kind::Ids, 1, 0, vocab},
            {"table", {vocab, h}},
            {"dout", {rows, h}},
            {"dtable0", {vocab, h}, Kind::F32}};
    c.forward = [](const Tensors& t, const Ctx& x) {
      Tensor out = x.data({t.at("ids").dim(0), t.at("table").dim(1)});
      ops::embedding_forward(t.at("ids"), t.at("table"), out);
      return Tensors{{"out", out}};
    };
    c.backward = [](const Tensors& t, const Ctx&) {
      Tensor dtable = t.at("dtable0").clone();
      ops::embedding_backward(t.at("ids"), t.at("dout"), dtable);
      return Tensors{{"dtable", dtable}};
    };
    c.seeds = {{"out", "dout"}};
    c.grads = {{"table", "dtable", "dtable0"}};
    c.exact = {"out"};  // a copy
    c.f32_outputs = {"dtable"};
    cs.push_back(c);
  }
  // 989x111 is odd (the element-at-a-time kernel), 989x112 a multiple of 8 (the 16-byte one).
  for (auto [rows, n] :
       {std::pair<int64_t, int64_t>{989, 111}, {989, 112}, {1, 1}, {3, 5}, {1, 8}, {7, 9}}) {
    OpCase c;
    c.op = "swiglu";
    c.shape = fmt::format("rows={} n={}", rows, n);
    c.in = {{"g", {rows, n}, Kind::Data, 3.0f}, {"u", {rows, n}}, {"da", {rows, n}}};
    c.forward = [](const Tensors& t, const Ctx& x) {
      Tensor a = x.data(t.at("g").shape());
      ops::swiglu_forward(t.at("g"), t.at("u"), a);
      return Tensors{{"a", a}};
    };
    c.backward = [](const Tensors& t, const Ctx& x) {
      Tensor dg = x.data(t.at("g").shape()), du = x.data(t.at("g").shape());
      ops::swiglu_backward(t.at("da"), t.at("g"), t.at("u"), dg, du);
      return Tensors{{"dg", dg}, {"du", du}};
    };
    c.seeds = {{"a", "da"}};
    c.grads = {{"g", "dg", ""}, {"u", "du", ""}};
    cs.push_back(c);
  }
  for (const Shape& s : {Shape{989, 111}, Shape{1}, Shape{7, 9}, Shape{1000003}}) {
    OpCase add;
    add.op = "add_";
    add.shape = shape_str(s);
    add.in = {{"a", s}, {"b", s}};
    add.forward = [](const Tensors& t, const Ctx&) {
      Tensor a = t.at("a").clone();
      ops::add_(a, t.at("b"), -0.75f);
      return Tensors{{"a", a}};
    };
    cs.push_back(add);
    for (int mixed = 0; mixed < 2; ++mixed) {  // one of the two float32, the other bf16
      OpCase m = add;
      m.shape += mixed ? " a=F32" : " b=F32";
      m.in[size_t(1 - mixed)].kind = Kind::F32;
      m.dtypes = {DType::BF16};
      cs.push_back(m);
    }
    OpCase scale;
    scale.op = "scale_";
    scale.shape = shape_str(s);
    scale.in = {{"a", s}};
    scale.forward = [](const Tensors& t, const Ctx&) {
      Tensor a = t.at("a").clone();
      ops::scale_(a, 0.3f);
      return Tensors{{"a", a}};
    };
    cs.push_back(scale);
    OpCase ss;
    ss.op = "sum_squares";
    ss.shape = shape_str(s);
    ss.in = {{"a", s}};
    ss.forward = [](const Tensors& t, const Ctx&) {
      return Tensors{{"sum", scalar(ops::sum_squares(t.at("a")))}};
    };
    ss.f32_outputs = {"sum"};
    cs.push_back(ss);
  }
}

inline void add_norm_rope_cases(std::vector<OpCase>& cs) {
  for (auto [rows, h] :
       {std::pair<int64_t, int64_t>{111, 80}, {989, 576}, {7, 4099}, {1, 1}, {3, 7}, {2, 8}}) {
    for (int variant = 0; variant < 3; ++variant) {  // backward; _add with dw; _add without
      OpCase c;
      c.op = variant == 0 ? "rmsnorm" : "rmsnorm_backward_add";
      c.shape = fmt::format("rows={} h={}{}", rows, h, variant == 2 ? " without dw" : "");
      c.in = {{"x", {rows, h}, Kind::Data, 2.0f, 0.3f},
              {"w", {h}, Kind::F32, 0.2f, 1.0f},
              {"dy", {rows, h}},
              {"dw0", {h}, Kind::F32},
              {"dh0", {rows, h}, Kind::F32, 3.0f}};
      c.forward = [](const Tensors& t, const Ctx& x) {
        const Tensor& in = t.at("x");
        Tensor y = x.data(in.shape()), rstd = x.f32({in.dim(0)});
        ops::rmsnorm_forward(in, t.at("w"), 1e-5f, y, rstd);
        return Tensors{{"y", y}, {"rstd", rstd}};
      };
      if (variant == 0) {
        c.backward = [](const Tensors& t, const Ctx& x) {
          Tensor dx = x.data(t.at("x").shape()), dw = t.at("dw0").clone();
          ops::rmsnorm_backward(t.at("dy"), t.at("x"), t.at("w"), t.at("rstd"), dx, dw);
          return Tensors{{"dx", dx}, {"dw", dw}};
        };
        c.grads = {{"x", "dx", ""}, {"w", "dw", "dw0"}};
      } else {
        const bool with_dw = variant == 1;
        c.backward = [with_dw](const Tensors& t, const Ctx& x) {
          Tensor dh = t.at("dh0").clone(), dw = t.at("dw0").clone(), copy = x.data(dh.shape());
          ops::rmsnorm_backward_add(t.at("dy"), t.at("x"), t.at("w"), t.at("rstd"), dh, &copy,
                                    with_dw ? &dw : nullptr);
          return Tensors{{"dh", dh}, {"dh_copy", copy}, {"dw", dw}};
        };
        c.grads = {{"x", "dh", "dh0"}};
        if (with_dw) c.grads.push_back({"w", "dw", "dw0"});
      }
      c.seeds = {{"y", "dy"}};
      c.f32_outputs = {"rstd", "dw", "dh"};
      // dx = rstd * (dy*w - x*c), c = mean(dy*w*x) * rstd^2: at h = 1 the two terms cancel to
      // eps / (x^2 + eps) of either, so float32 rounding of the terms (2^-24 of rstd*|dy*w|)
      // can exceed 1e-5 of the result; dh adds dh0 to it.
      c.term_size[variant == 0 ? "dx" : "dh"] = [variant](const Tensors& t) {
        const std::vector<double> x = values(t.at("x")), w = values(t.at("w")),
                                  dy = values(t.at("dy")), rs = values(t.at("rstd")),
                                  dh0 = variant == 0 ? std::vector<double>(x.size(), 0.0)
                                                     : values(t.at("dh0"));
        const size_t h = w.size();
        std::vector<double> m(x.size());
        for (size_t r = 0; r < rs.size(); ++r) {
          double dot = 0;
          for (size_t j = 0; j < h; ++j) dot += dy[r * h + j] * w[j] * x[r * h + j];
          const double cr = dot / double(h) * rs[r] * rs[r];
          for (size_t j = 0; j < h; ++j) {
            const size_t i = r * h + j;
            m[i] = std::abs(dh0[i]) + rs[r] * (std::abs(dy[i] * w[j]) + std::abs(x[i] * cr));
          }
        }
        return m;
      };
      cs.push_back(c);
    }
  }
  // head_dim 36 and 6 (pairs not a multiple of 8) take the scalar kernel, the others the vector
  // one.
  for (auto [heads, d, rows] : {std::tuple<int, int64_t, int64_t>{5, 80, 111},
                                {6, 64, 111},
                                {1, 128, 111},
                                {3, 36, 111},
                                {1, 2, 1},
                                {3, 6, 7}}) {
    OpCase c;
    c.op = "rope";
    c.shape = fmt::format("heads={} head_dim={} rows={}", heads, d, rows);
    c.in = {{"x", {rows, heads * d}}, {"dy", {rows, heads * d}}};
    const int64_t positions = 300;
    c.make = [=](Tensors& t, std::mt19937&) {
      t["cos"] = rope_table(positions, d / 2, false);
      t["sin"] = rope_table(positions, d / 2, true);
      std::vector<int64_t> pv(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r)
        pv[size_t(r)] = (r * 37 + 5) % positions;  // packed, shuffled
      t["pos"] = ints(pv, {rows});
    };
    c.forward = [heads](const Tensors& t, const Ctx&) {
      Tensor y = t.at("x").clone();
      ops::rope_forward(y, t.at("pos"), t.at("cos"), t.at("sin"), heads);
      return Tensors{{"y", y}};
    };
    c.backward = [heads](const Tensors& t, const Ctx&) {
      Tensor dx = t.at("dy").clone();
      ops::rope_backward(dx, t.at("pos"), t.at("cos"), t.at("sin"), heads);
      return Tensors{{"dx", dx}};
    };
    c.seeds = {{"y", "dy"}};
    c.grads = {{"x", "dx", ""}};
    cs.push_back(c);
  }
}

inline void add_attention_cases(std::vector<OpCase>& cs) {
  struct A {
    int64_t B, T, Hq, Hk, D;
    bool packed;
  };
  // Head dims 32..256, GQA groups 1..8, lengths around the tensor-core tiles (1, 63, 64, 65,
  // 127), packed documents of length 1 to 64; and small ones for the finite differences.
  const A shapes[] = {
      {2, 111, 6, 2, 64, true},  {1, 111, 5, 1, 80, false}, {1, 300, 4, 4, 128, true},
      {3, 33, 2, 1, 32, false},  {1, 70, 3, 3, 96, true},   {1, 40, 2, 2, 256, false},
      {2, 63, 4, 4, 64, false},  {1, 64, 8, 1, 128, false}, {3, 65, 8, 2, 64, false},
      {2, 127, 4, 1, 128, true}, {2, 1, 4, 2, 64, false},   {1, 5, 2, 1, 4, false},
      {2, 6, 2, 2, 3, true},     {1, 1, 1, 1, 1, false},
  };
  for (const A& s : shapes) {
    OpCase c;
    c.op = "attention";
    c.shape = fmt::format("B={} T={} Hq={} Hk={} D={}{}", s.B, s.T, s.Hq, s.Hk, s.D,
                          s.packed ? " packed" : "");
    c.in = {{"q", {s.B, s.T, s.Hq, s.D}},
            {"k", {s.B, s.T, s.Hk, s.D}},
            {"v", {s.B, s.T, s.Hk, s.D}},
            {"dout", {s.B, s.T, s.Hq, s.D}}};
    if (s.packed) c.make = [s](Tensors& t, std::mt19937&) { t["seg"] = segments(s.B, s.T); };
    c.forward = [](const Tensors& t, const Ctx& x) {
      const Tensor& q = t.at("q");
      const Tensor seg = t.count("seg") ? t.at("seg") : Tensor();
      Tensor out = x.data(q.shape()), lse = x.f32({q.dim(0), q.dim(2), q.dim(1)});
      ops::attention_forward(q, t.at("k"), t.at("v"), seg, out, lse);
      return Tensors{{"out", out}, {"lse", lse}};
    };
    c.backward = [](const Tensors& t, const Ctx& x) {
      const Tensor seg = t.count("seg") ? t.at("seg") : Tensor();
      Tensor dq = x.data(t.at("q").shape()), dk = x.data(t.at("k").shape()),
             dv = x.data(t.at("v").shape());
      ops::attention_backward(t.at("dout"), t.at("q"), t.at("k"), t.at("v"), seg, t.at("out"),
                              t.at("lse"), dq, dk, dv);
      return Tensors{{"dq", dq}, {"dk", dk}, {"dv", dv}};
    };
    c.seeds = {{"out", "dout"}};
    c.grads = {{"q", "dq", ""}, {"k", "dk", ""}, {"v", "dv", ""}};
    c.f32_outputs = {"lse"};
    cs.push_back(c);
  }
}

// Causal attention of n new rows at positions past..past+n-1 against a cache, in float64.
inline Tensors attention_decode_reference(const Tensors& t) {
  const Tensor &q = t.at("q"), &k = t.at("k_cache"), &v = t.at("v_cache");
  const int64_t n = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hk = k.dim(1);
  const int64_t past = int64_t(values(t.at("past"))[0]);
  const std::vector<double> qv = values(q), kv = values(k), vv = values(v);
  std::vector<float> out(size_t(q.numel()));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hk), len = past + r + 1;
      std::vector<double> s(static_cast<size_t>(len));
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < len; ++j) {
        for (int64_t x = 0; x < D; ++x)
          s[size_t(j)] += qv[size_t((r * Hq + h) * D + x)] * kv[size_t((j * Hk + hk) * D + x)];
        s[size_t(j)] /= std::sqrt(double(D));
        mx = std::max(mx, s[size_t(j)]);
      }
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int64_t x = 0; x < D; ++x) {
        double o = 0;
        for (int64_t j = 0; j < len; ++j) o += s[size_t(j)] * vv[size_t((j * Hk + hk) * D + x)];
        out[size_t((r * Hq + h) * D + x)] = float(o / sum);
      }
    }
  return Tensors{{"out", Tensor::from_f32(out, q.shape())}};
}

inline void add_attention_decode_cases(std::vector<OpCase>& cs) {
  struct A {
    int64_t n, past, Hq, Hk, D, max_len;
  };
  // The first token (past 0, n 1), single decode steps, prefill of a whole prompt (past 0,
  // n > 1) and a chunk after earlier tokens; GQA groups 1, 2, 4 and 8; head dims 64, 128 and
  // others; caches longer than what is used (NaN there must not matter) and one exactly full.
  const A shapes[] = {
      {1, 0, 4, 4, 64, 8},       {1, 37, 8, 2, 128, 64},    {7, 0, 4, 1, 64, 16},
      {5, 20, 6, 6, 128, 40},    {1, 300, 32, 8, 128, 301}, {111, 989, 8, 2, 80, 1200},
      {3, 2, 2, 1, 4, 9},        {2, 300, 4, 2, 256, 302},  {33, 0, 8, 1, 96, 33},
      {1, 1000, 4, 1, 64, 1500},
  };
  for (const A& s : shapes) {
    OpCase c;
    c.op = "attention_decode";
    c.shape = fmt::format("n={} past={} Hq={} Hk={} D={} max_len={}", s.n, s.past, s.Hq, s.Hk, s.D,
                          s.max_len);
    c.in = {{"q", {s.n, s.Hq, s.D}},
            {"k_cache", {s.max_len, s.Hk, s.D}},
            {"v_cache", {s.max_len, s.Hk, s.D}}};
    c.make = [s](Tensors& t, std::mt19937&) {
      t["past"] = ints({s.past}, {1});
      // Rows past the used length hold whatever an earlier, longer sequence left there.
      for (const char* name : {"k_cache", "v_cache"}) {
        Tensor& x = t.at(name);
        const int64_t used = (s.past + s.n) * s.Hk * s.D;
        std::fill(x.f32() + used, x.f32() + x.numel(), NAN);
      }
    };
    c.forward = [](const Tensors& t, const Ctx& x) {
      const Tensor& q = t.at("q");
      Tensor out = x.data(q.shape());
      ops::attention_decode(q, t.at("k_cache"), t.at("v_cache"), int64_t(values(t.at("past"))[0]),
                            out);
      return Tensors{{"out", out}};
    };
    c.reference = attention_decode_reference;
    cs.push_back(c);
  }
}

inline void add_loss_cases(std::vector<OpCase>& cs) {
  for (auto [rows, V] :
       {std::pair<int64_t, int64_t>{111, 1000}, {111, 32003}, {1, 1}, {5, 7}, {3, 33}}) {
    OpCase c;
    c.op = "cross_entropy";
    c.shape = fmt::format("rows={} V={}", rows, V);
    // Scaled logits: a peaked softmax, as trained models have.
    c.in = {{"logits", {rows, V}, Kind::Data, 3.0f}};
    c.make = [rows, V](Tensors& t, std::mt19937& g) {
      std::vector<int64_t> tv(static_cast<size_t>(rows));
      std::uniform_int_distribution<int64_t> u(0, V - 1);
      for (int64_t r = 0; r < rows; ++r) tv[size_t(r)] = r % 7 == 3 ? -100 : u(g);  // ignored rows
      tv[0] = V - 1;  // the last class
      t["targets"] = ints(tv, {rows});
    };
    // The small cases check the gradient at scale 1 against finite differences of the loss.
    const float grad_scale = rows * V > 1000 ? 1.0f / 95.0f : 1.0f;
    c.forward = [grad_scale](const Tensors& t, const Ctx& x) {
      Tensor dl = x.data(t.at("logits").shape());
      Tensor rl = x.f32({t.at("logits").dim(0)});
      ops::cross_entropy(t.at("logits"), t.at("targets"), grad_scale, &dl, rl);
      return Tensors{{"row_loss", rl}, {"dlogits", dl}};
    };
    c.seeds = {{"row_loss", ""}};
    c.grads = {{"logits", "dlogits", "", grad_scale}};
    c.f32_outputs = {"row_loss"};  // float32 reductions of identical inputs
    cs.push_back(c);
  }
}

// Every case, in a fixed order (seeds derive from the position).
inline const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cs = [] {
    std::vector<OpCase> v;
    add_gemm_cases(v);
    add_elementwise_cases(v);
    add_norm_rope_cases(v);
    add_attention_cases(v);
    add_attention_decode_cases(v);
    add_loss_cases(v);
    return v;
  }();
  return cs;
}

// A gtest-safe name: op and shape, letters and digits only.
inline std::string case_name(const OpCase& c, size_t index) {
  std::string s = c.op + "_" + c.shape;
  std::string out;
  for (char ch : s) {
    if (std::isalnum(static_cast<unsigned char>(ch)))
      out += ch;
    else if (!out.empty() && out.back() != '_')
      out += '_';
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out + "_" + std::to_string(index);
}

}  // namespace rig::test
