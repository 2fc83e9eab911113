// A Hugging Face config.json as ModelConfig::load reads it.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_common.h"
#include "rig/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return 0;  // load() reports invalid JSON itself; the values are the target
  rig::fuzz::run_input([&] { rig::ModelConfig::from_json(j, "config.json"); });
  return 0;
}
