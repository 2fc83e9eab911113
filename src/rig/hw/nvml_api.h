// The slice of NVML's C ABI that rig uses. The NVML header is not installed on build machines
// (and the library only exists where a driver is), so rig declares what it needs here, with the
// values of NVIDIA's nvml.h, and resolves the functions at run time with dlopen/dlsym.
// tests/fake_nvml implements the same declarations, so both sides are checked against one text.
#pragma once
#include <cstddef>

extern "C" {

typedef int nvmlReturn_t;
enum : int {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_NO_PERMISSION = 4,
  NVML_ERROR_NOT_FOUND = 6,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_TIMEOUT = 10,
  NVML_ERROR_LIBRARY_NOT_FOUND = 12,
  NVML_ERROR_FUNCTION_NOT_FOUND = 13,
  NVML_ERROR_GPU_IS_LOST = 15,
  NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
  NVML_ERROR_UNKNOWN = 999,
};

typedef struct nvmlDevice_st* nvmlDevice_t;
typedef struct nvmlEventSet_st* nvmlEventSet_t;

// Enumerations are passed as C enums, which are int-sized on every ABI NVML ships for.
typedef int nvmlTemperatureSensors_t;
enum : int { NVML_TEMPERATURE_GPU = 0 };

typedef int nvmlTemperatureThresholds_t;
enum : int {
  NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0,
  NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1,
  NVML_TEMPERATURE_THRESHOLD_MEM_MAX = 2,
  NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3,
};

typedef int nvmlClockType_t;
enum : int { NVML_CLOCK_GRAPHICS = 0, NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2, NVML_CLOCK_VIDEO = 3 };

typedef int nvmlMemoryErrorType_t;
enum : int { NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1 };
typedef int nvmlEccCounterType_t;
enum : int { NVML_VOLATILE_ECC = 0, NVML_AGGREGATE_ECC = 1 };

typedef int nvmlPageRetirementCause_t;
enum : int {
  NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0,
  NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1,
};

// Clock event ("throttle") reasons, a bitmask.
#define RIG_NVML_CLOCKS_EVENT_GPU_IDLE 0x1ULL
#define RIG_NVML_CLOCKS_EVENT_APPLICATIONS_CLOCKS_SETTING 0x2ULL
#define RIG_NVML_CLOCKS_EVENT_SW_POWER_CAP 0x4ULL
#define RIG_NVML_CLOCKS_EVENT_HW_SLOWDOWN 0x8ULL
#define RIG_NVML_CLOCKS_EVENT_SYNC_BOOST 0x10ULL
#define RIG_NVML_CLOCKS_EVENT_SW_THERMAL_SLOWDOWN 0x20ULL
#define RIG_NVML_CLOCKS_EVENT_HW_THERMAL_SLOWDOWN 0x40ULL
#define RIG_NVML_CLOCKS_EVENT_HW_POWER_BRAKE_SLOWDOWN 0x80ULL
#define RIG_NVML_CLOCKS_EVENT_DISPLAY_CLOCK_SETTING 0x100ULL

#define RIG_NVML_EVENT_TYPE_XID_CRITICAL_ERROR 0x8ULL

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80

typedef struct nvmlPciInfo_st {
  char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;
static_assert(offsetof(nvmlPciInfo_t, domain) == 16 && offsetof(nvmlPciInfo_t, busId) == 36 &&
                  sizeof(nvmlPciInfo_t) == 68,
              "nvmlPciInfo_t layout");

typedef struct nvmlUtilization_st {
  unsigned int gpu;
  unsigned int memory;
} nvmlUtilization_t;

typedef struct nvmlMemory_st {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

// Newer drivers append gpuInstanceId and computeInstanceId; the caller's buffer has room for them.
typedef struct nvmlEventData_st {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlEventData_t;

// Field values: used only for the memory (HBM/GDDR) temperature, which has no dedicated call.
#define RIG_NVML_FI_DEV_MEMORY_TEMP 82
typedef int nvmlValueType_t;
typedef union nvmlValue_st {
  double dVal;
  unsigned int uiVal;
  unsigned long ulVal;
  unsigned long long ullVal;
  signed long long sllVal;
} nvmlValue_t;
typedef struct nvmlFieldValue_st {
  unsigned int fieldId;
  unsigned int scopeId;
  long long timestamp;
  long long latencyUsec;
  nvmlValueType_t valueType;
  nvmlReturn_t nvmlReturn;
  nvmlValue_t value;
} nvmlFieldValue_t;
static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");

// The signatures rig resolves. Each X has a typedef X_fn.
#define RIG_NVML_FUNCTIONS(F)                                                                     \
  F(nvmlInit_v2, nvmlReturn_t, (void))                                                            \
  F(nvmlShutdown, nvmlReturn_t, (void))                                                           \
  F(nvmlErrorString, const char*, (nvmlReturn_t))                                                 \
  F(nvmlSystemGetDriverVersion, nvmlReturn_t, (char*, unsigned int))                              \
  F(nvmlSystemGetCudaDriverVersion, nvmlReturn_t, (int*))                                         \
  F(nvmlDeviceGetCount_v2, nvmlReturn_t, (unsigned int*))                                         \
  F(nvmlDeviceGetHandleByIndex_v2, nvmlReturn_t, (unsigned int, nvmlDevice_t*))                   \
  F(nvmlDeviceGetName, nvmlReturn_t, (nvmlDevice_t, char*, unsigned int))                         \
  F(nvmlDeviceGetUUID, nvmlReturn_t, (nvmlDevice_t, char*, unsigned int))                         \
  F(nvmlDeviceGetPciInfo_v3, nvmlReturn_t, (nvmlDevice_t, nvmlPciInfo_t*))                        \
  F(nvmlDeviceGetTemperature, nvmlReturn_t,                                                       \
    (nvmlDevice_t, nvmlTemperatureSensors_t, unsigned int*))                                      \
  F(nvmlDeviceGetTemperatureThreshold, nvmlReturn_t,                                              \
    (nvmlDevice_t, nvmlTemperatureThresholds_t, unsigned int*))                                   \
  F(nvmlDeviceGetPowerUsage, nvmlReturn_t, (nvmlDevice_t, unsigned int*))                         \
  F(nvmlDeviceGetEnforcedPowerLimit, nvmlReturn_t, (nvmlDevice_t, unsigned int*))                 \
  F(nvmlDeviceGetPowerManagementDefaultLimit, nvmlReturn_t, (nvmlDevice_t, unsigned int*))        \
  F(nvmlDeviceGetClockInfo, nvmlReturn_t, (nvmlDevice_t, nvmlClockType_t, unsigned int*))         \
  F(nvmlDeviceGetMaxClockInfo, nvmlReturn_t, (nvmlDevice_t, nvmlClockType_t, unsigned int*))      \
  F(nvmlDeviceGetUtilizationRates, nvmlReturn_t, (nvmlDevice_t, nvmlUtilization_t*))              \
  F(nvmlDeviceGetMemoryInfo, nvmlReturn_t, (nvmlDevice_t, nvmlMemory_t*))                         \
  F(nvmlDeviceGetCurrPcieLinkGeneration, nvmlReturn_t, (nvmlDevice_t, unsigned int*))             \
  F(nvmlDeviceGetCurrPcieLinkWidth, nvmlReturn_t, (nvmlDevice_t, unsigned int*))                  \
  F(nvmlDeviceGetMaxPcieLinkGeneration, nvmlReturn_t, (nvmlDevice_t, unsigned int*))              \
  F(nvmlDeviceGetMaxPcieLinkWidth, nvmlReturn_t, (nvmlDevice_t, unsigned int*))                   \
  F(nvmlDeviceGetCurrentClocksEventReasons, nvmlReturn_t, (nvmlDevice_t, unsigned long long*))    \
  F(nvmlDeviceGetCurrentClocksThrottleReasons, nvmlReturn_t, (nvmlDevice_t, unsigned long long*)) \
  F(nvmlDeviceGetTotalEccErrors, nvmlReturn_t,                                                    \
    (nvmlDevice_t, nvmlMemoryErrorType_t, nvmlEccCounterType_t, unsigned long long*))             \
  F(nvmlDeviceGetRetiredPages, nvmlReturn_t,                                                      \
    (nvmlDevice_t, nvmlPageRetirementCause_t, unsigned int*, unsigned long long*))                \
  F(nvmlDeviceGetRetiredPagesPendingStatus, nvmlReturn_t, (nvmlDevice_t, int*))                   \
  F(nvmlDeviceGetRemappedRows, nvmlReturn_t,                                                      \
    (nvmlDevice_t, unsigned int*, unsigned int*, unsigned int*, unsigned int*))                   \
  F(nvmlDeviceGetFanSpeed, nvmlReturn_t, (nvmlDevice_t, unsigned int*))                           \
  F(nvmlDeviceGetFieldValues, nvmlReturn_t, (nvmlDevice_t, int, nvmlFieldValue_t*))               \
  F(nvmlEventSetCreate, nvmlReturn_t, (nvmlEventSet_t*))                                          \
  F(nvmlDeviceRegisterEvents, nvmlReturn_t, (nvmlDevice_t, unsigned long long, nvmlEventSet_t))   \
  F(nvmlEventSetWait_v2, nvmlReturn_t, (nvmlEventSet_t, nvmlEventData_t*, unsigned int))          \
  F(nvmlEventSetFree, nvmlReturn_t, (nvmlEventSet_t))

#define RIG_NVML_DECLARE(name, ret, args) ret name args;
RIG_NVML_FUNCTIONS(RIG_NVML_DECLARE)
#undef RIG_NVML_DECLARE

}  // extern "C"
