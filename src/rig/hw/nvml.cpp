#include "rig/hw/nvml.h"

#include <dlfcn.h>

#include <cstdlib>

#include "rig/core/error.h"

namespace rig::hw {

std::string default_nvml_library() {
  const char* env = std::getenv("RIG_NVML_LIBRARY");
  return env && *env ? env : "libnvidia-ml.so.1";
}

std::shared_ptr<Nvml> Nvml::load(std::string library) {
  if (library.empty()) library = default_nvml_library();
  std::shared_ptr<Nvml> n(new Nvml());
  n->library_ = library;
  dlerror();
  n->handle_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!n->handle_) {
    const char* why = dlerror();
    fail(
        "NVML not available: cannot load {} ({}). Is the NVIDIA driver installed? "
        "(set RIG_NVML_LIBRARY to use another library)",
        library, why ? why : "unknown reason");
  }
#define RIG_NVML_RESOLVE(name, ret, args) \
  n->name = reinterpret_cast<decltype(&::name)>(dlsym(n->handle_, #name));
  RIG_NVML_FUNCTIONS(RIG_NVML_RESOLVE)
#undef RIG_NVML_RESOLVE
  if (!n->nvmlInit_v2 || !n->nvmlShutdown || !n->nvmlDeviceGetCount_v2 ||
      !n->nvmlDeviceGetHandleByIndex_v2)
    fail(
        "NVML: {} lacks nvmlInit_v2/nvmlDeviceGetCount_v2; the driver is too old or this is not "
        "NVML",
        library);
  nvmlReturn_t r = n->nvmlInit_v2();
  if (r != NVML_SUCCESS)
    fail("NVML: nvmlInit_v2 failed: {} (code {}). {}", n->error_string(r), r,
         r == NVML_ERROR_DRIVER_NOT_LOADED ? "The NVIDIA kernel module is not loaded."
         : r == NVML_ERROR_LIB_RM_VERSION_MISMATCH
             ? "The driver library and kernel module versions differ: reboot after a driver update."
         : r == NVML_ERROR_NO_PERMISSION ? "No permission to open /dev/nvidia*."
                                         : "");
  n->initialized_ = true;
  return n;
}

Nvml::~Nvml() {
  if (initialized_ && nvmlShutdown) nvmlShutdown();
  if (handle_) dlclose(handle_);
}

std::string Nvml::error_string(nvmlReturn_t r) const {
  if (nvmlErrorString) {
    const char* s = nvmlErrorString(r);
    if (s) return s;
  }
  return "NVML error " + std::to_string(r);
}

}  // namespace rig::hw
