// The multi-tensor AdamW pass (ops::adamw_step_list) against what it replaces: clip_grad_norm_'s
// in-place scaling, one adamw_step per tensor with its own weight decay, and a cast to the
// compute copy.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "rig/ops/ops.h"
#include "test_util.h"

using namespace rig;

namespace {

Tensor randn(int64_t n, std::mt19937& g, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  Tensor t = Tensor::empty({n}, DType::F32);
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = d(g);
  return t;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

TEST(AdamWList, EqualsClipThenOneStepPerTensor) {
  std::mt19937 g(3);
  const std::vector<int64_t> sizes = {1, 4095, 4097, 9000};
  const std::vector<float> decays = {0.0f, 0.1f, 0.01f, 0.0f};
  for (float coef : {1.0f, 0.37f}) {
    std::vector<ops::AdamWSlot> slots;
    std::vector<Tensor> p_ref, g_ref, m_ref, v_ref, g_before;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t n = sizes[i];
      ops::AdamWSlot s;
      s.param = randn(n, g, 1.0f);
      s.grad = randn(n, g, 0.1f);
      s.m = randn(n, g, 0.01f);
      s.v = randn(n, g, 0.001f);
      for (int64_t j = 0; j < n; ++j) s.v.f32()[j] *= s.v.f32()[j];  // second moments are >= 0
      if (i % 2 == 0) s.copy = Tensor::empty({n}, DType::BF16);
      s.weight_decay = decays[i];
      p_ref.push_back(s.param.clone());
      g_ref.push_back(s.grad.clone());
      g_before.push_back(s.grad.clone());
      m_ref.push_back(s.m.clone());
      v_ref.push_back(s.v.clone());
      slots.push_back(s);
    }
    for (int64_t step = 1; step <= 2; ++step) {
      const ops::AdamWParams h{1e-2f, 0.9f, 0.95f, 1e-8f, 123.0f /* not used */, step};
      ops::adamw_step_list(slots, h, coef);
      for (size_t i = 0; i < sizes.size(); ++i) {
        Tensor gi = g_ref[i].clone();
        if (coef < 1.0f) ops::scale_(gi, coef);
        ops::AdamWParams hi = h;
        hi.weight_decay = decays[i];
        ops::adamw_step(p_ref[i], gi, m_ref[i], v_ref[i], hi);
      }
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::string what = "tensor " + std::to_string(i) + " coef " + std::to_string(coef);
      EXPECT_TRUE(same_bits(slots[i].param, p_ref[i])) << what;
      EXPECT_TRUE(same_bits(slots[i].m, m_ref[i])) << what;
      EXPECT_TRUE(same_bits(slots[i].v, v_ref[i])) << what;
      EXPECT_TRUE(same_bits(slots[i].grad, g_before[i])) << what << ": the gradient was written";
      if (slots[i].copy.defined()) {
        Tensor c = Tensor::empty({sizes[i]}, DType::BF16);
        ops::cast(p_ref[i], c);
        EXPECT_TRUE(same_bits(slots[i].copy, c)) << what;
      }
    }
  }
}

TEST(AdamWList, RejectsMismatchedSlots) {
  ops::AdamWSlot s{Tensor::zeros({8}, DType::F32),
                   Tensor::zeros({7}, DType::F32),
                   Tensor::zeros({8}, DType::F32),
                   Tensor::zeros({8}, DType::F32),
                   Tensor(),
                   0.0f};
  std::vector<ops::AdamWSlot> slots{s};
  EXPECT_THROW(ops::adamw_step_list(slots, {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1}, 1.0f), Error);
}
