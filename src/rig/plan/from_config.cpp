#include "rig/plan/from_config.h"

#include <filesystem>

#include "rig/core/error.h"
#include "rig/model/catalog.h"

namespace rig::plan {

TrainSetup train_setup_of(const TrainConfig& c) {
  TrainSetup s;
  s.method = parse_method(c.method);
  s.lora_rank = c.lora.r;
  std::string targets;
  for (const auto& t : c.lora.targets) targets += (targets.empty() ? "" : ",") + t;
  s.lora_targets = parse_lora_targets(targets);
  s.seq_len = c.sequence_len;
  s.micro_batch = c.micro_batch_size;
  s.grad_accum = c.gradient_accumulation_steps;
  s.checkpointing = parse_checkpointing(c.activation_checkpointing);
  s.recompute_layers = c.recompute_layers;
  s.optimizer = parse_optimizer(c.optimizer.name);
  s.strategy = parse_strategy(c.strategy == "auto" ? "ddp" : c.strategy);
  s.precision = parse_precision(c.resolved_precision(c.device != "cpu"));
  s.bucket_bytes = c.dist.bucket_mb * 1024 * 1024;
  return s;
}

ModelConfig model_of(const TrainConfig& c) {
  const nlohmann::json arch = c.architecture_json();
  if (!arch.is_null()) return ModelConfig::from_json(arch, c.source + ": architecture");
  if (!c.model.empty() && std::filesystem::exists(c.model)) return ModelConfig::load(c.model);
  if (const CatalogModel* m = find_catalog_model(c.model))  // a name or alias: llama3-8b
    return ModelConfig::from_json(m->config, m->name);
  for (const auto& m : model_catalog())
    if (m.source == c.model) return ModelConfig::from_json(m.config, m.name);
  bad_input(
      "{}: model '{}' is no folder here and no built-in shape's Hugging Face id; give rig plan "
      "--model (a built-in shape, config.json or model folder)",
      c.source, c.model);
}

}  // namespace rig::plan
