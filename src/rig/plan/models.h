// Built-in model shapes with their published dimensions, so `rig plan` works without a download.
#pragma once
#include <string>
#include <vector>

#include "rig/model/config.h"

namespace rig::plan {

// Names: llama3-1b, llama3-3b, llama3-8b, llama3-70b, qwen2.5-7b, qwen2.5-14b, qwen2.5-32b,
// qwen2.5-72b, mistral-7b. Throws InputError listing the names for an unknown one.
ModelConfig builtin_model(const std::string& name);
std::vector<std::string> builtin_model_names();

// A built-in name, a config.json file, or a folder holding one.
ModelConfig resolve_model(const std::string& name_or_path);

}  // namespace rig::plan
