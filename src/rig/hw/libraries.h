// Versions of the GPU runtime libraries rig would use, found the way the loader finds them
// (dlopen by soname) and asked through their own version calls. Nothing is linked, so doctor
// reports "not found" instead of failing to start where a library is missing.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace rig::hw {

struct LibraryVersion {
  std::string name;  // "nccl", "cudnn", "cudart"
  bool found = false;
  std::string library;  // the soname or path that loaded
  int raw = 0;          // the library's own number (22105, 90100, 12040)
  std::string version;  // "2.21.5"
  std::string error;    // why it was not found
  nlohmann::json to_json() const;
};

// Each library can be redirected with $RIG_NCCL_LIBRARY, $RIG_CUDNN_LIBRARY, $RIG_CUDART_LIBRARY.
std::vector<LibraryVersion> probe_libraries();

// Version number decoders, exposed for tests.
std::string nccl_version_string(int v);   // 22105 -> 2.21.5 (2.9+), 2708 -> 2.7.8
std::string cudnn_version_string(int v);  // 90100 -> 9.1.0, 8902 -> 8.9.2

}  // namespace rig::hw
