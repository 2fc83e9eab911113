#include "rig/hw/libraries.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>

namespace rig::hw {

std::string nccl_version_string(int v) {
  // NCCL_VERSION_CODE is X*1000+Y*100+Z before 2.9 and X*10000+Y*100+Z since.
  if (v >= 20900) return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  return fmt::format("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100);
}

std::string cudnn_version_string(int v) {
  // cuDNN 9 changed CUDNN_VERSION from X*1000+Y*100+Z to X*10000+Y*100+Z.
  if (v >= 90000) return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  return fmt::format("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100);
}

nlohmann::json LibraryVersion::to_json() const {
  nlohmann::json j = {{"name", name}, {"found", found}};
  if (found) {
    j["library"] = library;
    j["version"] = version;
    j["raw"] = raw;
  } else {
    j["error"] = error;
  }
  return j;
}

namespace {

// Opens the first of `names` that loads; the handle stays open (the process may use it later).
void* open_first(const char* env, std::vector<std::string> names, LibraryVersion& out) {
  if (const char* e = std::getenv(env); e && *e) names = {e};
  std::string errors;
  for (const auto& n : names) {
    if (void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      out.library = n;
      return h;
    }
    const char* why = dlerror();
    if (errors.empty()) errors = why ? why : n + ": not found";
  }
  out.error = errors;
  return nullptr;
}

}  // namespace

std::vector<LibraryVersion> probe_libraries() {
  std::vector<LibraryVersion> out;
  {
    LibraryVersion l;
    l.name = "nccl";
    if (void* h = open_first("RIG_NCCL_LIBRARY", {"libnccl.so.2", "libnccl.so"}, l)) {
      using Fn = int (*)(int*);
      auto fn = reinterpret_cast<Fn>(dlsym(h, "ncclGetVersion"));
      if (fn && fn(&l.raw) == 0) {
        l.found = true;
        l.version = nccl_version_string(l.raw);
      } else {
        l.error = l.library + ": ncclGetVersion failed";
      }
    }
    out.push_back(l);
  }
  {
    LibraryVersion l;
    l.name = "cudnn";
    if (void* h =
            open_first("RIG_CUDNN_LIBRARY", {"libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"}, l)) {
      using Fn = size_t (*)();
      if (auto fn = reinterpret_cast<Fn>(dlsym(h, "cudnnGetVersion"))) {
        l.raw = int(fn());
        l.found = true;
        l.version = cudnn_version_string(l.raw);
      } else {
        l.error = l.library + ": no cudnnGetVersion";
      }
    }
    out.push_back(l);
  }
  {
    LibraryVersion l;
    l.name = "cudart";
    if (void* h = open_first(
            "RIG_CUDART_LIBRARY",
            {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"}, l)) {
      using Fn = int (*)(int*);
      auto fn = reinterpret_cast<Fn>(dlsym(h, "cudaRuntimeGetVersion"));
      if (fn && fn(&l.raw) == 0) {
        l.found = true;
        l.version = fmt::format("{}.{}", l.raw / 1000, (l.raw % 1000) / 10);
      } else {
        l.error = l.library + ": cudaRuntimeGetVersion failed";
      }
    }
    out.push_back(l);
  }
  return out;
}

}  // namespace rig::hw
