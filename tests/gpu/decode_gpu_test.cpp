// Generation on the GPU: the KV cache on the device in the compute dtype and the cache attention
// kernel, against the CPU model's decode (the float32 oracle) on the tiny fixtures. Skipped with
// the reason when no GPU is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "rig/model/llama.h"
#include "rig/train/trainer.h"

using namespace rig;

namespace {

std::string data(const std::string& rel) {
  const char* env = std::getenv("RIG_TEST_DATA");
  return std::string(env ? env : RIG_TEST_DATA) + "/" + rel;
}

struct Diff {
  double normalised = 0, max_abs = 0;
};
Diff diff(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  Diff d;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = double(got[i]) - want[i];
    num += e * e;
    den += double(want[i]) * want[i];
    d.max_abs = std::max(d.max_abs, std::fabs(e));
  }
  d.normalised = std::sqrt(num / std::max(den, 1e-30));
  return d;
}
// The gap between the largest and the second largest logit.
double top_margin(std::vector<float> x) {
  std::partial_sort(x.begin(), x.begin() + 2, x.end(), std::greater<>());
  return double(x[0]) - x[1];
}

using DecodeParam = std::tuple<std::string, DType>;
class GpuDecode : public ::testing::TestWithParam<DecodeParam> {};

}  // namespace

// float32 on the GPU computes what the CPU computes up to summation order (cuBLASLt in true fp32,
// no TF32): logits within 1e-5 normalised error. bf16 rounds the weights, activations and the
// cache to 8 significant bits (2^-9 relative each); over two layers that compounds to ~1e-2 of
// the logits, as the bf16 training forward (train_gpu_test.cpp), so 2e-2. A wrong cache row,
// position or head is off by far more. Greedy tokens must agree wherever the CPU's top-two gap
// is wider than twice the step's largest logit difference; a closer gap is a tie within the
// precision (the tiny fixtures are random models whose top logits can lie close together), and
// tokens after it may differ legitimately, so they are compared up to the first such step,
// which is printed.
TEST_P(GpuDecode, LogitsAndGreedyTokensMatchTheCpuModel) {
  if (!cuda_available())
    GTEST_SKIP() << "no CUDA GPU visible: GPU decode tests run on a GPU machine";
  const auto& [fixture, dt] = GetParam();
  const std::string dir = data("hf/" + fixture + "/model");
  auto cpu = LlamaModel::load(dir), gpu = LlamaModel::load(dir);
  gpu->to_device(Device::cuda(0));
  gpu->set_compute_dtype(dt);
  const double tol = dt == DType::F32 ? 1e-5 : 2e-2;
  const char* dts = dt == DType::F32 ? "F32" : "BF16";
  std::mt19937 rng(5);
  std::vector<int32_t> prompt(11);
  for (auto& t : prompt) t = int32_t(rng() % uint32_t(cpu->config().vocab_size));
  GenerateOptions o;
  o.max_new_tokens = 6;
  const std::vector<int32_t> want = generate(*cpu, prompt, o), got = generate(*gpu, prompt, o);
  ASSERT_EQ(want.size(), size_t(6));
  ASSERT_EQ(got.size(), want.size());

  // Replays the CPU's tokens through both models (the prompt in one call), step by step.
  auto cc = cpu->new_cache(32), gc = gpu->new_cache(32);
  ASSERT_TRUE(gc.k[0].device().is_cuda());
  ASSERT_EQ(gc.k[0].dtype(), dt);
  std::vector<int64_t> feed(prompt.begin(), prompt.end());
  size_t agree_until = want.size();
  double worst = 0;
  for (size_t s = 0; s < want.size(); ++s) {
    const std::vector<float> c = cpu->decode(cc, feed), g = gpu->decode(gc, feed);
    const Diff d = diff(g, c);
    EXPECT_LT(d.normalised, tol) << "step " << s;
    worst = std::max(worst, d.normalised);
    const double margin = top_margin(c);
    if (margin <= 2 * d.max_abs && agree_until == want.size()) {
      agree_until = s;
      std::printf(
          "%s %s: step %zu is a tie within the precision (top-two gap %.3g, max |diff| %.3g)\n",
          fixture.c_str(), dts, s, margin, d.max_abs);
    }
    feed = {want[s]};
  }
  EXPECT_EQ(gc.len, cc.len);
  for (size_t s = 0; s < agree_until; ++s) EXPECT_EQ(got[s], want[s]) << "token " << s;
  std::printf(
      "%s %s decode: worst normalised logit error %.2e; greedy tokens compared: %zu of %zu\n",
      fixture.c_str(), dts, worst, agree_until, want.size());
}

INSTANTIATE_TEST_SUITE_P(TinyModels, GpuDecode,
                         ::testing::Combine(::testing::Values("tiny-llama3", "tiny-qwen2", "tiny-qwen3"),
                                            ::testing::Values(DType::F32, DType::BF16)),
                         [](const ::testing::TestParamInfo<DecodeParam>& p) {
                           return std::get<0>(p.param).substr(5) + "_" +
                                  (std::get<1>(p.param) == DType::F32 ? "F32" : "BF16");
                         });
