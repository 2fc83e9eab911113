#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>

#include "command.h"
#include "rig/core/allocator.h"
#include "rig/io/safetensors.h"
#include "rig/model/config.h"
#include "rig/quant/nf4.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

int run_inspect(const std::string& path, bool as_json) {
  bool is_dir = fs::is_directory(path);
  if (!is_dir && !fs::exists(path)) rig::bad_input("{}: no such file or folder", path);
  rig::WeightFiles w = is_dir ? rig::WeightFiles::open_dir(path) : rig::WeightFiles::open_file(path);
  std::optional<rig::ModelConfig> cfg;
  if (is_dir && fs::exists(fs::path(path) / "config.json")) cfg = rig::ModelConfig::load(path);

  json out;
  out["path"] = path;
  json tensors = json::array();
  int64_t params = 0;
  size_t bytes = 0;
  // bitsandbytes 4-bit weights: the packed tensor and its companions count as one weight.
  std::set<std::string> companions;
  json quant = json::object();
  int64_t q_tensors = 0, q_params = 0;
  size_t q_bytes = 0;
  std::set<std::string> q_types, q_blocks, q_nested;
  for (const auto& name : w.names()) {
    if (!rig::quant::is_quantized(w, name)) continue;
    auto q = rig::quant::load_quantized(w, name);
    for (const auto& [k, t] : rig::quant::state_dict(name, q)) {
      companions.insert(k);
      q_bytes += w.info(k).end - w.info(k).begin;
    }
    ++q_tensors;
    q_params += q.numel();
    q_types.insert(rig::quant::quant_type_name(q.type));
    q_blocks.insert(std::to_string(q.blocksize));
    q_nested.insert(q.nested ? "true" : "false");
  }
  for (const auto& name : w.names()) {
    const auto& t = w.info(name);
    int64_t n = rig::shape_numel(t.shape);
    if (!companions.count(name)) params += n;
    bytes += t.end - t.begin;
    tensors.push_back({{"name", name}, {"dtype", std::string(rig::dtype_name(t.dtype))},
                       {"shape", t.shape}, {"bytes", t.end - t.begin}});
  }
  params += q_params;
  std::optional<rig::quant::QuantConfig> qcfg;
  if (cfg) qcfg = rig::quant::parse_quantization_config(cfg->raw, path + "/config.json");
  if (q_tensors || qcfg) {
    auto one = [](const std::set<std::string>& s) { return fmt::format("{}", fmt::join(s, ",")); };
    quant = {{"method", "bitsandbytes"},
             {"quant_type", one(q_types)},
             {"blocksize", one(q_blocks)},
             {"double_quant", one(q_nested)},
             {"quantized_tensors", q_tensors},
             {"quantized_parameters", q_params},
             {"quantized_bytes", q_bytes},
             {"bits_per_parameter", q_params ? 8.0 * double(q_bytes) / double(q_params) : 0.0}};
    if (q_blocks.size() == 1) quant["blocksize"] = std::stoll(*q_blocks.begin());
    if (q_nested.size() == 1) quant["double_quant"] = *q_nested.begin() == "true";
    if (qcfg) {
      quant["compute_dtype"] = qcfg->compute_dtype;
      quant["quant_storage"] = qcfg->storage;
    }
    out["quantization"] = quant;
  }
  out["parameters"] = params;
  out["bytes"] = bytes;
  out["files"] = w.files().size();
  if (cfg) {
    out["architecture"] = {{"model_type", cfg->model_type},
                           {"layers", cfg->num_layers},
                           {"hidden_size", cfg->hidden_size},
                           {"intermediate_size", cfg->intermediate_size},
                           {"heads", cfg->num_heads},
                           {"kv_heads", cfg->num_kv_heads},
                           {"head_dim", cfg->head_dim},
                           {"vocab_size", cfg->vocab_size},
                           {"tie_word_embeddings", cfg->tie_word_embeddings},
                           {"rope_type", cfg->rope.type},
                           {"rope_theta", cfg->rope.theta},
                           {"config_parameters", cfg->num_parameters()}};
  }
  out["tensors"] = tensors;
  if (as_json) {
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  if (cfg) {
    fmt::print("{}: {} with {} layers, hidden {}, {} heads ({} kv, head_dim {}), vocab {}, rope {}\n",
               path, cfg->model_type, cfg->num_layers, cfg->hidden_size, cfg->num_heads,
               cfg->num_kv_heads, cfg->head_dim, cfg->vocab_size, cfg->rope.type);
  }
  if (out.contains("quantization")) {
    const json& q = out["quantization"];
    fmt::print(
        "quantization: bitsandbytes {}, blocks of {}, {}double quantization; {} weights "
        "({} parameters) in {} ({:.3f} bits a parameter){}\n",
        q["quant_type"].get<std::string>(), q["blocksize"].dump(),
        q["double_quant"] == true ? "" : "no ", q["quantized_tensors"].get<int64_t>(),
        q["quantized_parameters"].get<int64_t>(),
        rig::format_bytes(double(q["quantized_bytes"].get<size_t>())),
        q["bits_per_parameter"].get<double>(),
        q.contains("compute_dtype")
            ? fmt::format(", compute dtype {}", q["compute_dtype"].get<std::string>())
            : "");
  }
  fmt::print("{:<64} {:<5} {:<16} {:>12}\n", "tensor", "dtype", "shape", "bytes");
  for (const auto& t : tensors)
    fmt::print("{:<64} {:<5} {:<16} {:>12}\n", t["name"].get<std::string>(),
               t["dtype"].get<std::string>(), t["shape"].dump(), t["bytes"].get<size_t>());
  fmt::print("{} tensors, {} parameters, {} in {} file(s)\n", tensors.size(), params,
             rig::format_bytes(double(bytes)), w.files().size());
  return 0;
}

rig::cli::Registrar reg("inspect", "Show a model folder's or safetensors file's tensors and architecture",
                        [](CLI::App& app) {
                          auto path = std::make_shared<std::string>();
                          auto js = std::make_shared<bool>(false);
                          app.add_option("path", *path, "model folder or .safetensors file")->required();
                          app.add_flag("--json", *js, "print one JSON object");
                          return [=] { return run_inspect(*path, *js); };
                        });

}  // namespace
