// The specialised GPU op tests: what the generic harness (tests/op_cases.h, run by
// op_backend_test.cpp) cannot check by comparing values with the CPU oracle: unaligned views,
// the bias epilogue's fallbacks, bitwise repeatability and casts, error reports, forced attention
// implementations, dropout's mask, AdamW state over steps and the multi-tensor lists. Results
// are compared by normalised error ||gpu - cpu|| / ||cpu||.
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
#include "rig/core/tensor.h"
#include "rig/ops/adamw8bit.h"
#include "rig/ops/ops.h"
#ifdef RIG_WITH_CUDA
#include "rig/ops/cuda/cuda_ops.h"
#include "rig/ops/cuda/sdpa_cudnn.h"
#endif

namespace rig {
namespace {

// The generic harness's input makers.
using test::ints;
using test::randn;
using test::rope_table;
using test::segments;

#define RIG_REQUIRE_GPU()                                                                    \
  do {                                                                                       \
    if (!rig::cuda_available())                                                              \
      GTEST_SKIP() << "no CUDA GPU: the op harness compares the CUDA backend with the CPU " \
                      "and needs a visible GPU in a -DRIG_CUDA=ON build";                    \
  } while (0)

const DType kDtypes[] = {DType::F32, DType::BF16};

double tol(DType dt) { return dt == DType::F32 ? 1e-5 : 2e-2; }
const char* name(DType dt) { return dt == DType::F32 ? "F32" : "BF16"; }

Tensor rand_ids(int64_t n, int64_t hi, std::mt19937& g) {
  std::uniform_int_distribution<int64_t> u(0, hi - 1);
  std::vector<int64_t> v{};
  v.resize(size_t(n));
  for (auto& x : v) x = u(g);
  return ints(v, {n});
}

// A CPU float32 copy holding exactly the values a `dt` tensor can hold.
Tensor rounded(const Tensor& t, DType dt) {
  return dt == DType::F32 ? t.clone() : t.to_dtype(dt).to_dtype(DType::F32);
}
// A device copy of a CPU tensor (float tensors converted to dt, integer tensors as they are).
Tensor gpu(const Tensor& t, DType dt = DType::F32) {
  if (t.dtype() != DType::F32) return t.to(Device::cuda(0));
  return t.to_dtype(dt).to(Device::cuda(0));
}
// A CPU float32 copy of a device tensor.
Tensor host(const Tensor& t) {
  Tensor c = t.to(Device::cpu());
  return c.dtype() == DType::F32 ? c : c.to_dtype(DType::F32);
}

double nerr(const Tensor& a, const Tensor& ref) {
  EXPECT_EQ(a.shape(), ref.shape());
  const float *pa = a.f32(), *pr = ref.f32();
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(pa[i]) - double(pr[i]);
    num += d * d;
    den += double(pr[i]) * pr[i];
  }
  if (!std::isfinite(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

#define EXPECT_CLOSE(gpu_f32, cpu_f32, dt, what)                                           \
  do {                                                                                     \
    const double e_ = nerr(gpu_f32, cpu_f32);                                              \
    EXPECT_LE(e_, tol(dt)) << (what) << " [" << name(dt) << "] normalised error " << e_; \
  } while (0)

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

// ---- attention -----------------------------------------------------------------------------

struct AttnCase {
  int64_t B, T, Hq, Hk, D;
  bool packed;
};

#ifdef RIG_WITH_CUDA
// Runs forward and backward of `impl` (auto, cudnn, flash, reference) on the GPU against the CPU
// oracle. BF16 tolerance 2e-2 (normalised): the kernels round P and dS to bf16 before their
// products (relative error 2^-9 per term) and the outputs once more; float32 lse 1e-5.
Tensor nans(const Shape& s) { return Tensor::from_f32(std::vector<float>(size_t(shape_numel(s)), NAN), s); }

struct ImplScope {
  explicit ImplScope(const std::string& impl) : prev(ops::cuda::attention_impl()) {
    ops::cuda::set_attention_impl(impl);
  }
  ~ImplScope() { ops::cuda::set_attention_impl(prev); }
  std::string prev;
};

double rms(const Tensor& t) {
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += double(t.f32()[i]) * t.f32()[i];
  return std::sqrt(s / double(std::max<int64_t>(t.numel(), 1)));
}

// A gradient that is exactly zero in exact arithmetic (dq and dk when every query sees one key:
// p = 1, so dS = dout·v - dout·out = 0) is rounding noise on both sides, and a relative error
// means nothing there: then the GPU's must be noise too, RMS under 1e-3 (inputs are O(1)).
void expect_grad_close(const Tensor& got, const Tensor& ref, DType dt, const std::string& what) {
  if (rms(ref) < 1e-5) {
    EXPECT_LE(rms(got), 1e-3) << what << ": the exact gradient is zero";
    return;
  }
  EXPECT_CLOSE(got, ref, dt, what);
}

void check_attention(const std::string& impl, const AttnCase& c, DType dt, std::mt19937& g,
                     bool backward = true) {
  ImplScope scope(impl);
  const std::string what = fmt::format("attention[{}] B={} T={} Hq={} Hk={} D={}{}", impl, c.B, c.T,
                                       c.Hq, c.Hk, c.D, c.packed ? " packed" : "");
  Tensor q = rounded(randn({c.B, c.T, c.Hq, c.D}, g), dt);
  Tensor k = rounded(randn({c.B, c.T, c.Hk, c.D}, g), dt);
  Tensor v = rounded(randn({c.B, c.T, c.Hk, c.D}, g), dt);
  Tensor seg = c.packed ? segments(c.B, c.T) : Tensor();
  Tensor out = Tensor::empty(q.shape(), DType::F32), lse = Tensor::empty({c.B, c.Hq, c.T}, DType::F32);
  ops::attention_forward(q, k, v, seg, out, lse);

  Tensor dq_ = gpu(q, dt), dk_ = gpu(k, dt), dv_ = gpu(v, dt);
  Tensor dseg = c.packed ? gpu(seg) : Tensor();
  // Poisoned outputs: an element the kernel does not write fails the comparison.
  Tensor dout_ = gpu(nans(q.shape()), dt);
  Tensor dlse = gpu(nans({c.B, c.Hq, c.T}));
  ops::attention_forward(dq_, dk_, dv_, dseg, dout_, dlse);
  if (impl != "auto") EXPECT_EQ(ops::cuda::last_attention_impl(false), impl) << what;
  EXPECT_CLOSE(host(dout_), out, dt, what + " out");
  EXPECT_CLOSE(host(dlse), lse, DType::F32, what + " lse");
  if (!backward) return;

  // Backward from the GPU's own saved out/lse, given to both backends.
  Tensor go = rounded(randn(q.shape(), g), dt);
  Tensor o_saved = host(dout_), l_saved = host(dlse);
  Tensor gq = Tensor::empty(q.shape(), DType::F32), gk = Tensor::empty(k.shape(), DType::F32),
         gv = Tensor::empty(k.shape(), DType::F32);
  ops::attention_backward(go, q, k, v, seg, o_saved, l_saved, gq, gk, gv);
  Tensor dgq = gpu(nans(q.shape()), dt);
  Tensor dgk = gpu(nans(k.shape()), dt);
  Tensor dgv = gpu(nans(k.shape()), dt);
  ops::attention_backward(gpu(go, dt), dq_, dk_, dv_, dseg, dout_, dlse, dgq, dgk, dgv);
  if (impl != "auto") EXPECT_EQ(ops::cuda::last_attention_impl(true), impl) << what;
  expect_grad_close(host(dgq), gq, dt, what + " dq");
  expect_grad_close(host(dgk), gk, dt, what + " dk");
  expect_grad_close(host(dgv), gv, dt, what + " dv");
}

// The fp32 reference kernel forced on bf16 inputs (any head_dim up to 256); float32, where auto
// picks it, is the generic harness's.
TEST(OpHarness, AttentionReferenceBf16) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(8);
  const AttnCase cases[] = {
      {2, 111, 6, 2, 64, true}, {1, 111, 5, 1, 80, false}, {1, 300, 4, 4, 128, true},
      {3, 33, 2, 1, 32, false}, {1, 70, 3, 3, 96, true},  {1, 40, 2, 2, 256, false},
  };
  for (const auto& c : cases) check_attention("reference", c, DType::BF16, g);
}

// Edge shapes for the tensor-core paths: lengths around the tiles (1, 63, 64, 65, 127, 4097),
// GQA groups 1/4/8, batch > 1.
const AttnCase kEdgeCases[] = {
    {2, 63, 4, 4, 64, false},  {1, 64, 8, 1, 128, false}, {3, 65, 8, 2, 64, false},
    {2, 127, 4, 1, 128, false}, {1, 200, 8, 8, 128, false}, {1, 4097, 4, 1, 64, false},
};

TEST(OpHarness, AttentionCudnn) {
  RIG_REQUIRE_GPU();
  if (ops::cuda::sdpa_cudnn::runtime_version() < 90000)
    GTEST_SKIP() << "cuDNN 9 is not available (runtime version "
                 << ops::cuda::sdpa_cudnn::runtime_version() << ")";
  std::mt19937 g(10);
  for (const auto& c : kEdgeCases) check_attention("cudnn", c, DType::BF16, g);
  // Sequence length 1: forward only (cuDNN has no backward for it; auto falls back).
  check_attention("cudnn", {2, 1, 4, 2, 64, false}, DType::BF16, g, false);
  check_attention("auto", {2, 1, 4, 2, 64, false}, DType::BF16, g);
  EXPECT_NE(ops::cuda::last_attention_impl(true), "cudnn");
  // Head dims 80 and 96 and the tiny models' 16.
  check_attention("cudnn", {2, 96, 4, 2, 80, false}, DType::BF16, g);
  check_attention("cudnn", {1, 130, 6, 3, 96, false}, DType::BF16, g);
  check_attention("cudnn", {2, 50, 4, 2, 16, false}, DType::BF16, g);
}

TEST(OpHarness, AttentionFlash) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(11);
  check_attention("flash", {2, 1, 4, 2, 64, false}, DType::BF16, g);
  for (const auto& c : kEdgeCases) check_attention("flash", c, DType::BF16, g);
  // Packed segments (lengths 1 to 64, crossing tile boundaries) and every head dim.
  const AttnCase packed[] = {
      {2, 111, 6, 2, 64, true}, {1, 300, 4, 4, 128, true}, {3, 97, 8, 1, 80, true},
      {2, 129, 4, 2, 96, true}, {1, 1000, 8, 2, 128, true},
  };
  for (const auto& c : packed) check_attention("flash", c, DType::BF16, g);
}

// What "auto" picks: cuDNN for plain causal bf16, the flash kernel for packed segments, the
// reference kernel for float32.
TEST(OpHarness, AttentionAutoPicksTheFastestThatApplies) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(12);
  check_attention("auto", {1, 128, 4, 2, 64, true}, DType::BF16, g);
  EXPECT_EQ(ops::cuda::last_attention_impl(false), "flash");
  check_attention("auto", {1, 128, 4, 2, 64, false}, DType::F32, g);
  EXPECT_EQ(ops::cuda::last_attention_impl(false), "reference");
  check_attention("auto", {1, 128, 4, 2, 64, false}, DType::BF16, g);
  if (ops::cuda::sdpa_cudnn::runtime_version() >= 90000)
    EXPECT_EQ(ops::cuda::last_attention_impl(false), "cudnn");
  ImplScope scope("cudnn");
  Tensor q = Tensor::zeros({1, 8, 2, 64}, DType::BF16, Device::cuda(0));
  Tensor o = Tensor::zeros({1, 8, 2, 64}, DType::BF16, Device::cuda(0));
  Tensor l = Tensor::zeros({1, 2, 8}, DType::F32, Device::cuda(0));
  Tensor seg = Tensor::zeros({1, 8}, DType::I64, Device::cuda(0));
  EXPECT_THROW(ops::attention_forward(q, q, q, seg, o, l), Error);  // forced cuDNN, packed
}

// Backward twice gives bit-identical gradients: the flash and reference kernels always, cuDNN
// in deterministic mode.
TEST(OpHarness, AttentionBackwardIsDeterministic) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(9);
  const Shape qs{2, 1000, 8, 64}, ks{2, 1000, 2, 64};
  Tensor q = gpu(randn(qs, g), DType::BF16), k = gpu(randn(ks, g), DType::BF16),
         v = gpu(randn(ks, g), DType::BF16), go = gpu(randn(qs, g), DType::BF16);
  const Tensor seg = gpu(segments(2, 1000));
  ops::set_deterministic(true);
  for (std::string impl : {"reference", "flash", "cudnn"}) {
    if (impl == "cudnn" && ops::cuda::sdpa_cudnn::runtime_version() < 90000) continue;
    for (bool packed : {false, true}) {
      if (packed && impl == "cudnn") continue;
      ImplScope scope(impl);
      const Tensor s = packed ? seg : Tensor();
      Tensor out = Tensor::empty(qs, DType::BF16, Device::cuda(0));
      Tensor lse = Tensor::empty({2, 8, 1000}, DType::F32, Device::cuda(0));
      ops::attention_forward(q, k, v, s, out, lse);
      std::vector<Tensor> res;
      for (int rep = 0; rep < 2; ++rep) {
        Tensor dq = Tensor::empty(qs, DType::BF16, Device::cuda(0));
        Tensor dk = Tensor::empty(ks, DType::BF16, Device::cuda(0));
        Tensor dv = Tensor::empty(ks, DType::BF16, Device::cuda(0));
        ops::attention_backward(go, q, k, v, s, out, lse, dq, dk, dv);
        for (Tensor* t : {&dq, &dk, &dv}) res.push_back(host(*t));
      }
      for (int i = 0; i < 3; ++i)
        EXPECT_EQ(nerr(res[size_t(i)], res[size_t(i + 3)]), 0.0) << impl << (packed ? " packed" : "") << " grad " << i;
    }
  }
  ops::set_deterministic(false);
}

