// rig debug random-model: a Hugging Face model folder (config.json + safetensors) of a catalogue
// shape with random weights (normal(0, 0.02), norms at one), and optionally a tokenizer.json
// beside it, so that the tools (generate, eval, merge, quantize) can be run and timed at a real
// size, e.g. bench/generate_8b.sh on an 8B shape, without downloading weights.
#include <filesystem>

#include "command.h"
#include "flags.h"
#include "rig/model/catalog.h"
#include "rig/model/llama.h"

namespace {

namespace fs = std::filesystem;

struct O {
  std::string architecture, out, dtype = "bf16", tokenizer;
  uint64_t seed = 1;
};

int run(const O& o) {
  const rig::CatalogModel* entry = rig::find_catalog_model(o.architecture);
  if (!entry) {
    std::string names;
    for (const auto& n : rig::catalog_names()) names += (names.empty() ? "" : ", ") + n;
    rig::bad_input("debug random-model: --architecture '{}' is not one of {}", o.architecture,
                   names);
  }
  if (o.dtype != "bf16" && o.dtype != "f32" && o.dtype != "f16")
    rig::bad_input("debug random-model: --dtype '{}' is not one of bf16, f32, f16", o.dtype);
  if (!o.tokenizer.empty() && !fs::is_regular_file(o.tokenizer))
    rig::bad_input("debug random-model: --tokenizer {}: no such file", o.tokenizer);
  const rig::DType dt = o.dtype == "bf16"  ? rig::DType::BF16
                        : o.dtype == "f16" ? rig::DType::F16
                                           : rig::DType::F32;
  const rig::ModelConfig cfg = rig::ModelConfig::from_json(entry->config, entry->name);
  auto m = rig::LlamaModel::random(cfg, o.seed);
  m->save_pretrained(o.out, dt);
  if (!o.tokenizer.empty())
    fs::copy_file(o.tokenizer, fs::path(o.out) / "tokenizer.json",
                  fs::copy_options::overwrite_existing);
  fmt::print("wrote a random {} ({} parameters, {}) to {}\n", entry->name, m->num_parameters(false),
             rig::dtype_name(dt), o.out);
  return 0;
}

rig::cli::Registrar reg(
    "debug random-model",
    "Write a Hugging Face model folder of a catalogue shape with random weights (for benchmarks)",
    [](CLI::App& app) {
      auto o = std::make_shared<O>();
      app.add_option("--architecture", o->architecture,
                     "catalogue name, e.g. llama3-8b (rig plan --help lists them)")
          ->required();
      app.add_option("--out", o->out, "output model folder")->required();
      app.add_option("--dtype", o->dtype, "weights as written: bf16, f32 or f16")
          ->capture_default_str();
      app.add_option("--tokenizer", o->tokenizer, "tokenizer.json to copy beside the weights");
      rig::cli::add_number(app, "--seed", o->seed, "weights' seed", rig::cli::at_least(0))
          ->capture_default_str();
      return [o] { return run(*o); };
    });

}  // namespace
