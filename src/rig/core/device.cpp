// Device dispatch for memory. The CUDA half lives in cuda_device_cuda.cpp (built only with CUDA).
#include <cstring>

#include "rig/core/allocator.h"
#include "rig/core/tensor.h"

namespace rig {

#ifdef RIG_WITH_CUDA
Allocator& cuda_allocator(int index);
bool cuda_runtime_available();
void cuda_copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n);
void cuda_memset_zero(void* p, size_t n, int index);
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
