// A checkpoint's manifest.json, as resume (load_checkpoint), the guard (verify before use) and
// rig ckpt verify read it, beside a real state.safetensors and trainer_state.json.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "fuzz_common.h"
#include "rig/train/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const std::string dir = [] {
    const fs::path run = fs::temp_directory_path() / ("rig-fuzz-ckpt-" + std::to_string(getpid()));
    fs::remove_all(run);
    std::string d = rig::save_checkpoint(run.string(), 1,
                                         {{"param.w", rig::Tensor::from_f32({1, 2, 3, 4}, {2, 2})}},
                                         nlohmann::json{{"optimizer_step", 1}});
    // How the kept seed corpus/checkpoint_manifest/valid.json was made.
    if (const char* to = std::getenv("RIG_FUZZ_DUMP_SEED")) fs::copy_file(d + "/manifest.json", to);
    return d;
  }();
  std::ofstream(dir + "/manifest.json", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  // verify_checkpoint reports problems and never throws for a bad checkpoint.
  try {
    rig::verify_checkpoint(dir).to_text();
  } catch (const std::exception& e) {
    rig::fuzz::bug((std::string("verify_checkpoint threw: ") + e.what()).c_str());
  }
  rig::fuzz::run_input([&] { rig::load_checkpoint(dir); });
  rig::fuzz::run_input(
      [&] { rig::list_checkpoints(fs::path(dir).parent_path().parent_path().string()); });
  return 0;
}
