// A stand-in for libnvidia-ml.so.1 with scripted readings, so doctor and watch can be tested on
// machines without a GPU. It implements the declarations of src/rig/hw/nvml_api.h, so a signature
// mismatch between rig and this double fails to compile.
//
// The scenario is a JSON file named by $FAKE_NVML_SCENARIO (a path, or a name in scenarios/):
//   {"driver": "550.54.14", "cuda_driver": 12040, "init_error": 0,
//    "gpus": [{"name": ..., "temp": 45, ..., "timeline": [{...}, {...}]}]}
// Every GPU field has a healthy RTX 4090 default (see defaults()); null means "not supported".
// Each nvmlDeviceGetTemperature call is one sample of that GPU: sample k first applies
// timeline[k] (a JSON merge patch), so readings can change over time; an "xid" list in a patch
// queues XID events for nvmlEventSetWait_v2.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "rig/hw/nvml_api.h"

using json = nlohmann::json;

namespace {

struct Dev {
  int index = 0;
  json cur;       // current readings
  json timeline;  // patches, one per sample
  size_t tick = 0;
};

std::mutex mu;
json scenario;
std::deque<Dev> devs;  // deque: handles are addresses and must not move
std::deque<std::pair<Dev*, unsigned long long>> events;
bool loaded = false;
int inits = 0;

json defaults(int i) {
  char uuid[64], bus[32];
  std::snprintf(uuid, sizeof uuid, "GPU-fa4e0000-0000-4000-8000-%012d", i);
  std::snprintf(bus, sizeof bus, "00000000:%02X:00.0", 1 + i);
  return {{"name", "NVIDIA GeForce RTX 4090"},
          {"uuid", uuid},
          {"bus_id", bus},
          {"pci_device_id", 0x268410de},
          {"temp", 40},
          {"slowdown", 88},
          {"shutdown", 93},
          {"mem_max", nullptr},
          {"mem_temp", nullptr},
          {"power_mw", 30000},
          {"limit_mw", 450000},
          {"default_limit_mw", 450000},
          {"sm_clock", 210},
          {"mem_clock", 405},
          {"max_sm_clock", 3105},
          {"util_gpu", 0},
          {"util_mem", 0},
          {"mem_total", 25757220864ULL},
          {"mem_used", 524288000ULL},
          {"fan", 30},
          {"pcie_gen", 4},
          {"pcie_width", 16},
          {"max_pcie_gen", 4},
          {"max_pcie_width", 16},
          {"reasons", 1},
          {"ecc_corrected", nullptr},
          {"ecc_uncorrected", nullptr},
          {"retired_sbe", nullptr},
          {"retired_dbe", nullptr},
          {"retired_pending", nullptr},
          {"remapped", nullptr}};
}

void queue_xids(Dev& d, const json& patch) {
  if (patch.contains("xid"))
    for (auto& x : patch["xid"]) events.emplace_back(&d, x.get<unsigned long long>());
}

// Reads the scenario; returns false (and says why on stderr) when it cannot.
bool load_scenario() {
  scenario = json::object();
  devs.clear();
  events.clear();
  const char* env = std::getenv("FAKE_NVML_SCENARIO");
  std::string path = env && *env ? env : "";
  if (!path.empty() && path.find('/') == std::string::npos)
    path = std::string(FAKE_NVML_SCENARIO_DIR) + "/" + path + ".json";
  if (!path.empty()) {
    std::ifstream f(path);
    if (!f) {
      std::fprintf(stderr, "fake_nvml: cannot open scenario %s\n", path.c_str());
      return false;
    }
    try {
      scenario = json::parse(f);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fake_nvml: %s: %s\n", path.c_str(), e.what());
      return false;
    }
  }
  json gpus = scenario.value("gpus", json::array({json::object()}));
  for (size_t i = 0; i < gpus.size(); ++i) {
    Dev& d = devs.emplace_back();
    d.index = int(i);
    d.cur = defaults(int(i));
    json g = gpus[i];
    d.timeline = g.value("timeline", json::array());
    g.erase("timeline");
    // Plain assignment, not merge_patch: null must survive as "not supported".
    for (auto& [k, v] : g.items()) d.cur[k] = v;
    queue_xids(d, g);
  }
  loaded = true;
  return true;
}

Dev* dev(nvmlDevice_t h) {
  for (auto& d : devs)
    if (reinterpret_cast<nvmlDevice_t>(&d) == h) return &d;
  return nullptr;
}

// Reads a field of the GPU into *out; NOT_SUPPORTED when the scenario says null.
template <typename T>
nvmlReturn_t field(nvmlDevice_t h, const char* key, T* out) {
  std::lock_guard lock(mu);
  if (inits == 0) return NVML_ERROR_UNINITIALIZED;
  Dev* d = dev(h);
  if (!d || !out) return NVML_ERROR_INVALID_ARGUMENT;
  const json& v = d->cur.contains(key) ? d->cur[key] : json(nullptr);
  if (v.is_null()) return NVML_ERROR_NOT_SUPPORTED;
  *out = v.get<T>();
  return NVML_SUCCESS;
}

nvmlReturn_t copy_string(const std::string& s, char* buf, unsigned len) {
  if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
  if (s.size() + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
  std::memcpy(buf, s.c_str(), s.size() + 1);
  return NVML_SUCCESS;
}

}  // namespace

extern "C" {

nvmlReturn_t nvmlInit_v2(void) {
  std::lock_guard lock(mu);
  if (inits == 0 && !load_scenario()) return NVML_ERROR_UNKNOWN;
  if (int e = scenario.value("init_error", 0)) return e;
  ++inits;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
  std::lock_guard lock(mu);
  if (inits == 0) return NVML_ERROR_UNINITIALIZED;
  --inits;
  return NVML_SUCCESS;
}

const char* nvmlErrorString(nvmlReturn_t r) {
  switch (r) {
    case NVML_SUCCESS:
      return "Success";
    case NVML_ERROR_UNINITIALIZED:
      return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
      return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
      return "Not Supported";
    case NVML_ERROR_NO_PERMISSION:
      return "Insufficient Permissions";
    case NVML_ERROR_DRIVER_NOT_LOADED:
      return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT:
      return "Timeout";
    case NVML_ERROR_GPU_IS_LOST:
      return "GPU is lost";
    default:
      return "Unknown Error";
  }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char* buf, unsigned int len) {
  std::lock_guard lock(mu);
  return copy_string(scenario.value("driver", std::string("550.54.14")), buf, len);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int* v) {
  std::lock_guard lock(mu);
  *v = scenario.value("cuda_driver", 12040);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* n) {
  std::lock_guard lock(mu);
  if (inits == 0) return NVML_ERROR_UNINITIALIZED;
  *n = unsigned(devs.size());
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t* h) {
  std::lock_guard lock(mu);
  if (i >= devs.size()) return NVML_ERROR_INVALID_ARGUMENT;
  if (devs[i].cur.value("lost", false)) return NVML_ERROR_GPU_IS_LOST;
  *h = reinterpret_cast<nvmlDevice_t>(&devs[i]);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char* buf, unsigned int len) {
  std::string s;
  if (auto r = field(h, "name", &s)) return r;
  return copy_string(s, buf, len);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char* buf, unsigned int len) {
  std::string s;
  if (auto r = field(h, "uuid", &s)) return r;
  return copy_string(s, buf, len);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t* pci) {
  std::string bus;
  if (auto r = field(h, "bus_id", &bus)) return r;
  std::memset(pci, 0, sizeof *pci);
  std::snprintf(pci->busId, sizeof pci->busId, "%s", bus.c_str());
  std::sscanf(bus.c_str(), "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
  std::snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", pci->domain,
                pci->bus, pci->device);
  field(h, "pci_device_id", &pci->pciDeviceId);
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, nvmlTemperatureSensors_t sensor,
                                      unsigned int* t) {
  if (sensor != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
  {
    // One call is one sample: advance this GPU's timeline.
    std::lock_guard lock(mu);
    Dev* d = dev(h);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->tick < d->timeline.size()) {
      const json& patch = d->timeline[d->tick];
      for (auto& [k, v] : patch.items())
        if (k != "xid") d->cur[k] = v;
      queue_xids(*d, patch);
    }
    ++d->tick;
  }
  return field(h, "temp", t);
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t h, nvmlTemperatureThresholds_t k,
                                               unsigned int* t) {
  switch (k) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
      return field(h, "shutdown", t);
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
      return field(h, "slowdown", t);
    case NVML_TEMPERATURE_THRESHOLD_MEM_MAX:
      return field(h, "mem_max", t);
    default:
      return NVML_ERROR_NOT_SUPPORTED;
  }
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int n, nvmlFieldValue_t* v) {
  for (int i = 0; i < n; ++i) {
    v[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
    if (v[i].fieldId == RIG_NVML_FI_DEV_MEMORY_TEMP) {
      v[i].valueType = 1;  // unsigned int
      v[i].nvmlReturn = field(h, "mem_temp", &v[i].value.uiVal);
    }
  }
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int* mw) {
  return field(h, "power_mw", mw);
}
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t h, unsigned int* mw) {
  return field(h, "limit_mw", mw);
}
nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t h, unsigned int* mw) {
  return field(h, "default_limit_mw", mw);
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, nvmlClockType_t type, unsigned int* mhz) {
  if (type == NVML_CLOCK_SM || type == NVML_CLOCK_GRAPHICS) return field(h, "sm_clock", mhz);
  if (type == NVML_CLOCK_MEM) return field(h, "mem_clock", mhz);
  return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, nvmlClockType_t type, unsigned int* mhz) {
  if (type == NVML_CLOCK_SM || type == NVML_CLOCK_GRAPHICS) return field(h, "max_sm_clock", mhz);
  return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t* u) {
  if (auto r = field(h, "util_gpu", &u->gpu)) return r;
  return field(h, "util_mem", &u->memory);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t* m) {
  if (auto r = field(h, "mem_total", &m->total)) return r;
  if (auto r = field(h, "mem_used", &m->used)) return r;
  m->free = m->total - m->used;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t h, unsigned int* v) {
  return field(h, "pcie_gen", v);
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t h, unsigned int* v) {
  return field(h, "pcie_width", v);
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t h, unsigned int* v) {
  return field(h, "max_pcie_gen", v);
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t h, unsigned int* v) {
  return field(h, "max_pcie_width", v);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t h, unsigned long long* r) {
  // An "old driver" scenario lacks the new name, so rig's fallback to the old one is exercised.
  {
    std::lock_guard lock(mu);
    if (scenario.value("old_driver", false)) return NVML_ERROR_FUNCTION_NOT_FOUND;
  }
  return field(h, "reasons", r);
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t h, unsigned long long* r) {
  return field(h, "reasons", r);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, nvmlMemoryErrorType_t type,
                                         nvmlEccCounterType_t, unsigned long long* n) {
  return field(h, type == NVML_MEMORY_ERROR_TYPE_CORRECTED ? "ecc_corrected" : "ecc_uncorrected",
               n);
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t h, nvmlPageRetirementCause_t cause,
                                       unsigned int* count, unsigned long long* addresses) {
  unsigned n = 0;
  if (auto r = field(
          h,
          cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? "retired_dbe" : "retired_sbe",
          &n))
    return r;
  bool fits = *count >= n;
  if (fits && addresses)
    for (unsigned i = 0; i < n; ++i) addresses[i] = 0x1000ULL * (i + 1);
  *count = n;
  return fits ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t h, int* pending) {
  bool p = false;
  if (auto r = field(h, "retired_pending", &p)) return r;
  *pending = p ? 1 : 0;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int* corr, unsigned int* unc,
                                       unsigned int* pending, unsigned int* failure) {
  std::vector<unsigned> v;
  if (auto r = field(h, "remapped", &v)) return r;
  v.resize(4);
  *corr = v[0];
  *unc = v[1];
  *pending = v[2];
  *failure = v[3];
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t h, unsigned int* pct) {
  return field(h, "fan", pct);
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t* set) {
  static int token;
  *set = reinterpret_cast<nvmlEventSet_t>(&token);
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t) {
  std::lock_guard lock(mu);
  return dev(h) && (types & RIG_NVML_EVENT_TYPE_XID_CRITICAL_ERROR) ? NVML_SUCCESS
                                                                    : NVML_ERROR_NOT_SUPPORTED;
}
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t, nvmlEventData_t* data, unsigned int) {
  std::lock_guard lock(mu);
  if (events.empty()) return NVML_ERROR_TIMEOUT;
  auto [d, xid] = events.front();
  events.pop_front();
  std::memset(data, 0, sizeof *data);
  data->device = reinterpret_cast<nvmlDevice_t>(d);
  data->eventType = RIG_NVML_EVENT_TYPE_XID_CRITICAL_ERROR;
  data->eventData = xid;
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t) {
  return NVML_SUCCESS;
}

// The runtime libraries doctor reports, so one fake can stand in for all of them.
int ncclGetVersion(int* v) {
  std::lock_guard lock(mu);
  if (!loaded) load_scenario();
  *v = scenario.value("nccl_version", 22105);
  return 0;
}
size_t cudnnGetVersion() {
  std::lock_guard lock(mu);
  if (!loaded) load_scenario();
  return scenario.value("cudnn_version", 90100);
}
int cudaRuntimeGetVersion(int* v) {
  std::lock_guard lock(mu);
  if (!loaded) load_scenario();
  *v = scenario.value("cudart_version", 12040);
  return 0;
}

}  // extern "C"
