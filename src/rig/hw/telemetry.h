// GPU telemetry through NVML: the static facts of each GPU (name, thresholds, limits, max link)
// and a sample of its live readings. Readings a card does not support are empty optionals, never
// zeros, so "no ECC on a GeForce card" is not confused with "zero ECC errors".
//
// The trainer calls Telemetry::sample() once per step and summarize() for its metrics line; the
// ThermalPause policy tells it when to stop feeding a card that is about to throttle.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace rig::hw {

class Nvml;

struct GpuInfo {
  int index = 0;
  std::string name, uuid, pci_bus_id;  // bus id as NVML spells it: 00000000:01:00.0
  unsigned pci_device_id = 0;          // device << 16 | vendor
  std::optional<double> temp_slowdown_c, temp_shutdown_c, mem_temp_max_c;
  std::optional<double> power_default_limit_w;
  std::optional<unsigned> max_pcie_gen, max_pcie_width;
  std::optional<double> max_sm_clock_mhz;
  bool geforce() const;  // consumer card: no ECC, peer-to-peer disabled by the stock driver
  nlohmann::json to_json() const;
};

struct GpuSample {
  double time = 0;  // seconds since the epoch
  int index = 0;
  std::optional<double> temp_c, mem_temp_c, power_w, power_limit_w;
  std::optional<double> sm_clock_mhz, mem_clock_mhz, util_gpu_pct, util_mem_pct, fan_pct;
  std::optional<uint64_t> fb_total, fb_used, fb_free;  // bytes
  std::optional<unsigned> pcie_gen, pcie_width;
  std::optional<uint64_t> clocks_event_reasons;            // NVML "throttle reasons" bitmask
  std::optional<uint64_t> ecc_corrected, ecc_uncorrected;  // volatile (since boot) totals
  std::optional<unsigned> retired_pages_sbe, retired_pages_dbe;
  std::optional<bool> retired_pages_pending;
  std::optional<unsigned> remapped_rows_corr, remapped_rows_unc;
  std::optional<bool> remap_pending, remap_failure;
  std::vector<uint64_t> xids;  // XID critical errors reported since the previous sample

  bool thermal_throttle() const;  // HW/SW thermal slowdown or HW slowdown
  bool power_throttle() const;    // SW power cap or HW power brake
  nlohmann::json to_json() const;
};

// "sw_power_cap,hw_thermal_slowdown"; empty when none. Idle and display clocks are not listed.
std::vector<std::string> clocks_event_names(uint64_t reasons, bool include_benign = false);
// Reasons that mean the card is slowed by heat or power, not by being idle or by a setting.
constexpr uint64_t kThermalReasons = 0x8 | 0x20 | 0x40;
constexpr uint64_t kPowerReasons = 0x4 | 0x80;

// What one step's metrics line carries.
struct StepSummary {
  int gpus = 0;
  std::optional<double> max_temp_c;
  int hottest_gpu = -1;
  double total_power_w = 0, max_power_w = 0;
  uint64_t throttle_reasons = 0;  // OR over the GPUs
  bool thermal_throttle = false, power_throttle = false;
  std::vector<uint64_t> xids;
  nlohmann::json to_json() const;
};

class Telemetry {
 public:
  // Loads NVML (see Nvml::load) and reads each GPU's static facts. Throws rig::Error.
  static Telemetry open(std::string library = "");
  explicit Telemetry(std::shared_ptr<Nvml> nvml);
  ~Telemetry();
  Telemetry(Telemetry&&) noexcept;
  Telemetry& operator=(Telemetry&&) noexcept;

  const std::vector<GpuInfo>& gpus() const { return gpus_; }
  const std::string& driver_version() const { return driver_version_; }
  int cuda_driver_version() const { return cuda_driver_version_; }  // 12040 = 12.4; 0 unknown
  const std::string& library() const;

  // One sample per GPU, in index order. Also drains the XID event queue without blocking.
  std::vector<GpuSample> sample();
  static StepSummary summarize(const std::vector<GpuSample>& samples);

 private:
  std::shared_ptr<Nvml> nvml_;
  std::vector<void*> handles_;  // nvmlDevice_t
  void* events_ = nullptr;      // nvmlEventSet_t, null when XID events are unsupported
  std::vector<GpuInfo> gpus_;
  std::string driver_version_;
  int cuda_driver_version_ = 0;
};

// Pause above `pause_at_c`, resume only once every GPU is below `resume_below_c` (hysteresis, so
// a card hovering at the limit does not flap). The trainer calls update() with each summary.
class ThermalPause {
 public:
  ThermalPause(double pause_at_c, double resume_below_c);
  // Returns true while paused. A missing temperature leaves the state as it is.
  bool update(const StepSummary& s);
  bool paused() const { return paused_; }
  int pauses() const { return pauses_; }  // how many times it has paused
  double pause_at() const { return pause_at_; }
  double resume_below() const { return resume_below_; }

 private:
  double pause_at_, resume_below_;
  bool paused_ = false;
  int pauses_ = 0;
};

// Formats a CUDA-style version number (12040) as "12.4".
std::string cuda_version_string(int v);

}  // namespace rig::hw
