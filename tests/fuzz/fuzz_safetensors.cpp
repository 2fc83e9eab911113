#include <cstddef>
#include <cstdint>

#include "rig/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto h = rig::parse_safetensors_header(data, size, "fuzz");
    // Every accepted tensor must lie inside the buffer.
    for (const auto& t : h.tensors)
      if (h.data_start + t.end > size) __builtin_trap();
  } catch (const rig::InputError&) {
  }
  return 0;
}
