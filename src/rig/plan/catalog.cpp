#include "rig/plan/catalog.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"

namespace rig::plan {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string normalize(std::string s) {
  s = lower(s);
  for (const char* prefix :
       {"nvidia-", "nvidia ", "nvidia", "geforce-", "geforce ", "rtx-", "rtx ", "rtx"})
    if (s.starts_with(prefix)) s = s.substr(std::string(prefix).size());
  return s;
}

template <typename T>
void get(const YAML::Node& n, const char* field, T& out, const std::string& where) {
  if (!n[field]) return;
  try {
    out = n[field].as<T>();
  } catch (const YAML::Exception& e) {
    bad_input("{}: field '{}' (line {}): expected a {}", where, field, n[field].Mark().line + 1,
              std::is_same_v<T, bool>   ? "boolean"
              : std::is_arithmetic_v<T> ? "number"
                                        : "string");
  }
  if constexpr (std::is_floating_point_v<T>)
    if (!std::isfinite(out))
      bad_input("{}: field '{}' (line {}): expected a finite number", where, field,
                n[field].Mark().line + 1);
}

const std::vector<std::string> kFields = {
    "aliases", "name",       "memory_gb", "memory_mib",     "bandwidth_gbs", "bf16_tflops",
    "tdp_w",   "transient",  "price_usd", "cloud_usd_hour", "pcie_gen",      "p2p",
    "nvlink",  "nvlink_gbs", "ecc",       "fit_per_gb"};

}  // namespace

Catalog Catalog::builtin() {
  Catalog c;
  c.merge_yaml(builtin_catalog_yaml(), "built-in catalog");
  return c;
}

void Catalog::merge_file(const std::string& path) {
  merge_yaml(read_file(path), path);
}

void Catalog::merge_yaml(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    bad_input("{}: not valid YAML at line {}: {}", source, e.mark.line + 1, e.msg);
  }
  if (!root.IsMap() || !root["gpus"] || !root["gpus"].IsMap())
    bad_input("{}: expected a top-level 'gpus:' map of cards", source);
  for (const auto& kv : root["gpus"]) {
    const std::string key = lower(kv.first.as<std::string>());
    const YAML::Node& n = kv.second;
    const std::string where = source + ": gpus." + key;
    if (!n.IsMap()) bad_input("{}: expected a map of fields", where);
    for (const auto& f : n) {
      auto name = f.first.as<std::string>();
      if (std::find(kFields.begin(), kFields.end(), name) == kFields.end())
        bad_input("{}: unknown field '{}' (line {})", where, name, f.first.Mark().line + 1);
    }
    bool is_new = !gpus_.count(key);
    GpuSpec& g = gpus_[key];
    g.key = key;
    get(n, "name", g.name, where);
    get(n, "aliases", g.aliases, where);
    get(n, "memory_gb", g.memory_gb, where);
    get(n, "memory_mib", g.memory_mib, where);
    get(n, "bandwidth_gbs", g.bandwidth_gbs, where);
    get(n, "bf16_tflops", g.bf16_tflops, where);
    get(n, "tdp_w", g.tdp_w, where);
    get(n, "transient", g.transient, where);
    get(n, "price_usd", g.price_usd, where);
    get(n, "cloud_usd_hour", g.cloud_usd_hour, where);
    get(n, "pcie_gen", g.pcie_gen, where);
    get(n, "p2p", g.p2p, where);
    get(n, "nvlink_gbs", g.nvlink_gbs, where);
    get(n, "ecc", g.ecc, where);
    get(n, "fit_per_gb", g.fit_per_gb, where);
    std::string nv = g.nvlink == NvLink::sxm      ? "sxm"
                     : g.nvlink == NvLink::bridge ? "bridge"
                                                  : "none";
    get(n, "nvlink", nv, where);
    if (nv == "none")
      g.nvlink = NvLink::none;
    else if (nv == "bridge")
      g.nvlink = NvLink::bridge;
    else if (nv == "sxm")
      g.nvlink = NvLink::sxm;
    else
      bad_input("{}: nvlink '{}': expected none, bridge or sxm", where, nv);
    if (g.name.empty()) g.name = key;
    // A new card must say enough to be planned with.
    if (is_new && (g.memory_mib <= 0 || g.bf16_tflops <= 0 || g.tdp_w <= 0))
      bad_input("{}: a new card needs memory_mib, bf16_tflops and tdp_w (all > 0)", where);
    if (g.memory_gb <= 0) g.memory_gb = g.memory_mib * 1024 * 1024 / 1e9;
    if (g.pcie_gen < 1 || g.pcie_gen > 6)
      bad_input("{}: pcie_gen {} is not 1..6", where, g.pcie_gen);
  }
}

const GpuSpec& Catalog::find(const std::string& name) const {
  const std::string want = normalize(name);
  for (const auto& [key, g] : gpus_) {
    if (normalize(key) == want) return g;
    for (const auto& a : g.aliases)
      if (normalize(a) == want) return g;
  }
  std::string known;
  for (const auto& [key, g] : gpus_) known += (known.empty() ? "" : ", ") + key;
  bad_input("GPU '{}' is not in the catalog (known: {}); add it with --catalog FILE", name, known);
}

}  // namespace rig::plan
