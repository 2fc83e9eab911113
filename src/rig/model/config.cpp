#include "rig/model/config.h"

#include <filesystem>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"

namespace rig {

using json = nlohmann::json;

namespace {

int64_t get_int(const json& j, const char* key, const std::string& src, bool required,
                int64_t def = 0) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) bad_input("{}: missing required key '{}'", src, key);
    return def;
  }
  if (!j[key].is_number_integer())
    bad_input("{}: '{}' must be an integer, found {}", src, key, j[key].dump());
  return j[key].get<int64_t>();
}

double get_num(const json& j, const char* key, const std::string& src, double def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_number()) bad_input("{}: '{}' must be a number, found {}", src, key, j[key].dump());
  return j[key].get<double>();
}

bool get_bool(const json& j, const char* key, const std::string& src, bool def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_boolean()) bad_input("{}: '{}' must be true or false, found {}", src, key, j[key].dump());
  return j[key].get<bool>();
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, const std::string& src) {
  if (!j.is_object()) bad_input("{}: a model config must be a JSON object", src);
  ModelConfig c;
  c.raw = j;
  if (!j.contains("model_type") || !j["model_type"].is_string())
    bad_input("{}: missing 'model_type' (expected llama, qwen2, qwen3 or mistral)", src);
  c.model_type = j["model_type"];
  if (c.model_type != "llama" && c.model_type != "qwen2" && c.model_type != "qwen3" &&
      c.model_type != "mistral")
    bad_input("{}: model_type '{}' is not supported (supported: llama, qwen2, qwen3, mistral)", src,
              c.model_type);
  c.vocab_size = get_int(j, "vocab_size", src, true);
  c.hidden_size = get_int(j, "hidden_size", src, true);
  c.intermediate_size = get_int(j, "intermediate_size", src, true);
  c.num_layers = get_int(j, "num_hidden_layers", src, true);
  c.num_heads = get_int(j, "num_attention_heads", src, true);
  c.num_kv_heads = get_int(j, "num_key_value_heads", src, false, c.num_heads);
  c.head_dim = get_int(j, "head_dim", src, false, 0);
  if (c.head_dim == 0 && c.num_heads > 0) {
    if (c.hidden_size % c.num_heads != 0)
      bad_input("{}: num_attention_heads {} does not divide hidden_size {}", src, c.num_heads,
                c.hidden_size);
    c.head_dim = c.hidden_size / c.num_heads;
  }
  c.max_position_embeddings = get_int(j, "max_position_embeddings", src, false, 2048);
  c.rms_norm_eps = get_num(j, "rms_norm_eps", src, 1e-6);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", src, false);
  bool attn_bias = get_bool(j, "attention_bias", src, false);
  if (c.model_type == "qwen2") {
    c.qkv_bias = true;
    c.o_bias = false;
  } else {
    c.qkv_bias = c.o_bias = attn_bias;
  }
  c.mlp_bias = get_bool(j, "mlp_bias", src, false);
  c.qk_norm = c.model_type == "qwen3";
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    bad_input("{}: hidden_act {} is not supported (only silu)", src, j["hidden_act"].dump());
  bool use_sw = c.model_type == "mistral" || get_bool(j, "use_sliding_window", src, false);
  if (use_sw && j.contains("sliding_window") && !j["sliding_window"].is_null())
    c.sliding_window = get_int(j, "sliding_window", src, false);
  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer()) c.bos_token_id = j["bos_token_id"].get<int64_t>();
  if (j.contains("eos_token_id") && j["eos_token_id"].is_number_integer()) c.eos_token_id = j["eos_token_id"].get<int64_t>();

  // transformers 5 writes rope_parameters; transformers 4 writes rope_theta + rope_scaling.
  json rp = json::object();
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    rp = j["rope_parameters"];
  } else {
    if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) rp = j["rope_scaling"];
    if (j.contains("rope_theta")) rp["rope_theta"] = j["rope_theta"];
  }
  std::string rsrc = src + " rope";
  c.rope.theta = get_num(rp, "rope_theta", rsrc, 10000.0);
  std::string type = "default";
  if (rp.contains("rope_type") && rp["rope_type"].is_string()) type = rp["rope_type"];
  else if (rp.contains("type") && rp["type"].is_string()) type = rp["type"];
  if (type != "default" && type != "llama3")
    bad_input("{}: rope type '{}' is not supported (supported: default, llama3)", src, type);
  c.rope.type = type;
  if (type == "llama3") {
    c.rope.factor = get_num(rp, "factor", rsrc, 8.0);
    c.rope.low_freq_factor = get_num(rp, "low_freq_factor", rsrc, 1.0);
    c.rope.high_freq_factor = get_num(rp, "high_freq_factor", rsrc, 4.0);
    c.rope.original_max_position_embeddings =
        get_int(rp, "original_max_position_embeddings", rsrc, false, 8192);
  }
  c.validate(src);
  return c;
}

