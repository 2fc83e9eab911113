// The model catalogue's shapes (rig/model/catalog.h), so `rig plan` works without a download.
#pragma once
#include <string>
#include <vector>

#include "rig/model/config.h"

namespace rig::plan {

// Any catalogue name (llama3-1b/3b/8b/70b, qwen2.5-7b/14b/32b/72b, mistral-7b, ...). Throws
// InputError listing the names for an unknown one.
ModelConfig builtin_model(const std::string& name);
std::vector<std::string> builtin_model_names();

// A built-in name, a config.json file, or a folder holding one.
ModelConfig resolve_model(const std::string& name_or_path);

}  // namespace rig::plan
