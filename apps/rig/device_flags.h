// --device and --dtype of the commands that run a model outside training (rig eval, generate,
// merge, debug forward-backward): the same spelling and resolution everywhere
// (rig::resolve_compute, as a training config's device: and precision:).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

namespace rig::cli {

inline CLI::Option* add_device_flag(CLI::App& app, std::string& device,
                                    const std::string& more = "") {
  return app
      .add_option("--device", device,
                  "auto, cpu, cuda or cuda:N; auto: cuda when a GPU is visible, else cpu" + more)
      ->capture_default_str();
}

inline CLI::Option* add_compute_dtype_flag(
    CLI::App& app, std::string& dtype,
    const std::string& what_auto = "auto: bf16 on CUDA (as training), f32 on the CPU") {
  return app
      .add_option("--dtype", dtype, "compute dtype: auto, f32 or bf16 (CUDA only); " + what_auto)
      ->capture_default_str();
}

}  // namespace rig::cli
