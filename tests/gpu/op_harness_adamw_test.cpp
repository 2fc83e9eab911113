// AdamW on the GPU against the CPU over several steps: one tensor, the multi-tensor list, 8-bit.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../op_cases.h"
#include "op_harness_test_util.h"
#include "rig/core/tensor.h"
#include "rig/ops/adamw8bit.h"
#include "rig/ops/ops.h"

namespace rig {
namespace {

using namespace test::op_harness;
// The generic harness's input makers.
using test::randn;

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
