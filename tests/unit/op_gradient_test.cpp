// The CPU backward of every small case of the op table (tests/op_cases.h) against central finite
// differences of the CPU forward, and the harness's comparison against outputs known to be
// wrong. The CPU backend is the oracle of the GPU harness, so its backward is checked here, where
// CI runs it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "../op_cases.h"

namespace rig::test {
namespace {

// Cases small enough that a few dozen extra forwards per input cost nothing.
std::vector<size_t> gradient_cases() {
  std::vector<size_t> v;
  const auto& cs = op_cases();
  for (size_t i = 0; i < cs.size(); ++i) {
    if (cs[i].grads.empty()) continue;
    int64_t biggest = 0;
    for (const In& in : cs[i].in) biggest = std::max(biggest, shape_numel(in.shape));
    if (biggest <= 2048) v.push_back(i);
  }
  return v;
}

// sum over the seeds of <forward output, upstream gradient>, in double.
double seeded_loss(const OpCase& c, const Tensors& in) {
  const Tensors out = c.forward(in, Ctx{Device::cpu(), DType::F32});
  double loss = 0;
  for (const auto& [name, grad] : c.seeds) {
    const std::vector<double> o = values(out.at(name));
    if (grad.empty()) {
      for (double x : o) loss += x;
      continue;
    }
    const std::vector<double> w = values(in.at(grad));
    for (size_t i = 0; i < o.size(); ++i) loss += o[i] * w[i];
  }
  return loss;
}

class OpGradient : public ::testing::TestWithParam<size_t> {};

// Central differences with h = 1e-2 on O(1) inputs: truncation h^2/6 |f'''| ~ 2e-5, and the
// float32 rounding of the outputs a perturbation moves, divided by 2h, adds ~1e-5 (the loss is
// summed in double; outputs it does not move cancel exactly). The float64 backend that would
// make h smaller does not exist: the CPU backend is float32. Bound: 1e-3 (1 + rms of the
// gradient) + 1e-2 |numerical|, far under the order-1 errors of a wrong index or a lost term.
TEST_P(OpGradient, CpuBackwardMatchesFiniteDifferences) {
  const OpCase& c = op_cases()[GetParam()];
  const Ctx cpu{Device::cpu(), DType::F32};
  Tensors in = make_inputs(c, DType::F32, uint32_t(1000 + GetParam()));
  Tensors grads = c.forward(in, cpu);
  if (c.backward) {
    Tensors saved = in;
    for (const auto& [name, t] : grads) saved.emplace(name, t);
    grads = c.backward(saved, cpu);
  }
  std::mt19937 pick(7);
  for (const Grad& g : c.grads) {
    SCOPED_TRACE(fmt::format("{} [{}]: d loss / d {} from '{}'", c.op, c.shape, g.input, g.output));
    std::vector<double> ana = values(grads.at(g.output));
    if (!g.start.empty()) {
      const std::vector<double> s = values(in.at(g.start));
      for (size_t i = 0; i < ana.size(); ++i) ana[i] -= s[i];
    }
    double rms = 0;
    for (double& a : ana) {
      a /= g.scale;
      rms += a * a;
    }
    rms = std::sqrt(rms / double(std::max<size_t>(ana.size(), 1)));
    Tensor& x = in.at(g.input);
    const int64_t n = x.numel();
    std::vector<int64_t> coords(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) coords[size_t(i)] = i;
    std::shuffle(coords.begin(), coords.end(), pick);
    coords.resize(std::min<size_t>(coords.size(), 48));
    int bad = 0;
    for (int64_t i : coords) {
      float* p = x.f32() + i;
      const float orig = *p, h = 1e-2f;
      *p = orig + h;
      const double lp = seeded_loss(c, in);
      *p = orig - h;
      const double lm = seeded_loss(c, in);
      *p = orig;
      const double num = (lp - lm) / (double((orig + h) - (orig - h)));
      const double bound = 1e-3 * (1.0 + rms) + 1e-2 * std::abs(num);
      if (std::abs(ana[size_t(i)] - num) > bound && bad++ < 5)
        ADD_FAILURE() << "element " << i << ": backward " << ana[size_t(i)]
                      << ", finite difference " << num << " (bound " << bound << ")";
    }
    EXPECT_EQ(bad, 0) << bad << " of " << coords.size() << " sampled elements off";
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, OpGradient, ::testing::ValuesIn(gradient_cases()),
                         [](const ::testing::TestParamInfo<size_t>& p) {
                           return case_name(op_cases()[p.param], p.param);
                         });

// The comparison the GPU harness relies on must catch a wrong kernel: one wrong element, every
// element off by 1e-4 relative, and a wrong transpose.
TEST(OpHarnessComparison, CatchesWrongOutputs) {
  std::mt19937 g(1);
  Tensor want = randn({111, 80}, g);
  EXPECT_TRUE(compare(want.clone(), want, tolerance(DType::F32)).failure.empty());
  Tensor one = want.clone();
  one.f32()[4321] += 0.5f;
  const Compared c1 = compare(one, want, tolerance(DType::F32));
  EXPECT_FALSE(c1.failure.empty());
  EXPECT_EQ(c1.worst, 4321);
  EXPECT_NE(c1.failure.find("element 4321"), std::string::npos) << c1.failure;
  Tensor all = want.clone();
  for (int64_t i = 0; i < all.numel(); ++i) all.f32()[i] *= 1.0001f;
  EXPECT_FALSE(compare(all, want, tolerance(DType::F32)).failure.empty());
  // bf16 rounding of every element passes the BF16 tolerance; a NaN fails any.
  Tensor rounded = want.to_dtype(DType::BF16);
  EXPECT_TRUE(compare(rounded, want, tolerance(DType::BF16)).failure.empty());
  EXPECT_FALSE(compare(rounded, want, tolerance(DType::F32)).failure.empty());
  Tensor nan = want.clone();
  nan.f32()[3] = NAN;
  EXPECT_FALSE(compare(nan, want, tolerance(DType::BF16)).failure.empty());
  Tensor A = randn({64, 64}, g), B = randn({64, 64}, g);
  Tensor C = Tensor::zeros({64, 64}, DType::F32), Ct = Tensor::zeros({64, 64}, DType::F32);
  ops::gemm(A, false, B, false, C, 1.0f, 0.0f);
  ops::gemm(A, false, B, true, Ct, 1.0f, 0.0f);
  EXPECT_FALSE(compare(Ct, C, tolerance(DType::BF16)).failure.empty());
  // Exact outputs: any difference fails.
  Tensor near = want.clone();
  near.f32()[0] = std::nextafter(near.f32()[0], 1e9f);
  EXPECT_FALSE(compare(near, want, 0).failure.empty());
  // A sum that cancelled: relative to its terms, float32 rounding of them passes; relative to the
  // result it would not, and an error of the terms' own size still fails.
  Tensor small = Tensor::from_f32({1e-3f}, {1}), off = Tensor::from_f32({1e-3f + 1e-6f}, {1}),
         wrong = Tensor::from_f32({0.5f}, {1});
  const std::vector<double> terms{1.0};
  EXPECT_FALSE(compare(off, small, tolerance(DType::F32)).failure.empty());
  EXPECT_TRUE(compare(off, small, tolerance(DType::F32), &terms).failure.empty());
  EXPECT_FALSE(compare(wrong, small, tolerance(DType::F32), &terms).failure.empty());
}

// Every case has a unique test name, and every op of the table that the harness can compare by
// value has a case (the others are listed at the top of op_cases.h).
TEST(OpHarnessComparison, CasesCoverTheTable) {
  std::set<std::string> names, ops_seen;
  for (size_t i = 0; i < op_cases().size(); ++i) {
    EXPECT_TRUE(names.insert(case_name(op_cases()[i], i)).second);
    ops_seen.insert(op_cases()[i].op);
  }
  for (const char* op : {"gemm", "gemm_plus", "gemm_bias", "add_bias", "embedding", "rmsnorm",
                         "rmsnorm_backward_add", "rope", "attention", "attention_decode", "swiglu",
                         "cross_entropy", "add_", "scale_", "sum_squares"})
    EXPECT_TRUE(ops_seen.count(op)) << op;
}

}  // namespace
}  // namespace rig::test
