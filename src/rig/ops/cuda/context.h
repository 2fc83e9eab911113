// Host-side plumbing shared by the CUDA op wrappers: the stream every op runs on, a device guard,
// the per-device bad-input record the kernels fill, and the element-type mapping.
#pragma once
#include "rig/core/cuda_check.h"
#include "rig/core/tensor.h"
#include "rig/ops/cuda/launch.h"

namespace rig::ops::cuda {

// The one place that decides which stream the ops use: the legacy default stream of the device,
// which orders the kernels with the synchronous copies of Tensor::to / copy_from. A per-device
// stream (or a caller-set one) would be plugged in here.
cudaStream_t stream_for(int device);

// Makes `device` current for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// The record the kernels write bad input into (zeroed, on `device`).
k::DeviceError* device_error(int device);
// Reads the record (synchronising the stream) and throws InputError if a kernel reported one.
void raise_device_errors(int device);

// F32 -> k::T::F32, BF16 -> k::T::BF16; anything else fails naming the op and the argument.
k::T ktype(const Tensor& t, const char* op, const char* arg);
// Checks that t is defined and on the CUDA device `dev`.
void check_on(const Tensor& t, int dev, const char* op, const char* arg);
void check_dtype(const Tensor& t, DType dt, const char* op, const char* arg);
void same_shape(const Tensor& a, const Tensor& b, const char* op, const char* an, const char* bn);
// Fails naming the op when a launch did not start.
void check_status(cudaError_t e, const char* op);
// A temporary on `dev` from the device's allocator.
Tensor scratch(const Shape& s, DType dt, int dev, const char* what);

}  // namespace rig::ops::cuda