#endif  // RIG_WITH_CUDA

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

// ---- AdamW ---------------------------------------------------------------------------------

TEST(OpHarness, AdamW) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(14);
  const ops::AdamWParams base{0.1f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
  for (DType pt : kDtypes)
    for (DType gt : kDtypes) {
      const Shape s{111, 989};
      Tensor p = rounded(randn(s, g), pt), p0 = p.clone();
      Tensor m = Tensor::zeros(s, DType::F32), v = Tensor::zeros(s, DType::F32);
      Tensor gp = gpu(p, pt), gm = gpu(m), gv = gpu(v);
      for (int64_t step = 1; step <= 3; ++step) {
        Tensor grad = rounded(randn(s, g, 0.1f), gt);
        ops::AdamWParams h = base;
        h.step = step;
        ops::adamw_step(p, grad, m, v, h);
        ops::adamw_step(gp, gpu(grad, gt), gm, gv, h);
        if (pt == DType::BF16) p = rounded(p, DType::BF16);  // the oracle holds what bf16 can
      }
      const std::string what = fmt::format("adamw param {} grad {}", name(pt), name(gt));
      EXPECT_CLOSE(host(gm), m, DType::F32, what + " m");
      EXPECT_CLOSE(host(gv), v, DType::F32, what + " v");
      if (pt == DType::F32) {
        // Compare the update itself, not the (much larger) parameter.
        Tensor du = host(gp), cu = p.clone();
        ops::add_(du, p0, -1.0f);
        ops::add_(cu, p0, -1.0f);
        EXPECT_CLOSE(du, cu, DType::F32, what + " update");
      } else {
        EXPECT_CLOSE(host(gp), p, DType::BF16, what + " param");
      }
    }
}

