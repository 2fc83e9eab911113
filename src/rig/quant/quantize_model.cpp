#include "rig/quant/quantize_model.h"

#include <filesystem>
#include <set>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/config.h"
#include "rig/model/lora.h"

namespace rig::quant {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// What one quantized weight of n elements takes on disk (the JSON estimated at 200 bytes; only
// used to cut shards).
size_t quantized_bytes_estimate(int64_t n, const QuantConfig& c) {
  const int64_t nb = (n + c.blocksize - 1) / c.blocksize;
  size_t b = size_t((n + 1) / 2) + 64 + 200;
  b += c.double_quant ? size_t(nb) + size_t((nb + 255) / 256) * 4 + 1024 : size_t(nb) * 4;
  return b;
}

bool weight_file(const fs::path& p) {
  const std::string n = p.filename().string();
  return n == "config.json" || n == "model.safetensors.index.json" ||
         p.extension() == ".safetensors" ||
         (n.rfind("pytorch_model", 0) == 0 && p.extension() == ".bin");
}

// The decoder's linear weights: what transformers replaces with Linear4bit (lm_head excluded).
// Each must be there, not quantized yet, and a 2-D float tensor.
std::set<std::string> decoder_linears(const WeightFiles& w, const ModelConfig& cfg,
                                      const std::string& in_dir) {
  std::set<std::string> linears;
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    for (const auto& p : kProjections) {
      const bool attn = p == "q_proj" || p == "k_proj" || p == "v_proj" || p == "o_proj";
      std::string key =
          fmt::format("model.layers.{}.{}.{}.weight", l, attn ? "self_attn" : "mlp", p);
      if (!w.has(key))
        bad_input("{}: weights have no tensor '{}' required by config.json", in_dir, key);
      if (is_quantized(w, key)) bad_input("{}: tensor '{}' is 4-bit already", w.path_of(key), key);
      const TensorInfo& t = w.info(key);
      if (t.shape.size() != 2 ||
          (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16))
        bad_input("{}: tensor '{}' is {} {}; rig quantizes 2-D F32, BF16 or F16 weights",
                  w.path_of(key), key, dtype_name(t.dtype), shape_str(t.shape));
      linears.insert(key);
    }
  return linears;
}

// Shards cut by the sizes the output will have, in the input's tensor order; adds the input's
// bytes to r.
std::vector<std::vector<std::string>> plan_shards(const WeightFiles& w,
                                                  const std::set<std::string>& linears,
                                                  const QuantConfig& qc, size_t max_shard_bytes,
                                                  QuantizeModelResult& r) {
  const std::vector<std::string> names = w.names();
  std::vector<std::vector<std::string>> plan(1);
  size_t cur = 0;
  for (const auto& name : names) {
    const TensorInfo& t = w.info(name);
    r.bytes_in += t.end - t.begin;
    const size_t b =
        linears.count(name) ? quantized_bytes_estimate(shape_numel(t.shape), qc) : t.end - t.begin;
    if (cur > 0 && cur + b > max_shard_bytes) {
      plan.emplace_back();
      cur = 0;
    }
    plan.back().push_back(name);
    cur += b;
  }
  return plan;
}

}  // namespace

QuantizeModelResult quantize_model(const std::string& in_dir, const std::string& out_dir,
                                   const QuantizeModelOptions& opt) {
  const QuantConfig& qc = opt.config;
  if (qc.blocksize <= 0) bad_input("quantize: blocksize {} must be positive", qc.blocksize);
  ModelConfig cfg = ModelConfig::load(in_dir);
  const std::string cfg_path = (fs::path(in_dir) / "config.json").string();
  if (cfg.raw.contains("quantization_config") && !cfg.raw["quantization_config"].is_null())
    bad_input("{}: the model is quantized already (quantization_config)", cfg_path);
  fs::create_directories(out_dir);
  if (fs::equivalent(fs::path(in_dir), fs::path(out_dir)))
    bad_input("quantize: --out {} is the input folder; write to another folder", out_dir);
  WeightFiles w = WeightFiles::open_dir(in_dir);

  const std::set<std::string> linears = decoder_linears(w, cfg, in_dir);

  QuantizeModelResult r;
  const std::vector<std::vector<std::string>> plan =
      plan_shards(w, linears, qc, opt.max_shard_bytes, r);
  r.shards = int(plan.size());

  json weight_map = json::object();
  for (size_t s = 0; s < plan.size(); ++s) {
    const std::string fname =
        plan.size() == 1 ? "model.safetensors"
                         : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, plan.size());
    std::vector<std::pair<std::string, Tensor>> out;
    for (const auto& name : plan[s]) {
      if (linears.count(name)) {
        // One float weight in memory at a time; the input stays memory-mapped.
        QuantizedWeight q = quantize_4bit(w.get(name), qc.type, qc.blocksize, qc.double_quant);
        for (auto& kv : state_dict(name, q)) out.push_back(std::move(kv));
        ++r.quantized;
        r.quantized_params += q.numel();
      } else {
        out.emplace_back(name, w.get(name));  // unchanged bytes (a view of the input)
        ++r.kept;
      }
    }
    for (const auto& [k, t] : out) {
      weight_map[k] = fname;
      r.bytes_out += t.nbytes();
    }
    save_safetensors((fs::path(out_dir) / fname).string(), out, {{"format", "pt"}}, true);
  }
  if (plan.size() > 1) {
    json index = {{"metadata", {{"total_size", r.bytes_out}}}, {"weight_map", weight_map}};
    write_file_atomic((fs::path(out_dir) / "model.safetensors.index.json").string(),
                      index.dump(2) + "\n");
  }
  for (const auto& e : fs::directory_iterator(in_dir))
    if (e.is_regular_file() && !weight_file(e.path()))
      write_file_atomic((fs::path(out_dir) / e.path().filename()).string(),
                        read_file(e.path().string()));
  // config.json last: the folder is a bitsandbytes model only once its weights are all there.
  json c = cfg.raw;
  c["quantization_config"] = quantization_config_json(qc);
  write_file_atomic((fs::path(out_dir) / "config.json").string(), c.dump(2) + "\n");
  return r;
}

}  // namespace rig::quant
