#include "rig/plan/models.h"

#include <filesystem>

#include "rig/core/error.h"
#include "rig/model/catalog.h"

namespace rig::plan {
// The shapes live in the model catalogue (rig/model/catalog.h), shared with `rig bench train`
// and training configs; the parameter counts they give are checked in plan_test.

std::vector<std::string> builtin_model_names() {
  return catalog_names();
}

ModelConfig builtin_model(const std::string& name) {
  if (const CatalogModel* m = find_catalog_model(name))
    return ModelConfig::from_json(m->config, name);
  std::string names;
  for (const auto& n : catalog_names()) names += std::string(names.empty() ? "" : ", ") + n;
  bad_input("model '{}': not a built-in shape ({}) and no such file or folder", name, names);
}

ModelConfig resolve_model(const std::string& name_or_path) {
  if (std::filesystem::exists(name_or_path)) return ModelConfig::load(name_or_path);
  return builtin_model(name_or_path);
}

}  // namespace rig::plan
