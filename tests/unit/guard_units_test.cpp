// The guard's pieces: the weight hash, the NaN/Inf counts, injection specs and the spike rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "rig/core/dtype.h"
#include "rig/ops/ops.h"
#include "rig/train/guard.h"
#include "rig/train/trainer.h"

using namespace rig;

TEST(GuardOps, HashMatchesAReferenceAndSeesEveryBit) {
  // The definition of ops/guard_hash.h written out plainly: word i of tensor t (little-endian
  // 32 bits, the last one zero-padded) adds mix(((i << 32) | w) ^ mix(t + C)).
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  auto reference = [&](const std::vector<Tensor>& ts) {
    uint64_t h = 0;
    for (size_t t = 0; t < ts.size(); ++t) {
      const uint64_t base = mix(t + 0x5851f42d4c957f2dULL);
      std::vector<uint8_t> bytes(static_cast<const uint8_t*>(ts[t].raw()),
                                 static_cast<const uint8_t*>(ts[t].raw()) + ts[t].nbytes());
      while (bytes.size() % 4) bytes.push_back(0);
      for (size_t i = 0; i < bytes.size() / 4; ++i) {
        const uint64_t w = uint64_t(bytes[4 * i]) | uint64_t(bytes[4 * i + 1]) << 8 |
                           uint64_t(bytes[4 * i + 2]) << 16 | uint64_t(bytes[4 * i + 3]) << 24;
        h += mix(((uint64_t(i) << 32) | w) ^ base);
      }
    }
    return h;
  };
  std::vector<float> v(100003);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(float(i)) * 0.02f;
  Tensor a = Tensor::from_f32(v, {int64_t(v.size())});
  Tensor b = a.to_dtype(DType::BF16);
  Tensor odd = b.slice_rows(1, 4);  // 3 BF16 values at an odd offset: a padded, unaligned word
  const std::vector<Tensor> list = {a, b, odd};
  EXPECT_EQ(ops::hash64(list), reference(list));
  EXPECT_EQ(ops::hash64({odd}), reference({odd}));
  // Every single flipped bit changes it; the order of the list matters.
  const uint64_t h = ops::hash64({a});
  for (int bit : {0, 7, 22, 30, 31}) {
    Tensor c = a.clone();
    reinterpret_cast<uint32_t*>(c.raw())[77777] ^= 1u << bit;
    EXPECT_NE(ops::hash64({c}), h) << "bit " << bit;
  }
  EXPECT_NE(ops::hash64({a, b}), ops::hash64({b, a}));
}

TEST(GuardOps, CountsNanInfAndImplausibleValues) {
  Tensor a = Tensor::from_f32({1.0f, -2.5f, 1e9f, 0.0f}, {4});
  EXPECT_TRUE(ops::all_finite({a}));
  EXPECT_EQ(ops::count_bad_values({a}, 1e8), 1);
  a.f32()[3] = std::nanf("");
  Tensor b = Tensor::from_f32({INFINITY, -INFINITY, 3.0f}, {3}).to_dtype(DType::BF16);
  EXPECT_EQ(ops::count_bad_values({a, b}), 3);
  EXPECT_FALSE(ops::all_finite({b}));
  EXPECT_EQ(ops::count_bad_values({Tensor::zeros({5}, DType::I64)}), 0);
  // The bit-flip fault: one high exponent bit of element numel/2.
  Tensor w = Tensor::from_f32({0.5f, 0.5f, 0.0123f, 0.5f}, {4});
  auto [was, is] = flip_high_exponent_bit(w);
  EXPECT_EQ(was, 0.0123f);
  EXPECT_EQ(double(is), double(was) * std::ldexp(1.0, 128));  // 2^128 larger
  EXPECT_EQ(ops::count_bad_values({w}, kImplausibleWeight), 1);
}

