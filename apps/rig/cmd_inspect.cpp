#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "rig/core/allocator.h"
#include "rig/io/safetensors.h"
#include "rig/model/config.h"

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
  for (const auto& name : w.names()) {
    const auto& t = w.info(name);
    int64_t n = rig::shape_numel(t.shape);
    params += n;
    bytes += t.end - t.begin;
    tensors.push_back({{"name", name}, {"dtype", std::string(rig::dtype_name(t.dtype))},
                       {"shape", t.shape}, {"bytes", t.end - t.begin}});
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
