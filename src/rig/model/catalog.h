// The model catalogue: every model rig knows by name, as the fields of its Hugging Face
// config.json. `rig plan --model`, `rig bench train --preset` and a training config's
// `architecture:` all read this one table, so a shape is written down once.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rig/model/config.h"

namespace rig {

struct CatalogModel {
  std::string name;                  // what users type: llama3-8b
  std::vector<std::string> aliases;  // other accepted names: llama3.2-1b for llama3-1b
  std::string source;                // where the numbers come from
  nlohmann::json config;             // config.json fields (model_type, sizes, RoPE, ...)
};

// In table order: tiny, llama2-7b, llama3-8b, llama3.1-8b, llama3-70b, llama3-1b, llama3-3b,
// qwen2.5-0.5b/7b/14b/32b/72b, qwen3-0.6b/1.7b/4b/8b/14b/32b, mistral-7b.
const std::vector<CatalogModel>& model_catalog();

// Every accepted name, aliases right after their model.
std::vector<std::string> catalog_names();

// The entry of a name or alias; nullptr when there is none.
const CatalogModel* find_catalog_model(const std::string& name);

// The shape of an entry with plain RoPE (rope_theta only, no rope_scaling, the default
// max_position_embeddings), as bench/hf_baseline.py builds its LlamaConfig for side-by-side runs.
// Throws InputError naming `what` and listing the names for an unknown one.
nlohmann::json catalog_bench_config(const std::string& name, const std::string& what);

}  // namespace rig
