// tokenizer.json: the model, normalizer, pre-tokenizer and added tokens; an accepted one must
// encode and decode a few strings.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "rig/text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  rig::fuzz::run_input([&] {
    rig::Tokenizer t = rig::Tokenizer::from_json(text, "fuzz.json");
    for (const char* s : {"hello world", "  x\n\ty ", "\xc3\xa9t\xc3\xa9 123", ""}) {
      auto ids = t.encode(s);
      t.decode(ids);
    }
  });
  return 0;
}
