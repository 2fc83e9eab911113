// The specialised GPU op tests: what the generic harness (tests/op_cases.h, run by
// op_backend_test.cpp) cannot check by comparing values with the CPU oracle: unaligned views,
// the bias epilogue's fallbacks, bitwise repeatability and casts, error reports, forced attention
// implementations (op_harness_attention_test.cpp), dropout's mask, AdamW state over steps and the
// multi-tensor lists (op_harness_adamw_test.cpp). Results are compared by normalised error
// ||gpu - cpu|| / ||cpu||.
//
// BF16 variants round the inputs to bf16 first and give the CPU the same rounded values, so the
// comparison measures the kernel (fp32 accumulation, one rounding of the output), not the inputs.
// Backward checks hand both backends the same saved tensors (out, lse, rstd) for the same reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../op_cases.h"
#include "op_harness_test_util.h"
#include "rig/core/tensor.h"
#include "rig/ops/ops.h"
#ifdef RIG_WITH_CUDA
#include "rig/ops/cuda/cuda_ops.h"
#endif

namespace rig {
namespace {

using namespace test::op_harness;
// The generic harness's input makers.
using test::ints;
using test::randn;
using test::rope_table;

// ---- self-test: the comparison must catch a wrong kernel ------------------------------------

TEST(OpHarness, ComparisonCatchesPerturbedOutput) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(1);
  Tensor x = randn({111, 80}, g), u = randn({111, 80}, g);
  Tensor a = Tensor::empty(x.shape(), DType::F32);
  ops::swiglu_forward(x, u, a);
  Tensor dx = gpu(x), du = gpu(u), da = Tensor::empty(x.shape(), DType::F32, Device::cuda(0));
  ops::swiglu_forward(dx, du, da);
  Tensor out = host(da);
  EXPECT_LE(nerr(out, a), tol(DType::F32));
  // One wrong element, or every element off by 1e-4, must fail the F32 tolerance.
  Tensor one = out.clone();
  one.f32()[4321] += 0.5f;
  EXPECT_GT(nerr(one, a), tol(DType::F32));
  Tensor all = out.clone();
  for (int64_t i = 0; i < all.numel(); ++i) all.f32()[i] *= 1.0001f;
  EXPECT_GT(nerr(all, a), tol(DType::F32));
  // A gemm called with the wrong transpose flag is caught too.
  Tensor A = randn({64, 64}, g), B = randn({64, 64}, g), C = Tensor::zeros({64, 64}, DType::F32);
  ops::gemm(A, false, B, false, C, 1.0f, 0.0f);
  Tensor dC = Tensor::zeros({64, 64}, DType::F32, Device::cuda(0));
  ops::gemm(gpu(A), false, gpu(B), true, dC, 1.0f, 0.0f);
  EXPECT_GT(nerr(host(dC), C), 0.1);
}

TEST(OpHarness, RejectsUnsupportedDtypes) {
  RIG_REQUIRE_GPU();
  Tensor a = Tensor::zeros({8, 8}, DType::F32, Device::cuda(0));
  Tensor cb = Tensor::zeros({8, 8}, DType::BF16, Device::cuda(0));
  EXPECT_THROW(ops::gemm(a, false, a, false, cb, 1.0f, 0.0f), Error);
  Tensor ab = Tensor::zeros({8, 8}, DType::BF16, Device::cuda(0));
  EXPECT_THROW(ops::gemm(a, false, ab, false, a, 1.0f, 0.0f), Error);
  Tensor h = Tensor::zeros({8, 8}, DType::F16, Device::cuda(0));
  EXPECT_THROW(ops::scale_(h, 2.0f), Error);
}

// ---- gemm ----------------------------------------------------------------------------------

struct GemmCase {
  int64_t m, n, k;
  bool ta, tb;
  float alpha, beta;
};

void run_gemm(const GemmCase& c, DType dab, DType dc, std::mt19937& g, bool offset_view) {
  const std::string what = fmt::format("gemm m={} n={} k={} ta={} tb={} alpha={} beta={} {}x{}->{}{}",
                                       c.m, c.n, c.k, c.ta, c.tb, c.alpha, c.beta, name(dab),
                                       name(dab), name(dc), offset_view ? " (unaligned view)" : "");
  // With offset_view, A starts one element into its buffer: a 2- or 4-byte aligned pointer.
  const int64_t ra = c.ta ? c.k : c.m, ca = c.ta ? c.m : c.k, off = offset_view ? 1 : 0;
  Tensor Abuf = rounded(randn({ra * ca + 1}, g), dab);
  Tensor A = Abuf.slice_rows(off, off + ra * ca).reshape({ra, ca}).clone();
  Tensor B = rounded(randn({c.tb ? c.n : c.k, c.tb ? c.k : c.n}, g), dab);
  Tensor C0 = rounded(randn({c.m, c.n}, g), dc);
  Tensor C = C0.clone();
  ops::gemm(A, c.ta, B, c.tb, C, c.alpha, c.beta);
  Tensor dA = gpu(Abuf, dab).slice_rows(off, off + ra * ca).reshape({ra, ca});
  Tensor dC = gpu(C0, dc);
  ops::gemm(dA, c.ta, gpu(B, dab), c.tb, dC, c.alpha, c.beta);
  EXPECT_CLOSE(host(dC), C, dc == DType::BF16 ? DType::BF16 : dab, what);
}

// Views that start one element into a buffer (2-byte aligned bf16, 4-byte aligned f32).
TEST(OpHarness, GemmUnalignedViews) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(2);
  const GemmCase c{111, 989, 80, false, true, 0.5f, 0.0f};
  run_gemm(c, DType::F32, DType::F32, g, true);
  run_gemm(c, DType::BF16, DType::BF16, g, true);
}

