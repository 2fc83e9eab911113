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

// What run_inspect found, as lines for a person: the architecture, the quantization, then one
// line per tensor and the totals.
void print_text(const std::string& path, const json& out,
                const std::optional<rig::ModelConfig>& cfg) {
  if (cfg) {
    fmt::print(
        "{}: {} with {} layers, hidden {}, {} heads ({} kv, head_dim {}), vocab {}, rope {}\n",
        path, cfg->model_type, cfg->num_layers, cfg->hidden_size, cfg->num_heads, cfg->num_kv_heads,
        cfg->head_dim, cfg->vocab_size, cfg->rope.type);
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
  const json& tensors = out["tensors"];
  for (const auto& t : tensors)
    fmt::print("{:<64} {:<5} {:<16} {:>12}\n", t["name"].get<std::string>(),
               t["dtype"].get<std::string>(), t["shape"].dump(), t["bytes"].get<size_t>());
  fmt::print("{} tensors, {} parameters, {} in {} file(s)\n", tensors.size(),
             out["parameters"].get<int64_t>(),
             rig::format_bytes(double(out["bytes"].get<size_t>())), out["files"].get<size_t>());
}

// bitsandbytes 4-bit weights in the files: the packed tensor and its companions count as one
// weight.
struct QuantScan {
  std::set<std::string> companions;  // every tensor of a 4-bit weight
  int64_t tensors = 0, params = 0;
  size_t bytes = 0;
  std::set<std::string> types, blocks, nested;
};

QuantScan scan_quantized(const rig::WeightFiles& w) {
  QuantScan qs;
  for (const auto& name : w.names()) {
    if (!rig::quant::is_quantized(w, name)) continue;
    auto q = rig::quant::load_quantized(w, name);
    for (const auto& [k, t] : rig::quant::state_dict(name, q)) {
      qs.companions.insert(k);
      qs.bytes += w.info(k).end - w.info(k).begin;
    }
    ++qs.tensors;
    qs.params += q.numel();
    qs.types.insert(rig::quant::quant_type_name(q.type));
    qs.blocks.insert(std::to_string(q.blocksize));
    qs.nested.insert(q.nested ? "true" : "false");
  }
  return qs;
}

// The "quantization" entry: what the 4-bit weights are, and config.json's settings for them.
json quantization_json(const QuantScan& qs, const std::optional<rig::quant::QuantConfig>& qcfg) {
  auto one = [](const std::set<std::string>& s) { return fmt::format("{}", fmt::join(s, ",")); };
  json quant = {
      {"method", "bitsandbytes"},
      {"quant_type", one(qs.types)},
      {"blocksize", one(qs.blocks)},
      {"double_quant", one(qs.nested)},
      {"quantized_tensors", qs.tensors},
      {"quantized_parameters", qs.params},
      {"quantized_bytes", qs.bytes},
      {"bits_per_parameter", qs.params ? 8.0 * double(qs.bytes) / double(qs.params) : 0.0}};
  if (qs.blocks.size() == 1) quant["blocksize"] = std::stoll(*qs.blocks.begin());
  if (qs.nested.size() == 1) quant["double_quant"] = *qs.nested.begin() == "true";
  if (qcfg) {
    quant["compute_dtype"] = qcfg->compute_dtype;
    quant["quant_storage"] = qcfg->storage;
  }
  return quant;
}

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
  const QuantScan qs = scan_quantized(w);
  for (const auto& name : w.names()) {
    const auto& t = w.info(name);
    int64_t n = rig::shape_numel(t.shape);
    if (!qs.companions.count(name)) params += n;
    bytes += t.end - t.begin;
    tensors.push_back({{"name", name}, {"dtype", std::string(rig::dtype_name(t.dtype))},
                       {"shape", t.shape}, {"bytes", t.end - t.begin}});
  }
  params += qs.params;
  std::optional<rig::quant::QuantConfig> qcfg;
  if (cfg) qcfg = rig::quant::parse_quantization_config(cfg->raw, path + "/config.json");
  if (qs.tensors || qcfg) out["quantization"] = quantization_json(qs, qcfg);
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
  if (as_json)
    std::cout << out.dump(1) << "\n";
  else
    print_text(path, out, cfg);
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
