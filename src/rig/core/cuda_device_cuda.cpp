// CUDA memory: a caching allocator per device (cudaMalloc is slow and synchronising). The budget
// bounds the bytes reserved with cudaMalloc (cached free blocks included): past it, the cache is
// released before anything new is reserved.
#include <map>
#include <mutex>
#include <vector>

#include "rig/core/allocator.h"
#include "rig/core/cuda_check.h"
#include "rig/core/tensor.h"

namespace rig {

namespace {

size_t round_block(size_t bytes) {
  const size_t small = 512, large = size_t(2) << 20;
  return bytes < (size_t(1) << 20) ? (bytes + small - 1) / small * small
                                   : (bytes + large - 1) / large * large;
}

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int index)
      : Allocator(fmt::format("cuda:{}", index)), index_(index) {}

  void release_cached() override { release_cache(); }

  void release_cache() {
    std::lock_guard<std::mutex> g(mu_);
    int prev;
    RIG_CUDA_CHECK(cudaGetDevice(&prev));
    RIG_CUDA_CHECK(cudaSetDevice(index_));
    for (auto& [size, p] : free_) {
      cudaFree(p);
      note_released(size);
    }
    free_.clear();
    RIG_CUDA_CHECK(cudaSetDevice(prev));
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    size_t b = round_block(bytes);
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.lower_bound(b);
      // Reuse a cached block no more than twice the size asked for.
      if (it != free_.end() && it->first <= 2 * b) {
        void* p = it->second;
        sizes_[p] = it->first;
        free_.erase(it);
        return p;
      }
    }
    if (!fits_budget(b)) {
      release_cache();
      if (!fits_budget(b)) return nullptr;
    }
    int prev;
    RIG_CUDA_CHECK(cudaGetDevice(&prev));
    RIG_CUDA_CHECK(cudaSetDevice(index_));
    void* p = nullptr;
    if (cudaMalloc(&p, b) != cudaSuccess) {
      cudaGetLastError();
      RIG_CUDA_CHECK(cudaSetDevice(prev));
      release_cache();
      RIG_CUDA_CHECK(cudaSetDevice(index_));
      if (cudaMalloc(&p, b) != cudaSuccess) {
        cudaGetLastError();
        p = nullptr;
      }
    }
    RIG_CUDA_CHECK(cudaSetDevice(prev));
    if (p) {
      std::lock_guard<std::mutex> g(mu_);
      sizes_[p] = b;
      note_reserved(b);
    }
    return p;
  }

  void raw_deallocate(void* p, size_t) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sizes_.find(p);
    if (it == sizes_.end()) return;
    free_.emplace(it->second, p);
    sizes_.erase(it);
  }

 private:
  int index_;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::map<void*, size_t> sizes_;
};

}  // namespace

bool cuda_runtime_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

Allocator& cuda_allocator(int index) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<CudaCachingAllocator>> allocs;
  std::lock_guard<std::mutex> g(mu);
  if (!cuda_runtime_available()) bad_input("device cuda:{} requested, but no CUDA GPU is visible", index);
  int n = 0;
  RIG_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (index < 0 || index >= n) bad_input("device cuda:{} requested, but only {} GPU(s) are visible", index, n);
  if (allocs.empty()) allocs.resize(size_t(n));
  if (!allocs[size_t(index)]) allocs[size_t(index)] = std::make_unique<CudaCachingAllocator>(index);
  return *allocs[size_t(index)];
}

void cuda_copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n) {
  cudaMemcpyKind kind = dst_dev.is_cpu() ? cudaMemcpyDeviceToHost
                        : src_dev.is_cpu() ? cudaMemcpyHostToDevice
                                           : cudaMemcpyDeviceToDevice;
  RIG_CUDA_CHECK(cudaMemcpy(dst, src, n, kind));
}

void cuda_memset_zero(void* p, size_t n, int index) {
  int prev;
  RIG_CUDA_CHECK(cudaGetDevice(&prev));
  RIG_CUDA_CHECK(cudaSetDevice(index));
  RIG_CUDA_CHECK(cudaMemset(p, 0, n));
  RIG_CUDA_CHECK(cudaSetDevice(prev));
}

}  // namespace rig
