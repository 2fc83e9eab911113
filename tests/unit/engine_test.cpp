// The engine beyond the fixtures: random configurations against finite differences, the
// 300-step loss curve, adapters that round-trip, packing boundaries.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "hf_reference.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/ops/segment_runs.h"
#include "rig/optim/adamw.h"
#include "test_util.h"

using namespace rig;

namespace {

ModelConfig make_config(int64_t hidden, int64_t heads, int64_t kv, int64_t head_dim, int64_t inter,
                        int64_t vocab, bool tied, bool qkv_bias, const std::string& rope) {
  nlohmann::json j = {{"model_type", qkv_bias ? "qwen2" : "llama"},
                      {"vocab_size", vocab},
                      {"hidden_size", hidden},
                      {"intermediate_size", inter},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", heads},
                      {"num_key_value_heads", kv},
                      {"head_dim", head_dim},
                      {"rms_norm_eps", 1e-5},
                      {"tie_word_embeddings", tied}};
  if (rope == "llama3")
    j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                            {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 64}};
  return ModelConfig::from_json(j, "test");
}

TokenBatch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64), {}, {}};
  for (int64_t i = 0; i < B * T; ++i) {
    b.input_ids.data<int64_t>()[i] = int64_t(rng() % uint64_t(vocab));
    b.labels.data<int64_t>()[i] = (rng() % 5 == 0) ? -100 : b.input_ids.data<int64_t>()[i];
  }
  return b;
}

// Perturbs the weights away from their init so that biases and norms matter.
void perturb(LlamaModel& m, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.3f);
  for (auto& p : m.params())
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.f32()[i] += n(rng) * (p.value.ndim() == 1 ? 1.0f : 0.2f);
}

