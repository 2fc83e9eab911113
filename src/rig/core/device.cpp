// Device dispatch for memory. The CUDA half lives in cuda_device_cuda.cpp (built only with CUDA).
#include <cstdlib>
#include <cstring>

#include "rig/core/allocator.h"
#include "rig/core/host_memory.h"
#include "rig/core/tensor.h"

namespace rig {

#ifdef RIG_WITH_CUDA
Allocator& cuda_allocator(int index);
bool cuda_runtime_available();
int cuda_runtime_device_count();
size_t cuda_runtime_total_memory(int index);
void cuda_copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n);
void cuda_memset_zero(void* p, size_t n, int index);
void* cuda_host_alloc(size_t bytes);  // nullptr when page-locked memory is not to be had
void cuda_host_free(void* p);
bool cuda_host_register(void* p, size_t bytes);
void cuda_host_unregister(void* p);
bool cuda_ipc_alloc(int index, size_t bytes, void** p, char handle[64]);
void cuda_ipc_free(int index, void* p);
void* cuda_ipc_open(int index, const char handle[64]);
void cuda_ipc_close(int index, void* p);
void cuda_stream_sync(int index);
#endif

Allocator& allocator_for(Device d) {
  if (d.is_cpu()) return cpu_allocator();
#ifdef RIG_WITH_CUDA
  return cuda_allocator(d.index);
#else
  bad_input("device {} requested, but this rig was built without CUDA", d.str());
#endif
}

bool cuda_available() {
#ifdef RIG_WITH_CUDA
  return cuda_runtime_available();
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef RIG_WITH_CUDA
  return cuda_runtime_available() ? cuda_runtime_device_count() : 0;
#else
  return 0;
#endif
}

size_t cuda_total_memory(int index) {
#ifdef RIG_WITH_CUDA
  return cuda_runtime_available() ? cuda_runtime_total_memory(index) : 0;
#else
  (void)index;
  return 0;
#endif
}

Device resolve_device(std::string_view spec, std::string_view what) {
  if (spec == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  Device d;
  try {
    d = Device::parse(spec);
  } catch (const InputError&) {
    bad_input("{}: device '{}' is not one of auto, cpu, cuda, cuda:N", what, spec);
  }
  if (d.is_cpu()) return d;
#ifdef RIG_WITH_CUDA
  if (!cuda_available())
    bad_input("{}: device '{}' requested, but no CUDA GPU is visible", what, spec);
  const int n = cuda_device_count();
  if (d.index >= n)
    bad_input("{}: device '{}' requested, but only {} CUDA GPU{} visible (cuda:0{})", what, spec, n,
              n == 1 ? " is" : "s are", n > 1 ? fmt::format(" to cuda:{}", n - 1) : "");
#else
  bad_input("{}: device '{}' requested, but this rig was built without CUDA", what, spec);
#endif
  return d;
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n) {
  if (n == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memmove(dst, src, n);
    return;
  }
#ifdef RIG_WITH_CUDA
  cuda_copy_bytes(dst, dst_dev, src, src_dev, n);
#else
  fail("copy between {} and {} needs a CUDA build", src_dev.str(), dst_dev.str());
#endif
}

std::shared_ptr<void> pinned_host_block(size_t bytes) {
  const size_t n = bytes ? bytes : 1;
#ifdef RIG_WITH_CUDA
  if (cuda_available())
    if (void* p = cuda_host_alloc(n)) return std::shared_ptr<void>(p, cuda_host_free);
#endif
  void* p = std::malloc(n);
  if (!p) fail("out of host memory allocating {} bytes for staging", n);
  return std::shared_ptr<void>(p, std::free);
}

bool pin_host_range(void* p, size_t bytes) {
#ifdef RIG_WITH_CUDA
  return cuda_available() && cuda_host_register(p, bytes);
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

void unpin_host_range(void* p) {
#ifdef RIG_WITH_CUDA
  cuda_host_unregister(p);
#else
  (void)p;
#endif
}

#ifdef RIG_WITH_CUDA
bool ipc_alloc(int device, size_t bytes, void** p, char handle[64]) {
  return cuda_available() && cuda_ipc_alloc(device, bytes, p, handle);
}
void ipc_free(int device, void* p) { cuda_ipc_free(device, p); }
void* ipc_open(int device, const char handle[64]) { return cuda_ipc_open(device, handle); }
void ipc_close(int device, void* p) { cuda_ipc_close(device, p); }
void device_stream_sync(int device) { cuda_stream_sync(device); }
#else
bool ipc_alloc(int, size_t, void**, char[64]) { return false; }
void ipc_free(int, void*) {}
void* ipc_open(int, const char[64]) { return nullptr; }
void ipc_close(int, void*) {}
void device_stream_sync(int) {}
#endif

void Tensor::zero_() {
  if (!data_) return;
  if (device_.is_cpu()) {
    std::memset(data_, 0, nbytes());
    return;
  }
#ifdef RIG_WITH_CUDA
  cuda_memset_zero(data_, nbytes(), device_.index);
#endif
}

}  // namespace rig
