#include "rig/plan/models.h"

#include <filesystem>

#include "rig/core/error.h"

namespace rig::plan {
namespace {

struct Shape {
  const char* name;
  const char* type;
  int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim;
  bool tie, qkv_bias;
};

// From each model's config.json on the Hugging Face hub (Llama 3.2 for 1b/3b, Llama 3.1 for
// 8b/70b, Mistral-7B-v0.3). The parameter counts they give are checked in plan_test.
constexpr Shape kShapes[] = {
    {"llama3-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 64, true, false},
    {"llama3-3b", "llama", 128256, 3072, 8192, 28, 24, 8, 128, true, false},
    {"llama3-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 128, false, false},
    {"llama3-70b", "llama", 128256, 8192, 28672, 80, 64, 8, 128, false, false},
    {"qwen2.5-7b", "qwen2", 152064, 3584, 18944, 28, 28, 4, 128, false, true},
    {"qwen2.5-14b", "qwen2", 152064, 5120, 13824, 48, 40, 8, 128, false, true},
    {"qwen2.5-32b", "qwen2", 152064, 5120, 27648, 64, 40, 8, 128, false, true},
    {"qwen2.5-72b", "qwen2", 152064, 8192, 29568, 80, 64, 8, 128, false, true},
    {"mistral-7b", "mistral", 32768, 4096, 14336, 32, 32, 8, 128, false, false},
};

}  // namespace

std::vector<std::string> builtin_model_names() {
  std::vector<std::string> v;
  for (const auto& s : kShapes) v.push_back(s.name);
  return v;
}

ModelConfig builtin_model(const std::string& name) {
  for (const auto& s : kShapes) {
    if (name != s.name) continue;
    ModelConfig c;
    c.model_type = s.type;
    c.vocab_size = s.vocab;
    c.hidden_size = s.hidden;
    c.intermediate_size = s.inter;
    c.num_layers = s.layers;
    c.num_heads = s.heads;
    c.num_kv_heads = s.kv_heads;
    c.head_dim = s.head_dim;
    c.tie_word_embeddings = s.tie;
    c.qkv_bias = s.qkv_bias;
    return c;
  }
  std::string names;
  for (const auto& s : kShapes) names += std::string(names.empty() ? "" : ", ") + s.name;
  bad_input("model '{}': not a built-in shape ({}) and no such file or folder", name, names);
}

ModelConfig resolve_model(const std::string& name_or_path) {
  if (std::filesystem::exists(name_or_path)) return ModelConfig::load(name_or_path);
  return builtin_model(name_or_path);
}

}  // namespace rig::plan