// The multi-tensor pass: more slots than one launch takes, chunk edges, every dtype pair, a clip
// coefficient, per-slot decay and bf16 copies. Against the single-tensor kernel after an in-place
// scale (bitwise, for float32 gradients), and against the CPU list.
TEST(OpHarness, AdamWList) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(16);
  const ops::AdamWParams h{0.05f, 0.9f, 0.95f, 1e-8f, 0.0f, 2};
  const float coef = 0.37f;
  for (DType pt : kDtypes)
    for (DType gt : kDtypes) {
      std::vector<ops::AdamWSlot> cpu_slots, gpu_slots;
      std::vector<Tensor> gp_ref, gm_ref, gv_ref;
      for (int i = 0; i < 45; ++i) {
        const int64_t n = i == 7 ? 3 * 4096 + 5 : 100 + 37 * i;
        ops::AdamWSlot c;
        c.param = rounded(randn({n}, g), pt);
        c.grad = rounded(randn({n}, g, 0.1f), gt);
        c.m = randn({n}, g, 0.01f);
        c.v = randn({n}, g, 0.01f);
        for (int64_t j = 0; j < n; ++j) c.v.f32()[j] *= c.v.f32()[j];
        c.weight_decay = i % 3 == 0 ? 0.0f : 0.1f;
        if (i % 2 == 0) c.copy = Tensor::empty({n}, DType::BF16);
        ops::AdamWSlot d{
            gpu(c.param, pt),
            gpu(c.grad, gt),
            gpu(c.m),
            gpu(c.v),
            c.copy.defined() ? Tensor::empty({n}, DType::BF16, Device::cuda(0)) : Tensor(),
            c.weight_decay};
        gp_ref.push_back(gpu(c.param, pt));
        gm_ref.push_back(gpu(c.m));
        gv_ref.push_back(gpu(c.v));
        cpu_slots.push_back(c);
        gpu_slots.push_back(d);
      }
      ops::adamw_step_list(cpu_slots, h, coef);
      ops::adamw_step_list(gpu_slots, h, coef);
      const std::string what = fmt::format("adamw list param {} grad {}", name(pt), name(gt));
      for (size_t i = 0; i < gpu_slots.size(); ++i) {
        const auto& d = gpu_slots[i];
        const auto& c = cpu_slots[i];
        const std::string w = fmt::format("{} slot {}", what, i);
        EXPECT_CLOSE(host(d.m), c.m, DType::F32, w + " m");
        EXPECT_CLOSE(host(d.v), c.v, DType::F32, w + " v");
        EXPECT_CLOSE(host(d.param), c.param, pt, w + " param");
        if (d.copy.defined()) {
          Tensor want = Tensor::empty(d.param.shape(), DType::BF16, d.param.device());
          ops::cast(d.param, want);
          EXPECT_EQ(ops::hash64({host(d.copy)}), ops::hash64({host(want)})) << w << " copy";
        }
        if (gt == DType::F32) {  // the single-tensor kernel on a clipped gradient: the same bits
          Tensor gg = d.grad.clone();
          ops::scale_(gg, coef);
          ops::AdamWParams hi = h;
          hi.weight_decay = d.weight_decay;
          ops::adamw_step(gp_ref[i], gg, gm_ref[i], gv_ref[i], hi);
          EXPECT_EQ(ops::hash64({host(gp_ref[i]), host(gm_ref[i]), host(gv_ref[i])}),
                    ops::hash64({host(d.param), host(d.m), host(d.v)}))
              << w;
        }
      }
    }
}

