// A dense, contiguous tensor on one device. It owns its memory (through the device's allocator)
// or views memory owned by something else (an mmapped file), which it keeps alive.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "rig/core/dtype.h"
#include "rig/core/error.h"

namespace rig {

class Allocator;

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;
  // "cpu", "cuda", "cuda:1"; throws InputError otherwise.
  static Device parse(std::string_view s);
};

Allocator& allocator_for(Device d);
bool cuda_available();  // false in a build without CUDA or on a machine without a GPU
// The device a command line or a config names: "auto", "cpu", "cuda", "cuda:N" ("gpu" as
// "cuda"). auto is cuda:0 when a GPU is visible, else the CPU. A CUDA device that cannot be had
// (a build without CUDA, no GPU visible, an index past the visible GPUs) throws InputError
// "{what}: device '{spec}' requested, but {why}", before any work.
Device resolve_device(std::string_view spec, std::string_view what);
// Copies n bytes between any two devices (synchronously).
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 24, 1000]"

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype, Device dev = Device::cpu(),
                      std::string_view what = "tensor");
  static Tensor zeros(const Shape& shape, DType dtype, Device dev = Device::cpu(),
                      std::string_view what = "tensor");
  // A view of memory that `owner` keeps alive (an mmapped file, another tensor's storage).
  static Tensor view(void* data, const Shape& shape, DType dtype, Device dev,
                     std::shared_ptr<void> owner);
  static Tensor from_f32(const std::vector<float>& v, const Shape& shape);

  bool defined() const { return data_ != nullptr || (storage_ && shape_numel(shape_) == 0); }
  const Shape& shape() const { return shape_; }
  int ndim() const { return int(shape_.size()); }
  int64_t dim(int i) const { return shape_.at(size_t(i < 0 ? i + ndim() : i)); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return dtype_nbytes(dtype_, numel()); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* raw() const { return data_; }
  // The allocation this tensor views (shared by its reshapes and slices): an identity for caches.
  const std::shared_ptr<void>& storage() const { return storage_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }
  float* f32() const;  // checks the dtype is F32

  // Shares storage with a new shape of the same element count.
  Tensor reshape(const Shape& shape) const;
  // Rows [begin, end) of the first dimension, sharing storage.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  Tensor clone(std::string_view what = "tensor") const;
  Tensor to(Device dev, std::string_view what = "tensor") const;
  // Converts to another dtype on the same device (CPU: any float/int -> F32, F32 -> float types).
  Tensor to_dtype(DType dt) const;
  void zero_();
  void copy_from(const Tensor& src);  // same shape and dtype, any devices

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::F32;
  Device device_;
};

}  // namespace rig
