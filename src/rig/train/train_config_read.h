// Reading a training config's YAML tree: typed values with the file and line they came from,
// one mapping at a time, and --set overrides. Shared by the train_config*.cpp files only.
#pragma once
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "rig/core/error.h"

namespace rig::config_read {

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);
std::string join(const std::vector<std::string>& v, const char* sep = ", ");

struct Ctx {
  std::string source;
  std::set<std::string> override_paths;
  struct Assigned {
    std::string path, where;
    bool from_override;
  };
  std::map<std::string, Assigned> assigned;  // field -> who set it
};

// One key's value with what is needed to report on it.
struct Item {
  std::string path;  // dotted: "lora.r", "datasets.0.path"
  YAML::Node value;
  int line = -1;  // 1-based; -1 when unknown
  bool from_override = false;
};

std::string where(const Ctx& ctx, const Item& it);
bool is_override(const Ctx& ctx, const std::string& path);
[[noreturn]] void type_error(const Ctx& ctx, const Item& it, const char* expected);
int64_t as_int(const Ctx& ctx, const Item& it);
double as_double(const Ctx& ctx, const Item& it);
bool as_bool(const Ctx& ctx, const Item& it);
std::string as_string(const Ctx& ctx, const Item& it);
std::string as_enum(const Ctx& ctx, const Item& it, const std::vector<std::string>& allowed,
                    const std::map<std::string, std::string>& aliases = {});
YAML::Node need_map(const Ctx& ctx, const Item& it);

// Plain scalars become numbers, booleans or null when they read as such; quoted ones stay strings.
nlohmann::json yaml_to_json(const YAML::Node& n);

// Reads one mapping: take() each key of the schema (train_config_schema.h) that it handles, then
// finish() rejects whatever was not taken, suggesting the closest key the schema has there.
class MapReader {
 public:
  MapReader(Ctx& ctx, YAML::Node node, std::string prefix)
      : ctx_(ctx), node_(std::move(node)), prefix_(std::move(prefix)) {}
  std::optional<Item> take(const std::string& key);
  void finish();

 private:
  Ctx& ctx_;
  YAML::Node node_;
  std::string prefix_;
  std::set<std::string> used_;
};

// Two keys meaning the same thing (learning_rate and optimizer.lr): an override beats the file;
// two from the same place are an error naming both.
template <typename F>
void assign(Ctx& ctx, const std::string& field, const Item& it, F apply) {
  auto prev = ctx.assigned.find(field);
  if (prev != ctx.assigned.end()) {
    if (prev->second.from_override && !it.from_override) return;
    if (prev->second.from_override == it.from_override)
      bad_input("{}: '{}' and '{}' ({}) both set {}; keep one", where(ctx, it), it.path,
                prev->second.path, prev->second.where, field);
  }
  apply();
  ctx.assigned[field] = {it.path, where(ctx, it), it.from_override};
}

// Applies one --set KEY=VALUE to the tree and records KEY in `paths`.
void apply_override(YAML::Node root, const std::string& spec, const std::string& source,
                    std::set<std::string>& paths);

}  // namespace rig::config_read