// The weight-gradient case: dW (F32) += X^T dY from bf16 activations, twice.
TEST(OpHarness, GemmAccumulatesWeightGradientInF32) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(3);
  Tensor X = rounded(randn({989, 80}, g), DType::BF16), dY = rounded(randn({989, 111}, g), DType::BF16);
  Tensor dW = randn({80, 111}, g);
  Tensor ddW = gpu(dW, DType::F32);
  for (int rep = 0; rep < 2; ++rep) {
    ops::gemm(X, true, dY, false, dW, 1.0f, 1.0f);
    ops::gemm(gpu(X, DType::BF16), true, gpu(dY, DType::BF16), false, ddW, 1.0f, 1.0f);
  }
  EXPECT_CLOSE(host(ddW), dW, DType::F32, "dW += X^T dY (bf16 inputs, f32 accumulator)");
}

// ---- bias ----------------------------------------------------------------------------------

#ifdef RIG_WITH_CUDA
// gemm + bias in one cuBLASLt call (the bias epilogue), against the CPU's gemm then add_bias.
TEST(OpHarness, GemmBiasEpilogue) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(5);
  const int64_t before = ops::cuda::gemm_bias_fallbacks();
  for (DType dab : kDtypes)
    for (DType dc : kDtypes)
      for (DType dbias : kDtypes)
        for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{989, 80, 111}, {111, 1000, 64}, {1, 64, 80}}) {
          if (dab == DType::F32 && dc != DType::F32) continue;  // not a gemm rig allows
          Tensor x = rounded(randn({m, k}, g), dab), w = rounded(randn({n, k}, g), dab);
          Tensor bias = rounded(randn({n}, g), dbias);
          Tensor want = Tensor::empty({m, n}, DType::F32);
          ops::gemm_bias(x, false, w, true, want, bias);
          Tensor got = Tensor::empty({m, n}, dc, Device::cuda(0));
          ops::gemm_bias(gpu(x, dab), false, gpu(w, dab), true, got, gpu(bias, dbias));
          EXPECT_CLOSE(host(got), want, dc,
                       fmt::format("gemm_bias {}x{}x{} {} -> {} bias {}", m, n, k, name(dab), name(dc), name(dbias)));
        }
  const int64_t fallbacks = ops::cuda::gemm_bias_fallbacks() - before;
  std::printf("gemm_bias: %lld of 18 dtype/shape cases fell back to gemm + add_bias\n", (long long)fallbacks);
  // A bias in the output's dtype (what the model passes) is fused; other mixes may fall back.
  for (DType dt : kDtypes) {
    Tensor x = gpu(randn({989, 64}, g), dt), w = gpu(randn({80, 64}, g), dt);
    Tensor y = Tensor::empty({989, 80}, dt, Device::cuda(0));
    const int64_t b2 = ops::cuda::gemm_bias_fallbacks();
    ops::gemm_bias(x, false, w, true, y, gpu(randn({80}, g), dt));
    EXPECT_EQ(ops::cuda::gemm_bias_fallbacks(), b2) << name(dt) << " gemm with a " << name(dt) << " bias was not fused";
  }
}
#endif

// ---- embedding -----------------------------------------------------------------------------

