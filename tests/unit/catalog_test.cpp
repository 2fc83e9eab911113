// The model catalogue is the one place shapes are written: `rig plan`, `rig bench train --preset`
// and training configs' `architecture:` must read the same numbers from it.
#include "rig/model/catalog.h"

#include <gtest/gtest.h>

#include "rig/core/error.h"
#include "rig/plan/models.h"
#include "rig/train/train_config.h"

namespace {

void expect_same_shape(const rig::ModelConfig& a, const rig::ModelConfig& b, const std::string& n) {
  EXPECT_EQ(a.model_type, b.model_type) << n;
  EXPECT_EQ(a.vocab_size, b.vocab_size) << n;
  EXPECT_EQ(a.hidden_size, b.hidden_size) << n;
  EXPECT_EQ(a.intermediate_size, b.intermediate_size) << n;
  EXPECT_EQ(a.num_layers, b.num_layers) << n;
  EXPECT_EQ(a.num_heads, b.num_heads) << n;
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads) << n;
  EXPECT_EQ(a.head_dim, b.head_dim) << n;
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings) << n;
  EXPECT_EQ(a.qkv_bias, b.qkv_bias) << n;
  EXPECT_EQ(a.rope.theta, b.rope.theta) << n;
  EXPECT_EQ(a.num_parameters(), b.num_parameters()) << n;
}

}  // namespace

TEST(ModelCatalog, BenchPresetsPlannerAndTrainConfigReadTheSameNumbers) {
  ASSERT_FALSE(rig::catalog_names().empty());
  for (const auto& name : rig::catalog_names()) {
    const rig::ModelConfig planned = rig::plan::builtin_model(name);
    const rig::ModelConfig bench =
        rig::ModelConfig::from_json(rig::catalog_bench_config(name, "--preset"), name);
    auto arch = rig::builtin_architecture(name);
    ASSERT_TRUE(arch.has_value()) << name;
    const rig::ModelConfig trained = rig::ModelConfig::from_json(*arch, name);
    expect_same_shape(planned, bench, name);
    expect_same_shape(planned, trained, name);
  }
  EXPECT_EQ(rig::plan::builtin_model_names(), rig::builtin_architecture_names());
}

TEST(ModelCatalog, BenchPresetsAreHfBaselineShapes) {
  // bench/hf_baseline.py's PRESETS, written out by hand there: LlamaConfig(**preset,
  // rope_theta=500000.0) with plain RoPE. rig bench train must build the same models.
  struct Hf {
    const char* name;
    int64_t hidden, inter, layers, heads, kv, vocab;
    bool tie;
  };
  for (const Hf& h : {Hf{"llama3-1b", 2048, 8192, 16, 32, 8, 128256, true},
                      Hf{"llama3-8b", 4096, 14336, 32, 32, 8, 128256, false}}) {
    const auto j = rig::catalog_bench_config(h.name, "--preset");
    EXPECT_EQ(j.at("hidden_size"), h.hidden) << h.name;
    EXPECT_EQ(j.at("intermediate_size"), h.inter) << h.name;
    EXPECT_EQ(j.at("num_hidden_layers"), h.layers) << h.name;
    EXPECT_EQ(j.at("num_attention_heads"), h.heads) << h.name;
    EXPECT_EQ(j.at("num_key_value_heads"), h.kv) << h.name;
    EXPECT_EQ(j.at("vocab_size"), h.vocab) << h.name;
    EXPECT_EQ(j.at("tie_word_embeddings"), h.tie) << h.name;
    EXPECT_EQ(j.at("rope_theta"), 500000.0) << h.name;
    EXPECT_FALSE(j.contains("rope_scaling")) << h.name;
  }
}

TEST(ModelCatalog, AliasesAndUnknownNames) {
  EXPECT_EQ(rig::find_catalog_model("llama3.2-1b"), rig::find_catalog_model("llama3-1b"));
  EXPECT_EQ(rig::find_catalog_model("llama3-9b"), nullptr);
  try {
    rig::catalog_bench_config("llama3-9b", "--preset");
    FAIL() << "no error for an unknown preset";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--preset 'llama3-9b' is not one of tiny, "),
              std::string::npos)
        << e.what();
  }
}