// 8-bit AdamW: the CUDA kernel against the CPU oracle over three steps from a fresh state (F32
// parameters and gradients; a partial last block). The codes may differ where a value sits on a
// midpoint up to float rounding; everything else matches.
TEST(OpHarness, AdamW8bit) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(15);
  const int64_t n = 256 * 37 + 100, blocks = 38;
  Tensor p = randn({n}, g), p0 = p.clone();
  Tensor mq = Tensor::zeros({n}, DType::U8), vq = Tensor::zeros({n}, DType::U8);
  Tensor ma = Tensor::zeros({blocks}, DType::F32), va = Tensor::zeros({blocks}, DType::F32);
  Tensor gp = gpu(p), gmq = gpu(mq), gvq = gpu(vq), gma = gpu(ma), gva = gpu(va);
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor grad = randn({n}, g, 0.1f);
    const ops::AdamWParams h{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, step};
    ops::adamw8bit_step(p, grad, mq, ma, vq, va, h);
    ops::adamw8bit_step(gp, gpu(grad), gmq, gma, gvq, gva, h);
  }
  Tensor du = host(gp), cu = p.clone();
  ops::add_(du, p0, -1.0f);
  ops::add_(cu, p0, -1.0f);
  EXPECT_CLOSE(du, cu, DType::F32, "adamw8bit update");
  EXPECT_CLOSE(host(gma), ma, DType::F32, "adamw8bit m absmax");
  EXPECT_CLOSE(host(gva), va, DType::F32, "adamw8bit v absmax");
  for (auto [gq, cq, what] : {std::tuple{&gmq, &mq, "m"}, {&gvq, &vq, "v"}}) {
    Tensor hq = gq->to(Device::cpu());
    int64_t differ = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int d = int(hq.data<uint8_t>()[i]) - int(cq->data<uint8_t>()[i]);
      EXPECT_LE(std::abs(d), 1) << what << " code " << i;
      differ += d != 0;
    }
    EXPECT_LE(differ, n / 1000) << what << " codes that differ";
  }
}

}  // namespace
}  // namespace rig
