// LoRA settings and PEFT adapter files (adapter_config.json + adapter_model.safetensors).
#pragma once
#include <string>
#include <vector>

namespace rig {

struct LoraConfig {
  int r = 8;
  float alpha = 16;
  float dropout = 0;
  bool rslora = false;  // scaling alpha/sqrt(r) instead of alpha/r
  std::vector<std::string> targets = {"q_proj", "k_proj", "v_proj", "o_proj",
                                      "gate_proj", "up_proj", "down_proj"};
  float scaling() const;
  bool targets_module(const std::string& proj) const;
  void validate(const std::string& source) const;
};

extern const std::vector<std::string> kProjections;  // the seven projection names

// Reads adapter_config.json from a PEFT adapter folder.
LoraConfig load_lora_config(const std::string& adapter_dir);

}  // namespace rig