// Values are the generic harness's; here: bitwise repeatable although ~20 rows share each id
// (no atomics), and an id outside the table is reported.
TEST(OpHarness, EmbeddingBackwardRepeatsAndBadIdsAreReported) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(5);
  for (DType dt : kDtypes) {
    const int64_t vocab = 50, h = 80, rows = 989;
    Tensor dids = gpu(rand_ids(rows, vocab, g));
    Tensor dgrad = gpu(randn({rows, h}, g), dt);
    Tensor again = gpu(randn({vocab, h}, g)), again2 = again.clone();
    ops::embedding_backward(dids, dgrad, again);
    ops::embedding_backward(dids, dgrad, again2);
    Tensor a1 = host(again), a2 = host(again2);
    EXPECT_EQ(0, std::memcmp(a1.raw(), a2.raw(), a1.nbytes()))
        << "embedding_backward repeats [" << name(dt) << "]";
  }
  Tensor bad = gpu(ints({1, 2, 50}, {3}));
  Tensor table = Tensor::zeros({50, 8}, DType::F32, Device::cuda(0));
  Tensor out = Tensor::empty({3, 8}, DType::F32, Device::cuda(0));
  // Nothing is read back: the bad id is raised by the next op that checks the device, once.
  EXPECT_NO_THROW(ops::embedding_forward(bad, table, out));
  EXPECT_THROW(ops::sum_squares(out), InputError);
  Tensor ok = gpu(ints({1, 2, 49}, {3}));
  ops::embedding_forward(ok, table, out);
  EXPECT_NO_THROW(ops::sum_squares(out));
}

// ---- rope ----------------------------------------------------------------------------------

// Values are the generic harness's; here: the backward undoes the forward, and a position outside
// the table is reported at the next synchronising op.
TEST(OpHarness, RopeRoundTripAndBadPositions) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(7);
  for (DType dt : kDtypes) {
    const int64_t rows = 111, positions = 300, d = 80;
    const int heads = 5;
    Tensor cos = gpu(rope_table(positions, d / 2, false)),
           sin = gpu(rope_table(positions, d / 2, true));
    std::vector<int64_t> pv(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) pv[size_t(r)] = (r * 37) % positions;
    Tensor pos = gpu(ints(pv, {rows}));
    Tensor x = rounded(randn({rows, heads * d}, g), dt);
    Tensor dx = gpu(x, dt);
    ops::rope_forward(dx, pos, cos, sin, heads);
    ops::rope_backward(dx, pos, cos, sin, heads);
    EXPECT_CLOSE(host(dx), x, dt, "rope backward(forward(x)) == x");
  }
  // A bad position is reported by either kernel (scalar for head_dim 8, vector for 16).
  for (int64_t d : {8, 16}) {
    Tensor x = Tensor::zeros({2, d}, DType::F32, Device::cuda(0));
    Tensor t = gpu(rope_table(4, d / 2, false));
    ops::rope_forward(x, gpu(ints({0, 4}, {2})), t, t, 1);
    EXPECT_THROW(ops::sum_squares(x), InputError) << "head_dim " << d;
    EXPECT_NO_THROW(ops::sum_squares(x));
  }
}

// ---- cross-entropy -------------------------------------------------------------------------

// Out of place is the generic harness's; here: dlogits written over the logits, the loss without
// a gradient, float32 logits with a bf16 gradient, and a bad label raised by the next checking op.
TEST(OpHarness, CrossEntropy) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(11);
  auto loss_on = [](const Tensor& logits, const Tensor& targets, float scale, Tensor* dl) {
    Tensor rl = Tensor::empty({logits.dim(0)}, DType::F32, logits.device());
    ops::cross_entropy(logits, targets, scale, dl, rl);
    return host(rl);
  };
  for (DType dt : kDtypes)
    for (int64_t V : {1000, 32003}) {
      const int64_t rows = 111;
      const std::string what = fmt::format("cross_entropy V={} in place", V);
      Tensor logits = rounded(randn({rows, V}, g, 3.0f), dt);
      std::vector<int64_t> tv(static_cast<size_t>(rows));
      std::uniform_int_distribution<int64_t> u(0, V - 1);
      for (int64_t r = 0; r < rows; ++r) tv[size_t(r)] = r % 7 == 3 ? -100 : u(g);
      Tensor targets = ints(tv, {rows});
      const float scale = 1.0f / 95.0f;
      Tensor dl = Tensor::empty({rows, V}, DType::F32);
      Tensor loss = loss_on(logits, targets, scale, &dl);
      Tensor dlog = gpu(logits, dt);
      EXPECT_CLOSE(loss_on(dlog, gpu(targets), scale, &dlog), loss, DType::F32, what + " loss");
      EXPECT_CLOSE(host(dlog), dl, dt, what + " dlogits");
      EXPECT_CLOSE(loss_on(gpu(logits, dt), gpu(targets), scale, nullptr), loss, DType::F32,
                   what + " without dlogits");
    }
  // float32 logits, the gradient written in bf16 for the products (the LM head's backward).
  {
    Tensor logits = randn({111, 32003}, g, 3.0f);
    Tensor targets = rand_ids(111, 32003, g);
    Tensor dl = Tensor::empty({111, 32003}, DType::F32);
    Tensor loss = loss_on(logits, targets, 0.01f, &dl);
    Tensor dgrad = Tensor::empty({111, 32003}, DType::BF16, Device::cuda(0));
    EXPECT_CLOSE(loss_on(gpu(logits), gpu(targets), 0.01f, &dgrad), loss, DType::F32,
                 "F32 logits, BF16 dlogits loss");
    EXPECT_CLOSE(host(dgrad), dl, DType::BF16, "cross_entropy F32 logits -> BF16 dlogits");
  }
  // Nothing is read back, so a bad label surfaces at the next op that checks the device.
  Tensor logits = Tensor::zeros({2, 10}, DType::F32, Device::cuda(0));
  EXPECT_NO_THROW(loss_on(logits, gpu(ints({3, 10}, {2})), 1.0f, nullptr));
  EXPECT_THROW(ops::sum_squares(logits), InputError);
  EXPECT_NO_THROW(ops::sum_squares(logits));  // reported once, then cleared
}

