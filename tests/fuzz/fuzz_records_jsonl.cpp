// JSONL records (alpaca and chat, both chat templates) rendered with the demo tokenizer.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "fuzz_common.h"
#include "rig/data/records.h"
#include "rig/text/tokenizer.h"

#ifndef RIG_DEMO_TOKENIZER
#define RIG_DEMO_TOKENIZER "data/demo/tokenizer.json"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const rig::Tokenizer tok = rig::Tokenizer::load(RIG_DEMO_TOKENIZER);
  static const std::string path = (std::filesystem::temp_directory_path() /
                                   ("rig-fuzz-records-" + std::to_string(getpid()) + ".jsonl"))
                                      .string();
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  for (auto fmt : {rig::DataFormat::Alpaca, rig::DataFormat::Chat})
    for (bool skip : {false, true})
      rig::fuzz::run_input([&] {
        rig::RenderOptions o;
        o.format = fmt;
        o.chat = rig::ChatTemplate::ChatML;
        o.skip_invalid = skip;
        o.threads = 1;
        rig::load_samples(path, &tok, o);
      });
  return 0;
}
