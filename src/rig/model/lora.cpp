#include "rig/model/lora.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"

namespace rig {

const std::vector<std::string> kProjections = {"q_proj", "k_proj",  "v_proj",   "o_proj",
                                               "gate_proj", "up_proj", "down_proj"};

float LoraConfig::scaling() const {
  return rslora ? alpha / std::sqrt(float(r)) : alpha / float(r);
}

bool LoraConfig::targets_module(const std::string& proj) const {
  return std::find(targets.begin(), targets.end(), proj) != targets.end();
}

void LoraConfig::validate(const std::string& src) const {
  if (r <= 0) bad_input("{}: LoRA rank r must be positive, found {}", src, r);
  if (!(alpha > 0)) bad_input("{}: LoRA alpha must be positive", src);
  if (dropout < 0 || dropout >= 1) bad_input("{}: LoRA dropout must be in [0, 1)", src);
  if (targets.empty()) bad_input("{}: LoRA needs at least one target module", src);
  for (const auto& t : targets)
    if (std::find(kProjections.begin(), kProjections.end(), t) == kProjections.end())
      bad_input("{}: LoRA target '{}' is not one of q_proj k_proj v_proj o_proj gate_proj up_proj "
                "down_proj", src, t);
}

LoraConfig load_lora_config(const std::string& dir) {
  std::string path = (std::filesystem::path(dir) / "adapter_config.json").string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    bad_input("{}: not valid JSON: {}", path, e.what());
  }
  if (j.value("peft_type", "LORA") != "LORA")
    bad_input("{}: peft_type '{}' is not supported (only LORA)", path, j.value("peft_type", ""));
  if (j.value("use_dora", false)) bad_input("{}: DoRA adapters are not supported", path);
  LoraConfig c;
  try {
    c.r = j.at("r").get<int>();
    c.alpha = j.value("lora_alpha", float(c.r));
    c.dropout = j.value("lora_dropout", 0.0f);
    c.rslora = j.value("use_rslora", false);
    c.targets.clear();
    const auto& t = j.at("target_modules");
    if (t.is_string()) {
      if (t == "all-linear") c.targets = kProjections;
      else c.targets.push_back(t);
    } else {
      for (const auto& s : t) c.targets.push_back(s.get<std::string>());
    }
  } catch (const nlohmann::json::exception& e) {
    bad_input("{}: {}", path, e.what());
  }
  std::sort(c.targets.begin(), c.targets.end(), [](const std::string& a, const std::string& b) {
    return std::find(kProjections.begin(), kProjections.end(), a) <
           std::find(kProjections.begin(), kProjections.end(), b);
  });
  c.validate(path);
  return c;
}

}  // namespace rig
