// One allocator per device, with a byte budget and peak counters. Two amounts: bytes in use (what
// tensors asked for; the planner's predictions are checked against its peak) and bytes reserved
// (what the allocator holds from the device: in use, rounding and cached free blocks; what
// nvidia-smi sees, less the CUDA context). The budget bounds the reserved bytes, so that
// `max_memory: 22GiB` makes a large GPU refuse what a smaller card could not hold.
#pragma once
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "rig/core/error.h"

namespace rig {

class OutOfMemory : public Error {
 public:
  using Error::Error;
};

class Allocator {
 public:
  explicit Allocator(std::string device_name) : device_(std::move(device_name)) {}
  virtual ~Allocator() = default;
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Throws OutOfMemory naming `what`, the size, and the bytes in use against the budget.
  void* allocate(size_t bytes, std::string_view what);
  void deallocate(void* p, size_t bytes);

  size_t in_use() const { return in_use_.load(); }
  size_t peak() const { return peak_.load(); }
  size_t reserved() const { return reserved_.load(); }
  size_t peak_reserved() const { return peak_reserved_.load(); }
  size_t budget() const { return budget_.load(); }  // 0: no budget
  void set_budget(size_t bytes) { budget_.store(bytes); }
  // Gives cached free blocks back to the device (the CUDA allocator; a no-op elsewhere).
  virtual void release_cached() {}
  void reset_peak() {
    peak_.store(in_use_.load());
    peak_reserved_.store(reserved_.load());
  }
  const std::string& device_name() const { return device_; }

 protected:
  virtual void* raw_allocate(size_t bytes) = 0;  // nullptr when the device is out of memory
  virtual void raw_deallocate(void* p, size_t bytes) = 0;
  // Subclasses report what they take from and give back to the device.
  void note_reserved(size_t bytes);
  void note_released(size_t bytes) { reserved_.fetch_sub(bytes); }
  // Whether reserving `bytes` more stays within the budget.
  bool fits_budget(size_t bytes) const {
    const size_t b = budget_.load();
    return b == 0 || reserved_.load() + bytes <= b;
  }

 private:
  std::string device_;
  std::atomic<size_t> in_use_{0}, peak_{0}, budget_{0}, reserved_{0}, peak_reserved_{0};
};

Allocator& cpu_allocator();
#ifdef RIG_WITH_CUDA
// A CUDA allocator of either kind for device `index`, apart from the process's own (allocator_for:
// the stream-ordered pool, or the caching allocator under RIG_CUDA_ALLOCATOR=caching). For tests.
std::unique_ptr<Allocator> make_cuda_allocator(int index, bool pool);
#endif

// RIG_CUDA_ALLOCATOR's value (nullptr when unset): true for the stream-ordered pool (unset, empty
// or "pool"), false for "caching"; anything else throws InputError naming the variable.
bool cuda_pool_requested(const char* value);

// "22GiB", "512MiB", "1.5GB", "1000" (bytes). Throws InputError naming `what` on a bad value.
size_t parse_bytes(std::string_view text, std::string_view what = "size");
std::string format_bytes(double bytes);  // "1.50 GiB"

}  // namespace rig