TEST(GuardUnits, InjectionSpecs) {
  Injection i = parse_injection("bit-flip@40:1", "x");
  EXPECT_EQ(i.kind, FaultKind::BitFlip);
  EXPECT_EQ(i.step, 40);
  EXPECT_EQ(i.rank, 1);
  EXPECT_EQ(parse_injection("kill@3", "x").rank, 0);
  auto error = [](const std::string& spec) {
    try {
      parse_injection(spec, "cfg.yaml: 'inject'");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("nan-grads@3").find("did you mean 'nan-grad'"), std::string::npos);
  EXPECT_NE(error("kill").find("KIND@STEP"), std::string::npos);
  EXPECT_NE(error("kill@0").find("from 1"), std::string::npos);
  EXPECT_NE(error("kill@2:x").find("rank"), std::string::npos);
  EXPECT_NE(error("kill@2:").find("rank"), std::string::npos);
  // In a config: checked at load, named by file and key, kept in the resolved config (which
  // reads back), out of the hash.
  const std::string base =
      "init: random\narchitecture: tiny\ntokenizer: t.json\n"
      "datasets: [d.jsonl]\nmax_steps: 5\n";
  try {
    parse_train_config(base + "inject: [kill@2, bitflip@3]\n", "run.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("run.yaml:6: 'inject.1'"), std::string::npos) << e.what();
  }
  TrainConfig c = parse_train_config(
      base + "inject: [kill@2, 'bit-flip@3:1']\nguard: {spike_k: 5}\n", "run.yaml");
  EXPECT_EQ(c.inject, (std::vector<std::string>{"kill@2", "bit-flip@3:1"}));
  TrainConfig back = parse_train_config(c.to_yaml(), "back.yaml");
  EXPECT_EQ(back.inject, c.inject);
  EXPECT_EQ(back.guard.spike_k, 5);
  EXPECT_EQ(back.config_hash(), parse_train_config(base, "plain.yaml").config_hash());
  try {
    parse_train_config(base + "guard: {spike_warmup: 200}\n", "run.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("guard.spike_warmup"), std::string::npos) << e.what();
  }
  // Several injections of one kind and step hit successive attempts; a rank beyond the world is
  // an error.
  Injector inj({"nan-grad@3", "nan-grad@3", "kill-during-save@4"}, 2, "x");
  EXPECT_FALSE(inj.take(FaultKind::NanGrad, 2));
  EXPECT_TRUE(inj.take(FaultKind::NanGrad, 3));
  EXPECT_TRUE(inj.take(FaultKind::NanGrad, 3));
  EXPECT_FALSE(inj.take(FaultKind::NanGrad, 3));
  EXPECT_FALSE(inj.take(FaultKind::KillDuringSave, 3, true));
  EXPECT_TRUE(inj.take(FaultKind::KillDuringSave, 6, true));  // the first checkpoint at or after 4
  EXPECT_THROW(Injector({"kill@3:2"}, 2, "x"), InputError);
}

TEST(GuardUnits, SpikeRuleOnMedianAndMad) {
  // History 1, 2, 3, 4, 100: median 3, absolute deviations 2, 1, 0, 1, 97 -> MAD 1.
  EXPECT_EQ(median_of({1, 2, 3, 4, 100}), 3);
  EXPECT_EQ(mad_of({1, 2, 3, 4, 100}, 3), 1);
  EXPECT_EQ(median_of({4, 1, 3, 2}), 2.5);
  SpikeDetector d(SpikeRule{5, 5, 8, 1.5, 10});
  for (double x : {1, 2, 3, 4}) {
    d.record(x, 1.0);
    EXPECT_FALSE(d.check(1e9, 1.0)) << "armed only after 5 steps";
  }
  d.record(100, 1.0);
  // Loss: max(3 + 8 * 1.4826 * 1, 1.5 * 3) = 14.8608.
  EXPECT_FALSE(d.check(14.86, 1.0));
  auto s = d.check(14.87, 1.0);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->metric, "loss");
  EXPECT_NEAR(s->threshold, 14.8608, 1e-9);
  // Gradient norm: all 1.0, MAD 0: the ratio decides, 10 x 1.0.
  EXPECT_FALSE(d.check(2.0, 10.0));
  ASSERT_TRUE(d.check(2.0, 10.01));
  EXPECT_EQ(d.check(2.0, 10.01)->metric, "grad_norm");
  // The window keeps the last 5; the history survives a checkpoint.
  d.record(5, 1.0);
  SpikeDetector e(SpikeRule{5, 5, 8, 1.5, 10});
  e.from_json(d.to_json());
  EXPECT_EQ(e.size(), 5u);
  EXPECT_EQ(e.to_json(), d.to_json());
}
