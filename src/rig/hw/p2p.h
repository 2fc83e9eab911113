// The peer-to-peer matrix: may GPU i write into GPU j directly (cudaDeviceCanAccessPeer), and how
// fast a copy from i to j really goes. On GeForce cards the stock driver says no, and copies go
// through host memory; the measured bandwidth shows what NCCL will get either way.
// The measurement lives in p2p_cuda.cpp and exists only in CUDA builds.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace rig::hw {

struct P2PMatrix {
  bool measured = false;
  std::string note;                          // why not measured, or how it was measured
  std::vector<std::vector<int>> can_access;  // 1 yes, 0 no, -1 unknown; indexed by NVML index
  std::vector<std::vector<double>> gbps;     // copy bandwidth i -> j in GB/s; 0 unknown
  bool any_denied() const;
  nlohmann::json to_json() const;
};

// `bus_ids`: NVML's bus ids in NVML order, so the matrix is indexed like every other report
// even when CUDA enumerates the GPUs in another order.
P2PMatrix measure_p2p(const std::vector<std::string>& bus_ids);

}  // namespace rig::hw
