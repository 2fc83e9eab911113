// A bitsandbytes 4-bit weight's quant-state JSON (`weight.quant_state.bitsandbytes__nf4`), as
// LlamaModel::load and rig inspect read it, beside a real packed weight and its scales.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "rig/io/safetensors.h"
#include "rig/quant/nf4.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  const std::string key = "w.weight";
  // A real 8 x 40 weight quantized once (blocks of 64 with a partial last block, double quant).
  static const std::vector<std::pair<std::string, rig::Tensor>> base = [&] {
    std::vector<float> v(320);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(int(i * 37 % 101) - 50) / 50.0f;
    auto q = rig::quant::quantize_4bit(rig::Tensor::from_f32(v, {8, 40}));
    auto sd = rig::quant::state_dict(key, q);
    // How the kept seed corpus/quant_state/valid.json was made.
    if (const char* to = std::getenv("RIG_FUZZ_DUMP_SEED")) {
      std::ofstream(to) << rig::quant::quant_state_json(q);
    }
    return sd;
  }();
  static const std::string path =
      (fs::temp_directory_path() / ("rig-fuzz-qs-" + std::to_string(getpid()) + ".safetensors"))
          .string();
  std::vector<std::pair<std::string, rig::Tensor>> ts;
  for (const auto& [name, t] : base) {
    if (name.find(".quant_state.") == std::string::npos) {
      ts.emplace_back(name, t);
      continue;
    }
    rig::Tensor js = rig::Tensor::empty({int64_t(size)}, rig::DType::U8);
    if (size) std::memcpy(js.raw(), data, size);
    ts.emplace_back(name, js);
  }
  rig::fuzz::run_input([&] {
    rig::save_safetensors(path, ts);
    const auto w = rig::WeightFiles::open_file(path);
    rig::quant::QuantizedWeight q = rig::quant::load_quantized(w, key, {8, 40});
    rig::Tensor out = rig::Tensor::empty({8, 40}, rig::DType::F32);
    rig::quant::dequantize_4bit(q, out);
  });
  return 0;
}
