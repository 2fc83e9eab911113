#include "rig/model/catalog.h"

#include "rig/core/error.h"

namespace rig {
namespace {

using json = nlohmann::json;

json llama(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv,
           double theta, int64_t max_pos, bool tie) {
  return {{"model_type", "llama"},
          {"architectures", {"LlamaForCausalLM"}},
          {"vocab_size", vocab},
          {"hidden_size", hidden},
          {"intermediate_size", inter},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv},
          {"max_position_embeddings", max_pos},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", theta},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", tie}};
}

// Llama 3.1 and 3.2 stretch RoPE to 128k positions; `factor` is 8 for 3.1, 32 for 3.2.
json llama3_rope(double factor) {
  return {{"rope_type", "llama3"},
          {"factor", factor},
          {"low_freq_factor", 1.0},
          {"high_freq_factor", 4.0},
          {"original_max_position_embeddings", 8192}};
}

json qwen2(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv,
           int64_t max_pos, double eps, bool tie) {
  json q = llama(vocab, hidden, inter, layers, heads, kv, 1000000.0, max_pos, tie);
  q["model_type"] = "qwen2";
  q["architectures"] = {"Qwen2ForCausalLM"};
  q["rms_norm_eps"] = eps;
  return q;
}

// Qwen3 dense: per-head q/k norms and a head_dim of 128 whatever the width.
json qwen3(int64_t hidden, int64_t inter, int64_t layers, int64_t heads, bool tie) {
  json q = llama(151936, hidden, inter, layers, heads, 8, 1000000.0, 40960, tie);
  q["model_type"] = "qwen3";
  q["architectures"] = {"Qwen3ForCausalLM"};
  q["head_dim"] = 128;
  q["rms_norm_eps"] = 1e-6;
  q["attention_bias"] = false;
  return q;
}

std::vector<CatalogModel> make_catalog() {
  std::vector<CatalogModel> c;
  // A few-hundred-thousand-parameter model: the CPU demo and tests.
  c.push_back({"tiny", {}, "rig", llama(512, 64, 176, 2, 4, 2, 10000.0, 512, false)});
  c.push_back({"llama2-7b",
               {},
               "meta-llama/Llama-2-7b-hf",
               llama(32000, 4096, 11008, 32, 32, 32, 10000.0, 4096, false)});
  // Llama 3 before 3.1 and 3.2: the 8b comes before the small 3.2 ones so that a near miss
  // like llama3-9b is answered with llama3-8b.
  c.push_back({"llama3-8b",
               {},
               "meta-llama/Meta-Llama-3-8B",
               llama(128256, 4096, 14336, 32, 32, 8, 500000.0, 8192, false)});
  json l31 = llama(128256, 4096, 14336, 32, 32, 8, 500000.0, 131072, false);
  l31["rope_scaling"] = llama3_rope(8.0);
  c.push_back({"llama3.1-8b", {}, "meta-llama/Llama-3.1-8B", l31});
  c.push_back({"llama3-70b",
               {},
               "meta-llama/Meta-Llama-3-70B",
               llama(128256, 8192, 28672, 80, 64, 8, 500000.0, 8192, false)});
  json l1 = llama(128256, 2048, 8192, 16, 32, 8, 500000.0, 131072, true);
  l1["rope_scaling"] = llama3_rope(32.0);
  c.push_back({"llama3-1b", {"llama3.2-1b"}, "meta-llama/Llama-3.2-1B", l1});
  json l3 = llama(128256, 3072, 8192, 28, 24, 8, 500000.0, 131072, true);
  l3["rope_scaling"] = llama3_rope(32.0);
  c.push_back({"llama3-3b", {"llama3.2-3b"}, "meta-llama/Llama-3.2-3B", l3});
  c.push_back({"qwen2.5-0.5b",
               {},
               "Qwen/Qwen2.5-0.5B",
               qwen2(151936, 896, 4864, 24, 14, 2, 32768, 1e-6, true)});
  c.push_back({"qwen2.5-7b",
               {},
               "Qwen/Qwen2.5-7B",
               qwen2(152064, 3584, 18944, 28, 28, 4, 131072, 1e-6, false)});
  c.push_back({"qwen2.5-14b",
               {},
               "Qwen/Qwen2.5-14B",
               qwen2(152064, 5120, 13824, 48, 40, 8, 131072, 1e-5, false)});
  c.push_back({"qwen2.5-32b",
               {},
               "Qwen/Qwen2.5-32B",
               qwen2(152064, 5120, 27648, 64, 40, 8, 131072, 1e-5, false)});
  c.push_back({"qwen2.5-72b",
               {},
               "Qwen/Qwen2.5-72B",
               qwen2(152064, 8192, 29568, 80, 64, 8, 131072, 1e-5, false)});
  c.push_back({"qwen3-0.6b", {}, "Qwen/Qwen3-0.6B", qwen3(1024, 3072, 28, 16, true)});
  c.push_back({"qwen3-1.7b", {}, "Qwen/Qwen3-1.7B", qwen3(2048, 6144, 28, 16, true)});
  c.push_back({"qwen3-4b", {}, "Qwen/Qwen3-4B", qwen3(2560, 9728, 36, 32, true)});
  c.push_back({"qwen3-8b", {}, "Qwen/Qwen3-8B", qwen3(4096, 12288, 36, 32, false)});
  c.push_back({"qwen3-14b", {}, "Qwen/Qwen3-14B", qwen3(5120, 17408, 40, 40, false)});
  c.push_back({"qwen3-32b", {}, "Qwen/Qwen3-32B", qwen3(5120, 25600, 64, 64, false)});
  json mi = llama(32768, 4096, 14336, 32, 32, 8, 1000000.0, 32768, false);
  mi["model_type"] = "mistral";
  mi["architectures"] = {"MistralForCausalLM"};
  mi["sliding_window"] = nullptr;
  c.push_back({"mistral-7b", {}, "mistralai/Mistral-7B-v0.3", mi});
  return c;
}

}  // namespace

const std::vector<CatalogModel>& model_catalog() {
  static const std::vector<CatalogModel> c = make_catalog();
  return c;
}

std::vector<std::string> catalog_names() {
  std::vector<std::string> v;
  for (const auto& m : model_catalog()) {
    v.push_back(m.name);
    v.insert(v.end(), m.aliases.begin(), m.aliases.end());
  }
  return v;
}

const CatalogModel* find_catalog_model(const std::string& name) {
  for (const auto& m : model_catalog()) {
    if (m.name == name) return &m;
    for (const auto& a : m.aliases)
      if (a == name) return &m;
  }
  return nullptr;
}

json catalog_bench_config(const std::string& name, const std::string& what) {
  const CatalogModel* m = find_catalog_model(name);
  if (!m) {
    std::string names;
    for (const auto& n : catalog_names()) names += (names.empty() ? "" : ", ") + n;
    bad_input("{} '{}' is not one of {}", what, name, names);
  }
  json j;
  for (const char* k :
       {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "rope_theta"})
    j[k] = m->config.at(k);
  if (m->config.contains("head_dim")) j["head_dim"] = m->config["head_dim"];
  return j;
}

}  // namespace rig
