// The architecture of a LLaMA-family model, read from a Hugging Face config.json.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace rig {

struct RopeConfig {
  std::string type = "default";  // "default" or "llama3"
  double theta = 10000.0;
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string model_type = "llama";  // llama, qwen2, qwen3, mistral
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // llama: attention_bias; qwen2: always
  bool o_bias = false;    // llama: attention_bias; qwen2: never
  bool mlp_bias = false;
  bool qk_norm = false;   // qwen3: RMSNorm over each head of q and k before RoPE
  std::optional<int64_t> sliding_window;  // mistral; attention beyond it is not supported
  std::optional<int64_t> bos_token_id, eos_token_id;
  RopeConfig rope;
  nlohmann::json raw;  // the original config, written back on export

  // `source` names the file in error messages.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);
  // A config.json file or a folder holding one.
  static ModelConfig load(const std::string& path);
  nlohmann::json to_json() const;
  void validate(const std::string& source) const;

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  int64_t num_parameters() const;
};

// The token ids that end generation, as transformers decides: `eos_token_id` (a number or a list)
// of generation_config.json in `model_dir`, else of config.json; empty when neither names one.
std::vector<int64_t> load_eos_token_ids(const std::string& model_dir);

}  // namespace rig
