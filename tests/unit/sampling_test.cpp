// Temperature and nucleus (top-p) sampling against the closed-form distribution, and the range
// checks on the generation settings.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "rig/core/error.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;

TEST(Sampling, FrequenciesFollowTheTruncatedSoftmax) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 1.0f, 0.0f};
  for (auto [temp, top_p] : std::vector<std::pair<float, float>>{{0.7f, 0.8f}, {1.0f, 1.0f},
                                                                 {1.5f, 0.5f}}) {
    // Closed form: softmax at temp, sorted; the smallest prefix whose mass reaches top_p.
    std::vector<std::pair<double, int>> p;
    double sum = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      p.emplace_back(std::exp(double(logits[i]) / temp), int(i));
      sum += p.back().first;
    }
    std::sort(p.rbegin(), p.rend());
    std::map<int, double> want;
    double kept = 0;
    for (const auto& [e, i] : p) {
      if (kept >= top_p * sum) break;
      want[i] = e;
      kept += e;
    }
    for (auto& [i, e] : want) e /= kept;
    std::mt19937_64 rng(5);
    const int n = 200000;
    std::map<int, int> got;
    for (int s = 0; s < n; ++s) got[sample_token(logits, temp, top_p, rng)]++;
    for (const auto& [i, c] : got) EXPECT_TRUE(want.count(i)) << "token " << i << " is outside the nucleus";
    for (const auto& [i, q] : want) {
      const double f = double(got[i]) / n, sd = std::sqrt(q * (1 - q) / n);
      EXPECT_NEAR(f, q, 5 * sd) << "token " << i << " at temperature " << temp << ", top-p " << top_p;
    }
  }
}

TEST(Sampling, GreedyAndTinyNucleusTakeTheArgmax) {
  const std::vector<float> logits = {0.1f, 3.0f, 2.9f};
  std::mt19937_64 rng(1);
  EXPECT_EQ(sample_token(logits, 0.0f, 1.0f, rng), 1);
  for (int s = 0; s < 100; ++s) EXPECT_EQ(sample_token(logits, 1.0f, 1e-6f, rng), 1);
}

TEST(Sampling, SettingsOutOfRangeAreClearErrors) {
  auto error_of = [](float temp, float top_p, int64_t max_new) {
    GenerateOptions o;
    o.temperature = temp;
    o.top_p = top_p;
    o.max_new_tokens = max_new;
    try {
      check_generate_options(o);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(error_of(0.7f, 0.9f, 10), "");
  EXPECT_NE(error_of(0.7f, 0.0f, 10).find("--top-p"), std::string::npos);
  EXPECT_NE(error_of(0.7f, 1.5f, 10).find("--top-p"), std::string::npos);
  EXPECT_NE(error_of(0.7f, nan, 10).find("--top-p"), std::string::npos);
  EXPECT_NE(error_of(nan, 0.9f, 10).find("--temperature"), std::string::npos);
  EXPECT_NE(error_of(inf, 0.9f, 10).find("--temperature"), std::string::npos);
  EXPECT_NE(error_of(-1.0f, 0.9f, 10).find("--temperature"), std::string::npos);
  EXPECT_NE(error_of(0.0f, 1.0f, -1).find("--max-new-tokens"), std::string::npos);
  // The CLI checks the flags before it loads anything.
  auto r = test::run_rig("generate --model /nonexistent --prompt hi --temperature 0.7 --top-p 0");
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.out, "rig generate: --top-p must be a finite number in (0, 1], got 0\n");
}
