// The CPU backward of every small case of the op table (tests/op_cases.h) against central finite
// differences of the CPU forward, and the harness's comparison against outputs known to be
// wrong. The CPU backend is the oracle of the GPU harness, so its backward is checked here, where
// CI runs it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
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

// The ops of src/rig/ops/op_table.inc, read through its row macros (RIG_BACKEND rows are backend
// functions behind RIG_OP_VIA rows, not ops): a row added there is in this list at once.
const std::vector<std::string>& table_ops() {
  static const std::vector<std::string> ops = {
#define RIG_OP(ret, name, category, device_of, params, args) #name,
#define RIG_OP_CUSTOM(ret, name, params) #name,
#define RIG_OP_VIA(ret, name, category, device_of, params, backend_call) #name,
#include "rig/ops/op_table.inc"
  };
  return ops;
}

// Rows the harness cannot compare by value (the top of op_cases.h says why), with their own tests.
const std::map<std::string, std::string>& tested_elsewhere() {
  static const std::map<std::string, std::string> m = {
      {"cast", "bitwise: tests/gpu/op_harness_test.cpp, tests/unit/adamw_test.cpp"},
      {"dropout", "its own mask on CUDA: tests/gpu/op_harness_test.cpp"},
      {"adamw_step", "multi-step state: tests/unit/adamw_test.cpp, op_harness_adamw_test.cpp"},
      {"adamw_step_list", "multi-step state: tests/unit/adamw_test.cpp, op_harness_adamw_test.cpp"},
      {"sum_squares_list", "a list op: tests/gpu/op_harness_test.cpp"},
      {"count_bad_values", "a list op: tests/unit/guard_units_test.cpp, tests/gpu/guard_test.cpp"},
      {"hash64", "a list op: tests/unit/guard_units_test.cpp, tests/gpu/guard_test.cpp"},
      {"cross_entropy_finish", "within the cross_entropy_slice cases (tests/op_cases_basic.h)"},
      {"cross_entropy_slice_backward",
       "within the cross_entropy_slice cases: their d0..d2 (tests/op_cases_basic.h)"},
  };
  return m;
}

// A case of op `S` with a backward covers the rows S, S_forward and S_backward; the backward of
// add_bias is bias_backward.
bool covered(const std::string& row, const std::map<std::string, bool>& cases) {
  auto has = [&](const std::string& op, bool needs_backward) {
    auto it = cases.find(op);
    return it != cases.end() && (!needs_backward || it->second);
  };
  auto strip = [&](const std::string& suffix, std::string* stem) {
    if (row.size() <= suffix.size() ||
        row.compare(row.size() - suffix.size(), suffix.size(), suffix))
      return false;
    *stem = row.substr(0, row.size() - suffix.size());
    return true;
  };
  std::string stem;
  if (has(row, false)) return true;
  if (strip("_forward", &stem) && has(stem, false)) return true;
  if (strip("_backward", &stem) && has(stem, true)) return true;
  return row == "bias_backward" && has("add_bias", true);
}

// Every case has a unique test name and names a row of the op table (or the stem of a
// forward/backward pair), and every row of the table has a case or is listed in
// tested_elsewhere(): a new op without a test fails here.
TEST(OpHarnessComparison, CasesCoverTheTable) {
  const std::vector<std::string>& rows = table_ops();
  ASSERT_GE(rows.size(), 20u) << "op_table.inc read no rows";
  const std::set<std::string> row_set(rows.begin(), rows.end());
  std::set<std::string> names;
  std::map<std::string, bool> cases;  // op -> some case of it has a backward
  for (size_t i = 0; i < op_cases().size(); ++i) {
    const OpCase& c = op_cases()[i];
    EXPECT_TRUE(names.insert(case_name(c, i)).second) << case_name(c, i);
    cases[c.op] = cases[c.op] || static_cast<bool>(c.backward);
    EXPECT_TRUE(row_set.count(c.op) || row_set.count(c.op + "_forward")) << c.op << " is no op";
  }
  for (const std::string& row : rows) {
    const bool elsewhere = tested_elsewhere().count(row) > 0;
    EXPECT_TRUE(covered(row, cases) || elsewhere)
        << row << " (src/rig/ops/op_table.inc) has no case in tests/op_cases_*.h; add one, or list "
        << "it in tested_elsewhere() with the test that checks it";
    EXPECT_FALSE(covered(row, cases) && elsewhere)
        << row << " has a case: drop it from tested_elsewhere()";
  }
  for (const auto& [op, where] : tested_elsewhere())
    EXPECT_TRUE(row_set.count(op))
        << op << " is listed in tested_elsewhere() but is no row of the table";
}

}  // namespace
}  // namespace rig::test
