// NVML, loaded at run time. The library exists only where an NVIDIA driver is installed, so rig
// never links it: it dlopens libnvidia-ml.so.1 (or $RIG_NVML_LIBRARY, which tests point at a fake)
// and resolves each function by name. Functions an older driver lacks stay null and read as
// "not supported".
#pragma once
#include <memory>
#include <string>

#include "rig/hw/nvml_api.h"

namespace rig::hw {

class Nvml {
 public:
  // Loads `library` (empty: $RIG_NVML_LIBRARY, else libnvidia-ml.so.1) and calls nvmlInit_v2.
  // Throws rig::Error with a message a user can act on when either step fails.
  static std::shared_ptr<Nvml> load(std::string library = "");
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  const std::string& library() const { return library_; }
  std::string error_string(nvmlReturn_t r) const;

#define RIG_NVML_POINTER(name, ret, args) decltype(&::name) name = nullptr;
  RIG_NVML_FUNCTIONS(RIG_NVML_POINTER)
#undef RIG_NVML_POINTER

 private:
  Nvml() = default;
  void* handle_ = nullptr;
  bool initialized_ = false;
  std::string library_;
};

// The library rig would load: $RIG_NVML_LIBRARY or libnvidia-ml.so.1.
std::string default_nvml_library();

}  // namespace rig::hw