void ModelConfig::validate(const std::string& src) const {
  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0) bad_input("{}: '{}' must be positive, found {}", src, key, v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_layers);
  positive("num_attention_heads", num_heads);
  positive("num_key_value_heads", num_kv_heads);
  positive("head_dim", head_dim);
  if (num_heads % num_kv_heads != 0)
    bad_input("{}: num_key_value_heads {} does not divide num_attention_heads {}", src,
              num_kv_heads, num_heads);
  if (head_dim % 2 != 0) bad_input("{}: head_dim {} must be even for rotary embedding", src, head_dim);
  if (!(rms_norm_eps > 0)) bad_input("{}: rms_norm_eps must be positive", src);
  if (rope.type == "llama3" && !(rope.high_freq_factor > rope.low_freq_factor))
    bad_input("{}: llama3 rope needs high_freq_factor > low_freq_factor", src);
}

ModelConfig ModelConfig::load(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  std::string text = read_file(p.string());
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    bad_input("{}: not valid JSON: {}", p.string(), e.what());
  }
  return from_json(j, p.string());
}

json ModelConfig::to_json() const {
  json j = raw.is_object() ? raw : json::object();
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (model_type != "qwen2") j["attention_bias"] = qkv_bias;
  j["mlp_bias"] = mlp_bias;
  j["hidden_act"] = "silu";
  if (!j.contains("architectures"))
    j["architectures"] = {model_type == "qwen2"     ? "Qwen2ForCausalLM"
                          : model_type == "qwen3"   ? "Qwen3ForCausalLM"
                          : model_type == "mistral" ? "MistralForCausalLM"
                                                    : "LlamaForCausalLM"};
  json rp = {{"rope_theta", rope.theta}, {"rope_type", rope.type}};
  if (rope.type == "llama3") {
    rp["factor"] = rope.factor;
    rp["low_freq_factor"] = rope.low_freq_factor;
    rp["high_freq_factor"] = rope.high_freq_factor;
    rp["original_max_position_embeddings"] = rope.original_max_position_embeddings;
  }
  // Written in both spellings so transformers 4 and 5 read it.
  j["rope_parameters"] = rp;
  j["rope_theta"] = rope.theta;
  if (rope.type == "llama3") {
    json rs = rp;
    rs.erase("rope_theta");
    j["rope_scaling"] = rs;
  } else {
    j.erase("rope_scaling");
  }
  return j;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t h = hidden_size, f = intermediate_size;
  int64_t attn = h * q_dim() + 2 * h * kv_dim() + q_dim() * h;
  if (qkv_bias) attn += q_dim() + 2 * kv_dim();
  if (o_bias) attn += h;
  int64_t mlp = 3 * h * f + (mlp_bias ? 2 * f + h : 0);
  int64_t layer = attn + mlp + 2 * h + (qk_norm ? 2 * head_dim : 0);
  int64_t emb = vocab_size * h * (tie_word_embeddings ? 1 : 2);
  return num_layers * layer + emb + h;
}

std::vector<int64_t> load_eos_token_ids(const std::string& model_dir) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    const std::string path = (std::filesystem::path(model_dir) / name).string();
    if (!std::filesystem::exists(path)) continue;
    json j;
    try {
      j = json::parse(read_file(path));
    } catch (const json::parse_error& e) {
      bad_input("{}: not valid JSON: {}", path, e.what());
    }
    if (!j.is_object() || !j.contains("eos_token_id") || j["eos_token_id"].is_null()) continue;
    const json& e = j["eos_token_id"];
    std::vector<int64_t> ids;
    auto take = [&](const json& v) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0)
        bad_input("{}: eos_token_id must be a token id or a list of them, found {}", path, e.dump());
      ids.push_back(v.get<int64_t>());
    };
    if (e.is_array())
      for (const auto& v : e) take(v);
    else
      take(e);
    return ids;
  }
  return {};
}

}  // namespace rig
