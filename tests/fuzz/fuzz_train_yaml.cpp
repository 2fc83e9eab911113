// The training config reader (YAML text, aliases, overrides, validation).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "rig/train/train_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  rig::fuzz::run_input([&] {
    rig::TrainConfig c = rig::parse_train_config(text, "fuzz.yaml");
    // An accepted config writes YAML that reads back to the same config.
    if (rig::parse_train_config(c.to_yaml(), "back.yaml").config_hash() != c.config_hash())
      rig::fuzz::bug("the resolved config does not read back to the same config");
  });
  return 0;
}
