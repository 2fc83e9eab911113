// Where the GPUs sit: NUMA node and CPU set of each (from hwloc's PCI tree), and the PCIe path
// between every pair, named as `nvidia-smi topo -m` names it, because a pair behind one PCIe
// switch (PIX) all-reduces much faster than a pair whose traffic crosses the CPU sockets (SYS).
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace rig::hw {

struct GpuPlacement {
  int gpu = 0;
  std::string bus_id;
  bool found = false;  // hwloc saw an NVIDIA device at this bus id
  int numa_node = -1;
  std::string cpus;                 // "0-15,32-47"
  std::optional<double> link_gbps;  // PCIe bandwidth of the link, as hwloc reads it
};

struct Topology {
  bool ok = false;
  std::string error;
  int packages = 0, numa_nodes = 0, cores = 0, pus = 0;
  std::vector<GpuPlacement> gpus;
  // paths[i][j]: "X" (self), "PIX", "PXB", "PHB", "NODE", "SYS", or "?" when unknown.
  std::vector<std::vector<std::string>> paths;
  bool spans_numa_nodes() const;
  nlohmann::json to_json() const;
};

// `bus_ids` in NVML's spelling (00000000:01:00.0). `xml`: load an hwloc XML export instead of
// probing this machine (tests, or `lstopo --of xml` from another box).
Topology probe_topology(const std::vector<std::string>& bus_ids, const std::string& xml = "");

}  // namespace rig::hw
