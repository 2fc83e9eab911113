// `rig doctor`: is this machine ready to train? Each check gives a verdict (ok, warn, fail, skip)
// and one line a user can act on; the report also carries the versions, the topology, the
// peer-to-peer matrix and the NCCL environment it recommends for what it found.
// The checks are plain functions of the readings, so tests drive them with scripted values.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rig/hw/libraries.h"
#include "rig/hw/p2p.h"
#include "rig/hw/telemetry.h"
#include "rig/hw/topology.h"

namespace rig::hw {

enum class Verdict { ok, warn, fail, skip };
const char* verdict_name(Verdict v);

struct Check {
  std::string id;  // "temperature", "pcie_link", ...
  int gpu = -1;    // -1: the machine as a whole
  Verdict verdict = Verdict::ok;
  std::string detail;
  nlohmann::json to_json() const;
};

struct Advice {
  std::string var, value, why;
  std::string line() const { return "export " + var + "=" + value; }
};

// The per-GPU checks, from the GPU's static facts and one sample.
std::vector<Check> check_gpu(const GpuInfo& g, const GpuSample& s);

struct AdviceInputs {
  std::vector<GpuInfo> gpus;
  P2PMatrix p2p;
  std::vector<std::string> net_interfaces;  // up, not loopback or virtual
  std::vector<std::string> ib_devices;      // /sys/class/infiniband entries
};
std::vector<Advice> nccl_advice(const AdviceInputs& in);

std::vector<std::string> list_infiniband(const std::string& sysfs_root = "/sys");
std::vector<std::string> list_net_interfaces(const std::string& sysfs_root = "/sys");

struct DoctorOptions {
  std::string nvml_library;  // empty: $RIG_NVML_LIBRARY or libnvidia-ml.so.1
  std::string sysfs_root = "/sys";
  std::string topology_xml;  // empty: probe this machine
  bool strict = false;       // warnings fail too
  bool measure_p2p = true;
};

struct DoctorReport {
  bool strict = false;
  bool nvml_ok = false;
  std::string nvml_library, driver_version;
  int cuda_driver_version = 0;
  std::vector<LibraryVersion> libraries;
  std::vector<GpuInfo> gpus;
  std::vector<GpuSample> samples;
  Topology topology;
  P2PMatrix p2p;
  std::vector<Check> checks;
  std::vector<Advice> advice;

  std::vector<Check> failing() const;  // fails, and warnings when strict
  bool ready() const { return failing().empty(); }
  int exit_code() const { return ready() ? 0 : 1; }
  nlohmann::json to_json() const;
  std::string to_text(bool color = false) const;
};

// Never throws for a missing driver: that is a failing check in the report.
DoctorReport run_doctor(const DoctorOptions& opt);

}  // namespace rig::hw
