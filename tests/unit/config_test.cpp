#include "rig/model/config.h"

#include <gtest/gtest.h>

#include "rig/core/allocator.h"
#include "rig/core/tensor.h"
#include "rig/io/atomic_file.h"
#include "test_util.h"

using namespace rig;
using json = nlohmann::json;

TEST(ModelConfig, TinyLlama3Transformers5) {
  auto c = ModelConfig::load(test::data_path("hf/tiny-llama3/model"));
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 8.0);
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(ModelConfig, TinyQwen2BiasAndTying) {
  auto c = ModelConfig::load(test::data_path("hf/tiny-qwen2/model"));
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
}

TEST(ModelConfig, Transformers4RopeScaling) {
  json j = {{"model_type", "llama"}, {"vocab_size", 100}, {"hidden_size", 32}, {"intermediate_size", 64},
            {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"rope_theta", 500000.0},
            {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                              {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}}}};
  auto c = ModelConfig::from_json(j, "cfg");
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.num_kv_heads, 4);
  // Round trip through to_json.
  auto c2 = ModelConfig::from_json(c.to_json(), "cfg2");
  EXPECT_EQ(c2.rope.type, "llama3");
  EXPECT_EQ(c2.num_parameters(), c.num_parameters());
}

namespace {
std::string config_error(json j) {
  try {
    ModelConfig::from_json(j, "bad.json");
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
json base() {
  return {{"model_type", "llama"}, {"vocab_size", 100}, {"hidden_size", 32}, {"intermediate_size", 64},
          {"num_hidden_layers", 1}, {"num_attention_heads", 4}};
}
}  // namespace

// Generation stops at eos_token_id from generation_config.json before config.json, as a list or
// a number (Llama 3 Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>).
TEST(ModelConfig, EosTokenIdsFromGenerationConfig) {
  const std::string d = test::temp_dir("eos-ids"), empty = test::temp_dir("eos-ids-none");
  write_file_atomic(d + "/config.json", R"({"eos_token_id": 128001})");
  EXPECT_EQ(load_eos_token_ids(d), (std::vector<int64_t>{128001}));
  write_file_atomic(d + "/generation_config.json", R"({"eos_token_id": [128001, 128008, 128009]})");
  EXPECT_EQ(load_eos_token_ids(d), (std::vector<int64_t>{128001, 128008, 128009}));
  write_file_atomic(d + "/generation_config.json", R"({"eos_token_id": "x"})");
  EXPECT_THROW(load_eos_token_ids(d), InputError);
  EXPECT_TRUE(load_eos_token_ids(empty).empty());
}

TEST(ModelConfigBadInput, MissingSize) {
  json j = base();
  j.erase("hidden_size");
  EXPECT_NE(config_error(j).find("missing required key 'hidden_size'"), std::string::npos);
}

TEST(ModelConfigBadInput, NegativeSize) {
  json j = base();
  j["intermediate_size"] = -5;
  EXPECT_NE(config_error(j).find("'intermediate_size' must be positive"), std::string::npos);
}

TEST(ModelConfigBadInput, HeadsDoNotDivideHidden) {
  json j = base();
  j["num_attention_heads"] = 5;
  EXPECT_NE(config_error(j).find("does not divide hidden_size"), std::string::npos);
  j = base();
  j["num_key_value_heads"] = 3;
  EXPECT_NE(config_error(j).find("does not divide num_attention_heads"), std::string::npos);
}

TEST(ModelConfigBadInput, UnsupportedTypes) {
  json j = base();
  j["model_type"] = "gpt2";
  EXPECT_NE(config_error(j).find("model_type 'gpt2' is not supported"), std::string::npos);
  j = base();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(config_error(j).find("rope type 'yarn' is not supported"), std::string::npos);
  j = base();
  j["hidden_size"] = "32";
  EXPECT_NE(config_error(j).find("must be an integer"), std::string::npos);
}

TEST(Allocator, BudgetRefusesWithContext) {
  Allocator& a = cpu_allocator();
  size_t before = a.budget();
  a.set_budget(a.in_use() + 1000);
  try {
    Tensor::empty({1000}, DType::F32, Device::cpu(), "activations");
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("activations"), std::string::npos) << m;
    EXPECT_NE(m.find("budget"), std::string::npos) << m;
  }
  a.set_budget(before);
}

TEST(Allocator, PeakCounts) {
  Allocator& a = cpu_allocator();
  a.reset_peak();
  size_t base = a.in_use();
  { Tensor t = Tensor::empty({1 << 20}, DType::F32); }
  EXPECT_GE(a.peak(), base + (4u << 20));
  EXPECT_EQ(a.in_use(), base);
}

TEST(Allocator, ParseBytes) {
  EXPECT_EQ(parse_bytes("22GiB"), size_t(22) << 30);
  EXPECT_EQ(parse_bytes("1.5GB"), size_t(1500000000));
  EXPECT_EQ(parse_bytes("512"), size_t(512));
  EXPECT_THROW(parse_bytes("22 furlongs"), InputError);
  EXPECT_THROW(parse_bytes("GiB"), InputError);
}

TEST(Allocator, CudaAllocatorNameFromTheEnvironment) {
  EXPECT_TRUE(cuda_pool_requested(nullptr));
  EXPECT_TRUE(cuda_pool_requested(""));
  EXPECT_TRUE(cuda_pool_requested("pool"));
  EXPECT_FALSE(cuda_pool_requested("caching"));
  try {
    cuda_pool_requested("Caching ");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("RIG_CUDA_ALLOCATOR='Caching '"), std::string::npos) << m;
    EXPECT_NE(m.find("expected pool or caching"), std::string::npos) << m;
  }
}

TEST(Inspect, TinyLlama3Json) {
  auto r = test::run_rig("inspect --json " + test::data_path("hf/tiny-llama3/model"));
  ASSERT_EQ(r.code, 0) << r.out;
  json j = json::parse(r.out);
  EXPECT_EQ(j["architecture"]["layers"], 2);
  EXPECT_EQ(j["tensors"].size(), 21u);
  int64_t sum = 0;
  for (auto& t : j["tensors"]) {
    int64_t n = 1;
    for (auto d : t["shape"]) n *= d.get<int64_t>();
    sum += n;
  }
  EXPECT_EQ(j["parameters"].get<int64_t>(), sum);
  EXPECT_EQ(j["parameters"].get<int64_t>(), j["architecture"]["config_parameters"].get<int64_t>());
}
