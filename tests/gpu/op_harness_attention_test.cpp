// Attention on the GPU: each implementation forced (reference, cuDNN, flash), auto, determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "../op_cases.h"
#include "op_harness_test_util.h"
#include "rig/core/tensor.h"
#include "rig/ops/ops.h"
#ifdef RIG_WITH_CUDA
#include "rig/ops/cuda/cuda_ops.h"
#include "rig/ops/cuda/sdpa_cudnn.h"
#endif

namespace rig {
namespace {

using namespace test::op_harness;
// The generic harness's input makers.
using test::randn;
using test::segments;

// ---- attention -----------------------------------------------------------------------------

struct AttnCase {
  int64_t B, T, Hq, Hk, D;
  bool packed;
};

#ifdef RIG_WITH_CUDA
// Runs forward and backward of `impl` (auto, cudnn, flash, reference) on the GPU against the CPU
// oracle. BF16 tolerance 2e-2 (normalised): the kernels round P and dS to bf16 before their
// products (relative error 2^-9 per term) and the outputs once more; float32 lse 1e-5.
Tensor nans(const Shape& s) {
  return Tensor::from_f32(std::vector<float>(size_t(shape_numel(s)), NAN), s);
}

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

// seg_ids: the packed case's segment ids (default: the harness's segments(B, T)).
void check_attention(const std::string& impl, const AttnCase& c, DType dt, std::mt19937& g,
                     bool backward = true, const Tensor* seg_ids = nullptr) {
  ImplScope scope(impl);
  const std::string what = fmt::format("attention[{}] B={} T={} Hq={} Hk={} D={}{}", impl, c.B, c.T,
                                       c.Hq, c.Hk, c.D, c.packed ? " packed" : "");
  Tensor q = rounded(randn({c.B, c.T, c.Hq, c.D}, g), dt);
  Tensor k = rounded(randn({c.B, c.T, c.Hk, c.D}, g), dt);
  Tensor v = rounded(randn({c.B, c.T, c.Hk, c.D}, g), dt);
  Tensor seg = !c.packed ? Tensor() : seg_ids ? *seg_ids : segments(c.B, c.T);
  Tensor out = Tensor::empty(q.shape(), DType::F32),
         lse = Tensor::empty({c.B, c.Hq, c.T}, DType::F32);
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
      {3, 33, 2, 1, 32, false}, {1, 70, 3, 3, 96, true},   {1, 40, 2, 2, 256, false},
  };
  for (const auto& c : cases) check_attention("reference", c, DType::BF16, g);
}

// Edge shapes for the tensor-core paths: lengths around the tiles (1, 63, 64, 65, 127, 4097),
// GQA groups 1/4/8, batch > 1.
const AttnCase kEdgeCases[] = {
    {2, 63, 4, 4, 64, false},   {1, 64, 8, 1, 128, false},  {3, 65, 8, 2, 64, false},
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

// Packed rows as cuDNN ragged batches: segments of length 1 to 64 crossing every tile, each head
// dim, GQA groups 1 to 8; then two segment layouts of one shape in turn (the run table is read per
// seg tensor, never reused for another).
TEST(OpHarness, AttentionCudnnPacked) {
  RIG_REQUIRE_GPU();
  std::string why;
  if (!ops::cuda::sdpa_cudnn::ragged_supported(0, &why)) GTEST_SKIP() << why;
  std::mt19937 g(13);
  const AttnCase packed[] = {
      {2, 111, 6, 2, 64, true}, {1, 300, 4, 4, 128, true},  {3, 97, 8, 1, 80, true},
      {2, 129, 4, 2, 96, true}, {1, 1000, 8, 2, 128, true},
  };
  for (const auto& c : packed) check_attention("cudnn", c, DType::BF16, g);
  const AttnCase shape{2, 200, 4, 2, 64, true};
  std::vector<int64_t> halves(400);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = int64_t(i % 200 >= 120);
  const Tensor layouts[] = {segments(2, 200), test::ints(halves, {2, 200})};
  for (const Tensor& seg : layouts) check_attention("cudnn", shape, DType::BF16, g, true, &seg);
  // One seg storage read as [2, 100], then as [1, 200]: two runs, then one run over both rows.
  ImplScope scope("cudnn");
  const Tensor dseg = gpu(test::ints(std::vector<int64_t>(200, 0), {2, 100}));
  const Tensor q = rounded(randn({2, 100, 4, 64}, g), DType::BF16);
  const Tensor k = rounded(randn({2, 100, 2, 64}, g), DType::BF16);
  const Tensor v = rounded(randn({2, 100, 2, 64}, g), DType::BF16);
  for (const int64_t B : {2, 1}) {
    const int64_t T = 200 / B;
    const Tensor qb = q.reshape({B, T, 4, 64}), kb = k.reshape({B, T, 2, 64}),
                 vb = v.reshape({B, T, 2, 64});
    Tensor out = Tensor::empty(qb.shape(), DType::F32), lse = Tensor::empty({B, 4, T}, DType::F32);
    ops::attention_forward(qb, kb, vb, test::ints(std::vector<int64_t>(200, 0), {B, T}), out, lse);
    Tensor dout = gpu(nans(qb.shape()), DType::BF16), dlse = gpu(nans({B, 4, T}));
    ops::attention_forward(gpu(qb, DType::BF16), gpu(kb, DType::BF16), gpu(vb, DType::BF16),
                           dseg.reshape({B, T}), dout, dlse);
    EXPECT_CLOSE(host(dout), out, DType::BF16, fmt::format("one seg storage as [{}, {}]", B, T));
  }
}

TEST(OpHarness, AttentionFlash) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(11);
  check_attention("flash", {2, 1, 4, 2, 64, false}, DType::BF16, g);
  for (const auto& c : kEdgeCases) check_attention("flash", c, DType::BF16, g);
  // Packed segments (lengths 1 to 64, crossing tile boundaries) and every head dim.
  const AttnCase packed[] = {
      {2, 111, 6, 2, 64, true}, {1, 300, 4, 4, 128, true},  {3, 97, 8, 1, 80, true},
      {2, 129, 4, 2, 96, true}, {1, 1000, 8, 2, 128, true},
  };
  for (const auto& c : packed) check_attention("flash", c, DType::BF16, g);
}

// What "auto" picks: cuDNN for plain causal bf16; for packed segments the flash kernel at head_dim
// 64 and cuDNN's ragged batches above (where the runtime has them, else the flash kernel); the
// reference kernel for float32.
TEST(OpHarness, AttentionAutoPicksTheFastestThatApplies) {
  RIG_REQUIRE_GPU();
  std::mt19937 g(12);
  std::string why;
  check_attention("auto", {1, 128, 4, 2, 64, true}, DType::BF16, g);
  EXPECT_EQ(ops::cuda::last_attention_impl(false), "flash");
  check_attention("auto", {1, 128, 4, 2, 128, true}, DType::BF16, g);
  EXPECT_EQ(ops::cuda::last_attention_impl(false),
            ops::cuda::sdpa_cudnn::ragged_supported(0, &why) ? "cudnn" : "flash");
  check_attention("auto", {1, 128, 4, 2, 64, false}, DType::F32, g);
  EXPECT_EQ(ops::cuda::last_attention_impl(false), "reference");
  check_attention("auto", {1, 128, 4, 2, 64, false}, DType::BF16, g);
  if (ops::cuda::sdpa_cudnn::runtime_version() >= 90000)
    EXPECT_EQ(ops::cuda::last_attention_impl(false), "cudnn");
  ImplScope scope("cudnn");
  Tensor q = Tensor::zeros({1, 8, 2, 64}, DType::BF16, Device::cuda(0));
  Tensor o = Tensor::zeros({1, 8, 2, 64}, DType::BF16, Device::cuda(0));
  Tensor l = Tensor::zeros({1, 2, 8}, DType::F32, Device::cuda(0));
  // An id that comes back after another cannot be a ragged batch entry: forced cuDNN says so.
  Tensor seg = gpu(test::ints({0, 0, 1, 1, 0, 0, 2, 2}, {1, 8}));
  try {
    ops::attention_forward(q, q, q, seg, o, l);
    ADD_FAILURE() << "forced cuDNN ran a segment id that comes back";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("declined the call"), std::string::npos) << e.what();
  }
  // A shape cuDNN declines (head_dim 4): forced, an error that says why; auto falls back.
  if (ops::cuda::sdpa_cudnn::runtime_version() < 90000) return;
  Tensor q4 = Tensor::zeros({1, 8, 2, 4}, DType::BF16, Device::cuda(0));
  Tensor o4 = Tensor::zeros({1, 8, 2, 4}, DType::BF16, Device::cuda(0));
  try {
    ops::attention_forward(q4, q4, q4, Tensor(), o4, l);
    ADD_FAILURE() << "forced cuDNN ran head_dim 4";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("RIG_ATTENTION=cudnn but it declined the call: head_dim 4"),
        std::string::npos)
        << e.what();
  }
  ImplScope automatic("auto");
  ops::attention_forward(q4, q4, q4, Tensor(), o4, l);
  EXPECT_EQ(ops::cuda::last_attention_impl(false), "reference");
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
        EXPECT_EQ(nerr(res[size_t(i)], res[size_t(i + 3)]), 0.0)
            << impl << (packed ? " packed" : "") << " grad " << i;
    }
  }
  ops::set_deterministic(false);
}

#endif  // RIG_WITH_CUDA

}  // namespace
}  // namespace rig
