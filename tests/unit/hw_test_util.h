// Helpers of the hw_*test.cpp files: environment variables for a test, and the fake NVML.
#pragma once
#include <cstdlib>
#include <string>
#include <vector>

namespace rig::test {

// Sets environment variables for the test's lifetime (the fake reads them; so does a child rig).
struct Env {
  std::vector<std::string> names;
  void set(const std::string& k, const std::string& v) {
    setenv(k.c_str(), v.c_str(), 1);
    names.push_back(k);
  }
  ~Env() {
    for (auto& n : names) unsetenv(n.c_str());
  }
};

// The fake NVML with `scenario`, and the fake standing in for NCCL, cuDNN and the CUDA runtime,
// so the result does not depend on what this machine has installed.
struct Fake : Env {
  explicit Fake(const std::string& scenario) {
    set("FAKE_NVML_SCENARIO", scenario);
    set("RIG_NVML_LIBRARY", FAKE_NVML_LIBRARY);
    set("RIG_NCCL_LIBRARY", FAKE_NVML_LIBRARY);
    set("RIG_CUDNN_LIBRARY", FAKE_NVML_LIBRARY);
    set("RIG_CUDART_LIBRARY", FAKE_NVML_LIBRARY);
  }
};

}  // namespace rig::test