// Central differences in double-checked float: compares the analytic gradient with the
// numerical one for a few coordinates of every parameter tensor.
void check_finite_differences(LlamaModel& m, const TokenBatch& b, Checkpointing ck) {
  m.zero_grad();
  StepOptions opt;
  opt.checkpointing = ck;
  m.step(b, opt);
  std::mt19937_64 rng(7);
  StepOptions fwd;
  fwd.backward = false;
  int checked = 0;
  for (auto& p : m.params()) {
    if (!p.trainable) continue;
    for (int trial = 0; trial < 3; ++trial) {
      int64_t i = int64_t(rng() % uint64_t(p.value.numel()));
      float* x = p.value.f32() + i;
      const float orig = *x, h = 1e-2f * std::max(1.0f, std::fabs(orig));
      *x = orig + h;
      double lp = m.step(b, fwd).loss();
      *x = orig - h;
      double lm = m.step(b, fwd).loss();
      *x = orig;
      double num = (lp - lm) / (2.0 * h);
      double ana = p.grad.f32()[i];
      EXPECT_NEAR(ana, num, 2e-3 + 3e-2 * std::fabs(num)) << p.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

}  // namespace

struct FdCase {
  const char* name;
  int64_t hidden, heads, kv, head_dim, inter, vocab;
  bool tied, bias;
  const char* rope;
};

class FiniteDifference : public ::testing::TestWithParam<FdCase> {};

TEST_P(FiniteDifference, FullGradients) {
  const FdCase& c = GetParam();
  auto m = LlamaModel::random(make_config(c.hidden, c.heads, c.kv, c.head_dim, c.inter, c.vocab, c.tied, c.bias, c.rope), 3);
  perturb(*m, 5);
  check_finite_differences(*m, random_batch(2, 7, c.vocab, 11), Checkpointing::None);
}

TEST_P(FiniteDifference, LoraGradientsWithCheckpointing) {
  const FdCase& c = GetParam();
  auto m = LlamaModel::random(make_config(c.hidden, c.heads, c.kv, c.head_dim, c.inter, c.vocab, c.tied, c.bias, c.rope), 3);
  perturb(*m, 5);
  LoraConfig lc;
  lc.r = 3;
  lc.alpha = 5;
  lc.targets = {"q_proj", "v_proj", "down_proj", "gate_proj"};
  m->add_lora(lc, 9);
  // B starts at zero; make it non-zero so A's gradient is non-trivial.
  perturb(*m, 6);
  check_finite_differences(*m, random_batch(2, 9, c.vocab, 12), Checkpointing::Full);
}

INSTANTIATE_TEST_SUITE_P(
    RandomConfigs, FiniteDifference,
    ::testing::Values(FdCase{"gqa_odd", 30, 3, 1, 10, 37, 53, false, false, "llama3"},  // MQA
                      FdCase{"mha_tied", 24, 2, 2, 12, 40, 61, true, false, "default"},
                      FdCase{"bias_gqa", 36, 6, 2, 6, 22, 29, true, true, "default"},
                      FdCase{"wide_heads", 16, 2, 1, 14, 18, 41, false, true, "llama3"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Engine, PackedSegmentsEqualSeparateSequences) {
  // Two samples packed into one row with restarting positions must give the same loss and
  // gradients as the two samples in their own rows.
  auto cfg = make_config(32, 4, 2, 8, 48, 50, false, false, "default");
  auto m = LlamaModel::random(cfg, 1);
  perturb(*m, 2);
  TokenBatch sep = random_batch(2, 6, 50, 3);
  for (int64_t i = 0; i < 12; ++i) sep.labels.data<int64_t>()[i] = sep.input_ids.data<int64_t>()[i];
  TokenBatch packed{Tensor::empty({1, 12}, DType::I64), Tensor::empty({1, 12}, DType::I64),
                    Tensor::empty({1, 12}, DType::I64), Tensor::empty({1, 12}, DType::I64)};
  for (int64_t i = 0; i < 12; ++i) {
    packed.input_ids.data<int64_t>()[i] = sep.input_ids.data<int64_t>()[i];
    // The first label of the second sample must not be predicted from the first sample.
    packed.labels.data<int64_t>()[i] = i == 6 ? -100 : sep.labels.data<int64_t>()[i];
    packed.position_ids.data<int64_t>()[i] = i % 6;
    packed.segment_ids.data<int64_t>()[i] = i / 6;
  }
  m->zero_grad();
  auto r1 = m->step(sep, StepOptions{});
  std::vector<Tensor> g1;
  for (auto& p : m->params()) g1.push_back(p.grad.clone());
  m->zero_grad();
  auto r2 = m->step(packed, StepOptions{});
  EXPECT_EQ(r1.tokens, r2.tokens);
  EXPECT_NEAR(r1.loss(), r2.loss(), 1e-5);
  for (size_t i = 0; i < g1.size(); ++i)
    for (int64_t j = 0; j < g1[i].numel(); ++j)
      ASSERT_NEAR(g1[i].f32()[j], m->params()[i].grad.f32()[j], 1e-5 + 1e-4 * std::fabs(g1[i].f32()[j]))
          << m->params()[i].name;
}

TEST(Engine, LossCurveFollowsTransformersFor300Steps) {
  const std::string dir = test::data_path("hf/tiny-llama3/");
  auto ref = nlohmann::json::parse(read_file(dir + "loss_curve.json"));
  const int64_t steps = ref["steps"];
  auto m = LlamaModel::load(dir + "model");
  const double worst =
      test::replay_loss_curve(*m, dir, [](int64_t s, double rel, double loss, double want) {
        const double tol = s < 50 ? 1e-3 : 1e-2;
        EXPECT_LT(rel, tol) << "step " << s << ": " << loss << " vs " << want;
        return rel < tol;
      });
  std::printf("loss curve: worst relative difference over %lld steps %.2e\n", (long long)steps, worst);
  // The model learned: the last losses are well below the first.
  EXPECT_LT(ref["losses"][size_t(steps - 1)].get<double>(), ref["losses"][0].get<double>() - 0.5);
}

TEST(Engine, AdapterRoundTripAndMerge) {
  const std::string model = test::data_path("hf/tiny-qwen2/model");
  auto m = LlamaModel::load(model);
  m->load_adapter(test::data_path("hf/tiny-qwen2/lora_adapter"));
  std::string dir = test::temp_dir("adapter_rt");
  m->save_adapter(dir + "/adapter");
  auto m2 = LlamaModel::load(model);
  m2->load_adapter(dir + "/adapter");
  TokenBatch b = random_batch(2, 8, m->config().vocab_size, 4);
  StepOptions fwd;
  fwd.backward = false;
  Tensor l1, l2, l3;
  fwd.logits = &l1;
  m->step(b, fwd);
  fwd.logits = &l2;
  m2->step(b, fwd);
  EXPECT_EQ(0, std::memcmp(l1.raw(), l2.raw(), l1.nbytes()));
  // Merging folds the adapter into the base weights: same logits within float rounding.
  m2->merge_lora();
  m2->save_pretrained(dir + "/merged");
  auto m3 = LlamaModel::load(dir + "/merged");
  EXPECT_FALSE(m3->has_lora());
  fwd.logits = &l3;
  m3->step(b, fwd);
  double maxdiff = 0;
  for (int64_t i = 0; i < l1.numel(); ++i) maxdiff = std::max(maxdiff, double(std::fabs(l1.f32()[i] - l3.f32()[i])));
  EXPECT_LT(maxdiff, 1e-4);
}

TEST(Engine, GenerateWithCacheMatchesFullForward) {
  auto m = LlamaModel::load(test::data_path("hf/tiny-llama3/model"));
  TokenBatch b = random_batch(1, 10, m->config().vocab_size, 8);
  Tensor logits;
  StepOptions fwd;
  fwd.backward = false;
  fwd.logits = &logits;
  m->step(b, fwd);
  auto cache = m->new_cache(16);
  std::vector<int64_t> ids(b.input_ids.data<int64_t>(), b.input_ids.data<int64_t>() + 10);
  // Prompt in two pieces to exercise appending to the cache.
  m->decode(cache, std::vector<int64_t>(ids.begin(), ids.begin() + 4));
  std::vector<float> last = m->decode(cache, std::vector<int64_t>(ids.begin() + 4, ids.end()));
  const int64_t V = m->config().vocab_size;
  for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(last[size_t(v)], logits.f32()[9 * V + v], 1e-4);
}

// A prompt prefilled in one call (its tokens as rows of one batch through every layer) against
// the same prompt fed one token at a time, then one more token after each: the same float32
// operations, but products of n rows instead of n products of one row, which OpenBLAS may block
// and sum in another order: differences of a few float32 roundings of the logits (|logit| ~ 1),
// far under 1e-5, while a wrong position, cache row or causal bound moves them by ~1e-1.
TEST(Engine, PrefillInOneCallMatchesTokenByToken) {
  for (const char* fixture : {"tiny-llama3", "tiny-qwen2", "tiny-qwen3"}) {
    SCOPED_TRACE(fixture);
    auto m = LlamaModel::load(test::data_path(std::string("hf/") + fixture + "/model"));
    TokenBatch b = random_batch(1, 13, m->config().vocab_size, 21);
    const std::vector<int64_t> ids(b.input_ids.data<int64_t>(), b.input_ids.data<int64_t>() + 13);
    const std::vector<int64_t> prompt(ids.begin(), ids.end() - 1);
    auto one = m->new_cache(16), steps = m->new_cache(13);
    std::vector<float> a = m->decode(one, prompt), c;
    for (int64_t t : prompt) c = m->decode(steps, {t});
    EXPECT_EQ(one.len, 12);
    EXPECT_EQ(steps.len, 12);
    auto near = [](const std::vector<float>& x, const std::vector<float>& y) {
      double worst = 0;
      for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, double(std::fabs(x[i] - y[i])));
      return worst;
    };
    EXPECT_LT(near(a, c), 1e-5);
    EXPECT_LT(near(m->decode(one, {ids.back()}), m->decode(steps, {ids.back()})), 1e-5);
    // A different last token gives different logits (the comparison can fail).
    auto other = m->new_cache(13);
    std::vector<int64_t> changed = prompt;
    changed.back() = (changed.back() + 1) % m->config().vocab_size;
    EXPECT_GT(near(m->decode(other, changed), a), 1e-3);
    // The cache is full now: one more token is a clear error, and the cache is left as it was.
    EXPECT_THROW(m->decode(steps, {ids[0]}), std::exception);
    EXPECT_EQ(steps.len, 13);
  }
}

TEST(Engine, RejectsTokensOutsideVocabulary) {
  auto m = LlamaModel::load(test::data_path("hf/tiny-llama3/model"));
  TokenBatch b = random_batch(1, 4, 10, 1);
  b.input_ids.data<int64_t>()[2] = 5000;
  // The step checks on the host and names the batch row and position (the GPU kernels would
  // report a bad id only at the next synchronising op).
  auto message_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(
      message_of([&] { m->step(b, StepOptions{}); }).find("token id 5000 at row 0 position 2"),
      std::string::npos);
  TokenBatch l = random_batch(2, 4, 10, 1);
  l.labels.data<int64_t>()[5] = 5000;
  EXPECT_NE(message_of([&] { m->step(l, StepOptions{}); }).find("label 5000 at row 1 position 1"),
            std::string::npos);
  l.labels.data<int64_t>()[5] = -100;  // ignored, not an error
  EXPECT_NO_THROW(m->step(l, StepOptions{}));
  auto cache = m->new_cache(8);
  EXPECT_NE(message_of([&] {
              m->decode(cache, {3, 5000});
            }).find("token id 5000 at row 0 position 1"),
            std::string::npos);
  EXPECT_EQ(cache.len, 0);  // nothing was written
}

TEST(Engine, LoadRejectsShapeMismatch) {
  std::string dir = test::temp_dir("badshape");
  auto cfg = ModelConfig::load(test::data_path("hf/tiny-llama3/model"));
  auto j = cfg.raw;
  j["intermediate_size"] = 170;
  write_file_atomic(dir + "/config.json", j.dump());
  std::filesystem::copy_file(test::data_path("hf/tiny-llama3/model/model.safetensors"), dir + "/model.safetensors");
  try {
    LlamaModel::load(dir);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.gate_proj.weight' has shape [160, 64]"), std::string::npos) << e.what();
  }
}

TEST(Engine, MistralSlidingWindowIsAClearError) {
  nlohmann::json j = {{"model_type", "mistral"}, {"vocab_size", 50}, {"hidden_size", 16},
                      {"intermediate_size", 32}, {"num_hidden_layers", 1}, {"num_attention_heads", 2},
                      {"num_key_value_heads", 1}, {"sliding_window", 4}};
  auto m = LlamaModel::random(ModelConfig::from_json(j, "mistral"), 1);
  // Within the window the model runs; past it, one clear error instead of silently wrong attention.
  EXPECT_NO_THROW(m->step(random_batch(1, 4, 50, 1), StepOptions{}));
  try {
    m->step(random_batch(1, 6, 50, 1), StepOptions{});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("sliding window 4"), std::string::npos) << e.what();
  }
  // Generation too: within the window it decodes, past it the same error.
  auto cache = m->new_cache(8);
  EXPECT_NO_THROW(m->decode(cache, {1, 2, 3}));
  EXPECT_NO_THROW(m->decode(cache, {4}));
  EXPECT_THROW(m->decode(cache, {5}), InputError);
}

// The runs the model renumbers segments by and cuDNN's packed attention batches: a run ends where
// the id changes or the row does, and an id that comes back after another is reported.
TEST(Engine, SegmentRunsSplitAtIdChangesAndRowEnds) {
  const std::vector<int64_t> ids{1, 1, 2, 2, 2, 0,   // row 0: runs of 2, 3, 1
                                 0, 0, 0, 0, 0, 0};  // row 1: one run; same id as row 0's end
  const ops::SegmentRuns r = ops::segment_runs(ids.data(), 2, 6);
  EXPECT_EQ(r.start, (std::vector<int64_t>{0, 2, 5, 6}));
  EXPECT_EQ(r.len, (std::vector<int64_t>{2, 3, 1, 6}));
  EXPECT_TRUE(r.repeat.empty());
  const std::vector<int64_t> back{3, 3, 3, 4, 4, 3};
  const ops::SegmentRuns bad = ops::segment_runs(back.data(), 1, 6);
  EXPECT_EQ(bad.repeat, "segment id 3 comes back after another in row 0");
}
