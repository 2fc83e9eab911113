#include "rig/hw/telemetry.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "rig/core/error.h"
#include "rig/hw/nvml.h"

namespace rig::hw {

using json = nlohmann::json;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Calls an optional NVML getter; empty when the function is missing or the card says no.
template <typename T, typename Fn, typename... Args>
std::optional<T> get(Fn fn, Args... args) {
  if (!fn) return std::nullopt;
  T v{};
  if (fn(args..., &v) != NVML_SUCCESS) return std::nullopt;
  return v;
}

template <typename T>
json opt(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

std::optional<double> scaled(std::optional<unsigned> v, double k) {
  if (!v) return std::nullopt;
  return *v * k;
}

}  // namespace

bool GpuInfo::geforce() const {
  return name.find("GeForce") != std::string::npos || name.find("TITAN") != std::string::npos;
}

json GpuInfo::to_json() const {
  return {{"index", index},
          {"name", name},
          {"uuid", uuid},
          {"pci_bus_id", pci_bus_id},
          {"pci_device_id", fmt::format("0x{:08x}", pci_device_id)},
          {"temp_slowdown_c", opt(temp_slowdown_c)},
          {"temp_shutdown_c", opt(temp_shutdown_c)},
          {"mem_temp_max_c", opt(mem_temp_max_c)},
          {"power_default_limit_w", opt(power_default_limit_w)},
          {"max_pcie_gen", opt(max_pcie_gen)},
          {"max_pcie_width", opt(max_pcie_width)},
          {"max_sm_clock_mhz", opt(max_sm_clock_mhz)}};
}

bool GpuSample::thermal_throttle() const {
  return clocks_event_reasons && (*clocks_event_reasons & kThermalReasons);
}
bool GpuSample::power_throttle() const {
  return clocks_event_reasons && (*clocks_event_reasons & kPowerReasons);
}

json GpuSample::to_json() const {
  json j = {{"time", time},
            {"gpu", index},
            {"temp_c", opt(temp_c)},
            {"mem_temp_c", opt(mem_temp_c)},
            {"power_w", opt(power_w)},
            {"power_limit_w", opt(power_limit_w)},
            {"sm_clock_mhz", opt(sm_clock_mhz)},
            {"mem_clock_mhz", opt(mem_clock_mhz)},
            {"util_gpu_pct", opt(util_gpu_pct)},
            {"util_mem_pct", opt(util_mem_pct)},
            {"fan_pct", opt(fan_pct)},
            {"fb_total", opt(fb_total)},
            {"fb_used", opt(fb_used)},
            {"fb_free", opt(fb_free)},
            {"pcie_gen", opt(pcie_gen)},
            {"pcie_width", opt(pcie_width)},
            {"clocks_event_reasons", opt(clocks_event_reasons)},
            {"throttle", clocks_event_names(clocks_event_reasons.value_or(0))},
            {"ecc_corrected", opt(ecc_corrected)},
            {"ecc_uncorrected", opt(ecc_uncorrected)},
            {"retired_pages_sbe", opt(retired_pages_sbe)},
            {"retired_pages_dbe", opt(retired_pages_dbe)},
            {"retired_pages_pending", opt(retired_pages_pending)},
            {"remapped_rows_corr", opt(remapped_rows_corr)},
            {"remapped_rows_unc", opt(remapped_rows_unc)},
            {"remap_pending", opt(remap_pending)},
            {"remap_failure", opt(remap_failure)},
            {"xids", xids}};
  return j;
}

std::vector<std::string> clocks_event_names(uint64_t r, bool include_benign) {
  static const std::pair<uint64_t, const char*> names[] = {{0x1, "gpu_idle"},
                                                           {0x2, "applications_clocks"},
                                                           {0x4, "sw_power_cap"},
                                                           {0x8, "hw_slowdown"},
                                                           {0x10, "sync_boost"},
                                                           {0x20, "sw_thermal_slowdown"},
                                                           {0x40, "hw_thermal_slowdown"},
                                                           {0x80, "hw_power_brake_slowdown"},
                                                           {0x100, "display_clocks"}};
  constexpr uint64_t benign = 0x1 | 0x2 | 0x10 | 0x100;
  std::vector<std::string> out;
  for (auto& [bit, name] : names)
    if ((r & bit) && (include_benign || !(bit & benign))) out.push_back(name);
  return out;
}

json StepSummary::to_json() const {
  return {{"gpus", gpus},
          {"max_temp_c", opt(max_temp_c)},
          {"hottest_gpu", hottest_gpu},
          {"total_power_w", total_power_w},
          {"max_power_w", max_power_w},
          {"throttle", clocks_event_names(throttle_reasons)},
          {"thermal_throttle", thermal_throttle},
          {"power_throttle", power_throttle},
          {"xids", xids}};
}

std::string cuda_version_string(int v) {
  if (v <= 0) return "unknown";
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

Telemetry Telemetry::open(std::string library) {
  return Telemetry(Nvml::load(std::move(library)));
}

Telemetry::Telemetry(std::shared_ptr<Nvml> nvml) : nvml_(std::move(nvml)) {
  Nvml& n = *nvml_;
  char buf[256] = {};
  if (n.nvmlSystemGetDriverVersion && n.nvmlSystemGetDriverVersion(buf, sizeof buf) == NVML_SUCCESS)
    driver_version_ = buf;
  cuda_driver_version_ = get<int>(n.nvmlSystemGetCudaDriverVersion).value_or(0);
  unsigned count = 0;
  if (nvmlReturn_t r = n.nvmlDeviceGetCount_v2(&count); r != NVML_SUCCESS)
    fail("NVML: nvmlDeviceGetCount_v2 failed: {}", n.error_string(r));
  if (n.nvmlEventSetCreate && n.nvmlDeviceRegisterEvents && n.nvmlEventSetWait_v2) {
    nvmlEventSet_t set = nullptr;
    if (n.nvmlEventSetCreate(&set) == NVML_SUCCESS) events_ = set;
  }
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t d = nullptr;
    if (nvmlReturn_t r = n.nvmlDeviceGetHandleByIndex_v2(i, &d); r != NVML_SUCCESS)
      fail("NVML: GPU {} cannot be opened: {}{}", i, n.error_string(r),
           r == NVML_ERROR_GPU_IS_LOST ? " (the GPU fell off the bus: check power and the riser)"
                                       : "");
    handles_.push_back(d);
    GpuInfo g;
    g.index = int(i);
    std::fill(std::begin(buf), std::end(buf), 0);
    if (n.nvmlDeviceGetName &&
        n.nvmlDeviceGetName(d, buf, NVML_DEVICE_NAME_V2_BUFFER_SIZE) == NVML_SUCCESS)
      g.name = buf;
    std::fill(std::begin(buf), std::end(buf), 0);
    if (n.nvmlDeviceGetUUID &&
        n.nvmlDeviceGetUUID(d, buf, NVML_DEVICE_UUID_V2_BUFFER_SIZE) == NVML_SUCCESS)
      g.uuid = buf;
    nvmlPciInfo_t pci{};
    if (n.nvmlDeviceGetPciInfo_v3 && n.nvmlDeviceGetPciInfo_v3(d, &pci) == NVML_SUCCESS) {
      pci.busId[sizeof pci.busId - 1] = 0;
      g.pci_bus_id = pci.busId;
      g.pci_device_id = pci.pciDeviceId;
    }
    auto th = [&](nvmlTemperatureThresholds_t t) {
      return scaled(get<unsigned>(n.nvmlDeviceGetTemperatureThreshold, d, t), 1.0);
    };
    g.temp_slowdown_c = th(NVML_TEMPERATURE_THRESHOLD_SLOWDOWN);
    g.temp_shutdown_c = th(NVML_TEMPERATURE_THRESHOLD_SHUTDOWN);
    g.mem_temp_max_c = th(NVML_TEMPERATURE_THRESHOLD_MEM_MAX);
    g.power_default_limit_w =
        scaled(get<unsigned>(n.nvmlDeviceGetPowerManagementDefaultLimit, d), 1e-3);
    g.max_pcie_gen = get<unsigned>(n.nvmlDeviceGetMaxPcieLinkGeneration, d);
    g.max_pcie_width = get<unsigned>(n.nvmlDeviceGetMaxPcieLinkWidth, d);
    g.max_sm_clock_mhz = scaled(get<unsigned>(n.nvmlDeviceGetMaxClockInfo, d, NVML_CLOCK_SM), 1.0);
    gpus_.push_back(std::move(g));
    // XID events need root on some systems; without them watch still sees ECC counters.
    if (events_ &&
        n.nvmlDeviceRegisterEvents(d, RIG_NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
                                   static_cast<nvmlEventSet_t>(events_)) != NVML_SUCCESS) {
      // Keep the set: other GPUs may still deliver events.
    }
  }
}

Telemetry::~Telemetry() {
  if (events_ && nvml_ && nvml_->nvmlEventSetFree)
    nvml_->nvmlEventSetFree(static_cast<nvmlEventSet_t>(events_));
}

Telemetry::Telemetry(Telemetry&& o) noexcept {
  *this = std::move(o);
}
Telemetry& Telemetry::operator=(Telemetry&& o) noexcept {
  if (this != &o) {
    if (events_ && nvml_ && nvml_->nvmlEventSetFree)
      nvml_->nvmlEventSetFree(static_cast<nvmlEventSet_t>(events_));
    nvml_ = std::move(o.nvml_);
    handles_ = std::move(o.handles_);
    events_ = o.events_;
    o.events_ = nullptr;
    gpus_ = std::move(o.gpus_);
    driver_version_ = std::move(o.driver_version_);
    cuda_driver_version_ = o.cuda_driver_version_;
  }
  return *this;
}

const std::string& Telemetry::library() const {
  return nvml_->library();
}

std::vector<GpuSample> Telemetry::sample() {
  Nvml& n = *nvml_;
  std::vector<GpuSample> out;
  double t = now_s();
  for (size_t i = 0; i < handles_.size(); ++i) {
    auto d = static_cast<nvmlDevice_t>(handles_[i]);
    GpuSample s;
    s.time = t;
    s.index = int(i);
    s.temp_c = scaled(get<unsigned>(n.nvmlDeviceGetTemperature, d, NVML_TEMPERATURE_GPU), 1.0);
    if (n.nvmlDeviceGetFieldValues) {
      nvmlFieldValue_t fv{};
      fv.fieldId = RIG_NVML_FI_DEV_MEMORY_TEMP;
      if (n.nvmlDeviceGetFieldValues(d, 1, &fv) == NVML_SUCCESS && fv.nvmlReturn == NVML_SUCCESS)
        s.mem_temp_c = double(fv.value.uiVal);
    }
    s.power_w = scaled(get<unsigned>(n.nvmlDeviceGetPowerUsage, d), 1e-3);
    s.power_limit_w = scaled(get<unsigned>(n.nvmlDeviceGetEnforcedPowerLimit, d), 1e-3);
    s.sm_clock_mhz = scaled(get<unsigned>(n.nvmlDeviceGetClockInfo, d, NVML_CLOCK_SM), 1.0);
    s.mem_clock_mhz = scaled(get<unsigned>(n.nvmlDeviceGetClockInfo, d, NVML_CLOCK_MEM), 1.0);
    if (auto u = get<nvmlUtilization_t>(n.nvmlDeviceGetUtilizationRates, d)) {
      s.util_gpu_pct = u->gpu;
      s.util_mem_pct = u->memory;
    }
    if (auto m = get<nvmlMemory_t>(n.nvmlDeviceGetMemoryInfo, d)) {
      s.fb_total = m->total;
      s.fb_used = m->used;
      s.fb_free = m->free;
    }
    s.fan_pct = scaled(get<unsigned>(n.nvmlDeviceGetFanSpeed, d), 1.0);
    s.pcie_gen = get<unsigned>(n.nvmlDeviceGetCurrPcieLinkGeneration, d);
    s.pcie_width = get<unsigned>(n.nvmlDeviceGetCurrPcieLinkWidth, d);
    // The "ClocksEvent" name replaced "ClocksThrottle" in driver 535; older drivers have only that.
    s.clocks_event_reasons = get<unsigned long long>(n.nvmlDeviceGetCurrentClocksEventReasons, d);
    if (!s.clocks_event_reasons)
      s.clocks_event_reasons =
          get<unsigned long long>(n.nvmlDeviceGetCurrentClocksThrottleReasons, d);
    s.ecc_corrected = get<unsigned long long>(n.nvmlDeviceGetTotalEccErrors, d,
                                              NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC);
    s.ecc_uncorrected = get<unsigned long long>(
        n.nvmlDeviceGetTotalEccErrors, d, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC);
    if (n.nvmlDeviceGetRetiredPages) {
      // Count 0 with no buffer asks for the count only: NVML answers INSUFFICIENT_SIZE and sets it.
      auto pages = [&](nvmlPageRetirementCause_t cause) -> std::optional<unsigned> {
        unsigned c = 0;
        nvmlReturn_t r = n.nvmlDeviceGetRetiredPages(d, cause, &c, nullptr);
        if (r != NVML_SUCCESS && r != NVML_ERROR_INSUFFICIENT_SIZE) return std::nullopt;
        return c;
      };
      s.retired_pages_sbe = pages(NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS);
      s.retired_pages_dbe = pages(NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR);
    }
    if (auto p = get<int>(n.nvmlDeviceGetRetiredPagesPendingStatus, d))
      s.retired_pages_pending = *p != 0;
    if (n.nvmlDeviceGetRemappedRows) {
      unsigned c = 0, u = 0, pend = 0, failed = 0;
      if (n.nvmlDeviceGetRemappedRows(d, &c, &u, &pend, &failed) == NVML_SUCCESS) {
        s.remapped_rows_corr = c;
        s.remapped_rows_unc = u;
        s.remap_pending = pend != 0;
        s.remap_failure = failed != 0;
      }
    }
    out.push_back(std::move(s));
  }
  if (events_) {
    // Timeout 0: take what is queued, never block the caller's step.
    for (int k = 0; k < 64; ++k) {
      nvmlEventData_t ev{};
      if (n.nvmlEventSetWait_v2(static_cast<nvmlEventSet_t>(events_), &ev, 0) != NVML_SUCCESS)
        break;
      if (!(ev.eventType & RIG_NVML_EVENT_TYPE_XID_CRITICAL_ERROR)) continue;
      for (size_t i = 0; i < handles_.size(); ++i)
        if (handles_[i] == static_cast<void*>(ev.device)) out[i].xids.push_back(ev.eventData);
    }
  }
  return out;
}

StepSummary Telemetry::summarize(const std::vector<GpuSample>& samples) {
  StepSummary s;
  s.gpus = int(samples.size());
  for (const auto& g : samples) {
    if (g.temp_c && (!s.max_temp_c || *g.temp_c > *s.max_temp_c)) {
      s.max_temp_c = g.temp_c;
      s.hottest_gpu = g.index;
    }
    if (g.power_w) {
      s.total_power_w += *g.power_w;
      s.max_power_w = std::max(s.max_power_w, *g.power_w);
    }
    s.throttle_reasons |= g.clocks_event_reasons.value_or(0);
    s.thermal_throttle |= g.thermal_throttle();
    s.power_throttle |= g.power_throttle();
    s.xids.insert(s.xids.end(), g.xids.begin(), g.xids.end());
  }
  return s;
}

ThermalPause::ThermalPause(double pause_at_c, double resume_below_c)
    : pause_at_(pause_at_c), resume_below_(resume_below_c) {
  if (!(resume_below_c < pause_at_c))
    bad_input("thermal pause: resume temperature {} C must be below the pause temperature {} C",
              resume_below_c, pause_at_c);
}

bool ThermalPause::update(const StepSummary& s) {
  if (!s.max_temp_c) return paused_;
  if (!paused_ && *s.max_temp_c >= pause_at_) {
    paused_ = true;
    ++pauses_;
  } else if (paused_ && *s.max_temp_c < resume_below_) {
    paused_ = false;
  }
  return paused_;
}

}  // namespace rig::hw
