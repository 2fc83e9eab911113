// Cases of the generic op harness: rmsnorm, rope, attention and decode attention.
#pragma once
#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "op_cases_core.h"
#include "rig/core/tensor.h"
#include "rig/ops/ops.h"

namespace rig::test {

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

inline void add_norm_rope_cases(std::vector<OpCase>& cs) {
  // Long on purpose: a table of cases, one push_back per op and shape.
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

// Generation's greedy pick, in plain loops: the first index of the largest non-NaN value among
// the first `limit` of each row (0 when there is none).
inline Tensors argmax_reference(const Tensors& t) {
  const Tensor& x = t.at("x");
  const int64_t rows = x.dim(0), V = x.dim(1), limit = int64_t(values(t.at("limit"))[0]);
  const std::vector<double> xv = values(x);
  std::vector<int64_t> out(size_t(rows), 0);
  for (int64_t r = 0; r < rows; ++r) {
    double best = -INFINITY;
    bool any = false;
    for (int64_t i = 0; i < limit; ++i) {
      const double v = xv[size_t(r * V + i)];
      if (std::isnan(v) || (any && !(v > best))) continue;
      best = v;
      any = true;
      out[size_t(r)] = i;
    }
  }
  return Tensors{{"out", ints(out, {rows})}};
}

inline void add_argmax_cases(std::vector<OpCase>& cs) {
  struct A {
    int64_t rows, V, limit;
    int nans;      // NaN written over this many values of each row (the row's first one included)
    bool ties;     // the row's values rounded to a few levels, so the largest repeats
    bool all_nan;  // row 0: NaN but -inf at limit - 1 (picked); row 1: all NaN (0)
  };
  // A single logit; one row of a large vocabulary cut to the tokenizer's (as generate does);
  // several rows at sizes around the block's 1024 threads; NaN and -inf rows; repeated maxima.
  const A shapes[] = {{1, 1, 1, 0, false, false},       {1, 128256, 128000, 0, false, false},
                      {3, 1000, 1000, 0, false, false}, {5, 4097, 4095, 0, false, false},
                      {2, 33, 33, 5, false, false},     {4, 2048, 1500, 0, true, false},
                      {2, 1100, 1090, 0, false, true},  {1, 1023, 1023, 0, true, false}};
  for (const A& s : shapes) {
    OpCase c;
    c.op = "argmax";
    c.shape = fmt::format("rows={} V={} limit={}{}{}{}", s.rows, s.V, s.limit,
                          s.nans ? fmt::format(" nan={}", s.nans) : "", s.ties ? " ties" : "",
                          s.all_nan ? " all-nan" : "");
    c.in = {{"x", {s.rows, s.V}}};
    c.make = [s](Tensors& t, std::mt19937& g) {
      t["limit"] = ints({s.limit}, {1});
      Tensor& x = t.at("x");
      for (int64_t r = 0; r < s.rows; ++r) {
        float* row = x.f32() + r * s.V;
        if (s.ties)  // a handful of levels: the largest appears many times
          for (int64_t i = 0; i < s.V; ++i) row[i] = std::round(row[i] * 2.0f);
        for (int k = 0; k < s.nans; ++k) row[k == 0 ? 0 : g() % uint32_t(s.V)] = NAN;
        if (s.all_nan) {  // values past the limit are never read
          std::fill(row, row + s.limit, NAN);
          if (r == 0) row[s.limit - 1] = -INFINITY;
        }
      }
    };
    c.forward = [](const Tensors& t, const Ctx& x) {
      const Tensor& in = t.at("x");
      Tensor out = Tensor::empty({in.dim(0)}, DType::I64, x.dev);
      ops::argmax(in, int64_t(values(t.at("limit"))[0]), out);
      return Tensors{{"out", out}};
    };
    c.exact = {"out"};
    c.reference = argmax_reference;
    cs.push_back(c);
  }
}

}  // namespace rig::test
