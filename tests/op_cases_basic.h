// Cases of the generic op harness: the matrix products, the element-wise ops and the loss.
#pragma once
#include <array>
#include <cmath>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "op_cases_core.h"
#include "rig/core/tensor.h"
#include "rig/ops/ops.h"

namespace rig::test {

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
  // Long on purpose: a table of cases, one push_back per op and shape.
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
  // The loss over a vocabulary in three column slices (a sharded head's), against float64
  // log-softmax over the joined rows; the finite differences check the slices' gradients.
  for (auto [rows, v] :
       {std::pair<int64_t, std::array<int64_t, 3>>{37, {4000, 4000, 1203}}, {5, {3, 4, 1}}}) {
    OpCase c;
    c.op = "cross_entropy_slice";
    c.shape = fmt::format("rows={} V={}+{}+{}", rows, v[0], v[1], v[2]);
    for (int i = 0; i < 3; ++i)
      c.in.push_back({fmt::format("l{}", i), {rows, v[size_t(i)]}, Kind::Data, 3.0f});
    const int64_t V = v[0] + v[1] + v[2];
    c.make = [rows, V](Tensors& t, std::mt19937& g) {
      std::vector<int64_t> tv(static_cast<size_t>(rows));
      std::uniform_int_distribution<int64_t> u(0, V - 1);
      for (int64_t r = 0; r < rows; ++r) tv[size_t(r)] = r % 7 == 3 ? -100 : u(g);
      tv[0] = V - 1;
      t["targets"] = ints(tv, {rows});
    };
    const float grad_scale = rows * V > 1000 ? 1.0f / 33.0f : 1.0f;
    c.forward = [grad_scale, V](const Tensors& t, const Ctx& x) {
      const Tensor& tg = t.at("targets");
      const int64_t rows = tg.numel();
      std::vector<float> init(size_t(3 * rows), 0.0f);
      for (int64_t r = 0; r < rows; ++r) init[size_t(3 * r)] = -INFINITY;
      Tensor st = Tensor::from_f32(init, {rows, 3});
      if (!x.dev.is_cpu()) st = st.to(x.dev, "stats");
      int64_t v0 = 0;
      for (const char* n : {"l0", "l1", "l2"}) {
        ops::cross_entropy_slice(t.at(n), tg, v0, st);
        v0 += t.at(n).dim(1);
      }
      Tensor rl = x.f32({rows});
      ops::cross_entropy_finish(st, tg, V, rl);
      Tensors out{{"row_loss", rl}};
      v0 = 0;
      for (int i = 0; i < 3; ++i) {
        const Tensor& l = t.at(fmt::format("l{}", i));
        Tensor d = x.data(l.shape());
        d.copy_from(l);
        ops::cross_entropy_slice_backward(d, tg, v0, st, grad_scale);
        out[fmt::format("d{}", i)] = d;
        v0 += l.dim(1);
      }
      return out;
    };
    c.reference = [grad_scale](const Tensors& t) {
      const Tensor& tg = t.at("targets");
      const int64_t rows = tg.numel();
      std::vector<Tensor> l;
      for (const char* n : {"l0", "l1", "l2"}) l.push_back(t.at(n));
      std::vector<float> loss(size_t(rows), 0.0f);
      std::vector<std::vector<float>> d;
      for (const auto& x : l) d.emplace_back(size_t(x.numel()), 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t y = tg.data<int64_t>()[r];
        if (y == -100) continue;
        double mx = -INFINITY, sum = 0, zy = 0;
        for (const auto& x : l)
          for (int64_t j = 0; j < x.dim(1); ++j)
            mx = std::max(mx, double(x.f32()[r * x.dim(1) + j]));
        int64_t v0 = 0;
        for (const auto& x : l) {
          for (int64_t j = 0; j < x.dim(1); ++j) {
            sum += std::exp(double(x.f32()[r * x.dim(1) + j]) - mx);
            if (v0 + j == y) zy = x.f32()[r * x.dim(1) + j];
          }
          v0 += x.dim(1);
        }
        const double lse = mx + std::log(sum);
        loss[size_t(r)] = float(lse - zy);
        v0 = 0;
        for (size_t i = 0; i < l.size(); ++i) {
          for (int64_t j = 0; j < l[i].dim(1); ++j) {
            const double p = std::exp(double(l[i].f32()[r * l[i].dim(1) + j]) - lse);
            d[i][size_t(r * l[i].dim(1) + j)] = float((p - (v0 + j == y ? 1.0 : 0.0)) * grad_scale);
          }
          v0 += l[i].dim(1);
        }
      }
      Tensors out{{"row_loss", Tensor::from_f32(loss, {rows})}};
      for (size_t i = 0; i < l.size(); ++i)
        out[fmt::format("d{}", i)] = Tensor::from_f32(d[i], l[i].shape());
      return out;
    };
    c.seeds = {{"row_loss", ""}};
    c.grads = {
        {"l0", "d0", "", grad_scale}, {"l1", "d1", "", grad_scale}, {"l2", "d2", "", grad_scale}};
    c.f32_outputs = {"row_loss"};
    cs.push_back(c);
  }
}

}  // namespace rig::test