// ---- element-wise --------------------------------------------------------------------------

// add_, scale_ and sum_squares are the generic harness's; the list form is here.
TEST(OpHarness, SumSquaresList) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(12);
  // The list form: one value per tensor, as sum_squares gives it; more tensors than one launch
  // takes, so the second batch's partials and sums land in their places too.
  std::vector<Tensor> cpu_list, gpu_list;
  std::vector<int64_t> sizes = {1, 255, 256, 257, 100003, 3000000};
  for (int64_t i = 0; i < 70; ++i) sizes.push_back(1 + 61 * i);
  for (int64_t n : sizes) {
    const DType dt = n % 2 ? DType::BF16 : DType::F32;
    cpu_list.push_back(rounded(randn({n}, g), dt));
    gpu_list.push_back(gpu(cpu_list.back(), dt));
  }
  const std::vector<double> got = ops::sum_squares_list(gpu_list);
  ASSERT_EQ(got.size(), cpu_list.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double ref = ops::sum_squares(cpu_list[i]);
    EXPECT_LE(std::abs(got[i] - ref) / ref, 1e-9) << "sum_squares_list entry " << i;
    EXPECT_EQ(got[i], ops::sum_squares(gpu_list[i])) << "list and single agree, entry " << i;
  }
}

// cast rounds exactly as the CPU conversion does (nearest even), so the results are bitwise equal.
TEST(OpHarness, CastIsBitwiseTheCpuConversion) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(13);
  Tensor x = randn({989, 111}, g);
  for (int64_t i = 0; i < x.numel(); i += 97) x.f32()[i] *= 1e30f;  // large values round too
  for (DType src : kDtypes)
    for (DType dst : kDtypes) {
      Tensor in = src == DType::F32 ? x : x.to_dtype(src);
      Tensor want = Tensor::empty(x.shape(), dst);
      ops::cast(in, want);
      Tensor out = Tensor::empty(x.shape(), dst, Device::cuda(0));
      ops::cast(in.to(Device::cuda(0)), out);
      Tensor got = out.to(Device::cpu());
      EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0) << name(src) << " -> " << name(dst);
    }
}

// The CUDA mask differs from the CPU one (counter-based hash vs mt19937), so the check is on its
// properties: p=0 copies, kept values are x/(1-p), the keep rate is 1-p, same seed same mask.
TEST(OpHarness, Dropout) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(13);
  const Shape s{989, 111};
  Tensor x = randn(s, g, 1.0f, 3.0f);  // no zeros in x
  Tensor gx = gpu(x);
  Tensor out = Tensor::empty(s, DType::F32, Device::cuda(0));
  ops::dropout(gx, 0.0f, 1, out);
  EXPECT_EQ(nerr(host(out), x), 0.0);
  const float p = 0.3f;
  ops::dropout(gx, p, 42, out);
  Tensor o1 = host(out);
  int64_t kept = 0;
  double worst = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (o1.f32()[i] == 0.0f) continue;
    ++kept;
    worst = std::max(worst, double(std::abs(o1.f32()[i] - x.f32()[i] / (1.0f - p))));
  }
  EXPECT_LE(worst, 1e-5);
  EXPECT_NEAR(double(kept) / double(x.numel()), 1.0 - p, 0.01);
  ops::dropout(gx, p, 42, out);
  EXPECT_EQ(nerr(host(out), o1), 0.0) << "same seed, same mask";
  ops::dropout(gx, p, 43, out);
  EXPECT_GT(nerr(host(out), o1), 0.1) << "another seed, another mask";
  Tensor ob = Tensor::empty(s, DType::BF16, Device::cuda(0));
  ops::dropout(gpu(x, DType::BF16), p, 42, ob);
  Tensor hb = host(ob);
  int64_t same_mask = 0;
  for (int64_t i = 0; i < x.numel(); ++i) same_mask += (hb.f32()[i] == 0.0f) == (o1.f32()[i] == 0.0f);
  EXPECT_EQ(same_mask, x.numel()) << "the mask depends on (seed, index) only, not the dtype";
}

}  // namespace
}  // namespace rig
