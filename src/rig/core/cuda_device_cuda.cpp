// CUDA memory: a caching allocator per device (cudaMalloc is slow and synchronising). The budget
// bounds the bytes reserved with cudaMalloc (cached free blocks included): past it, the cache is
// released before anything new is reserved. By default memory comes from a stream-ordered pool
// instead (cudaMallocFromPoolAsync on the stream every op runs on), which splits and joins blocks
// itself (far less reserved beyond use); the reserved bytes are then the pool's own count.
// RIG_CUDA_ALLOCATOR=caching picks the caching allocator.
#include <cstring>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
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

// A memory pool of rig's own on the device (not the default pool, which libraries may share, so
// its reserved count is rig's tensors alone), used in stream order on the legacy default stream:
// the one the ops run on (ops/cuda/context.h) and that Tensor's synchronous copies are ordered
// with, so a block freed here is reused only after the kernels queued before the free.
class CudaPoolAllocator final : public Allocator {
 public:
  explicit CudaPoolAllocator(int index) : Allocator(fmt::format("cuda:{}", index)), index_(index) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = index_;
    RIG_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
    // Keep freed memory in the pool (as a caching allocator does) until the budget asks for it.
    uint64_t keep = UINT64_MAX;
    RIG_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  ~CudaPoolAllocator() override {
    // Only the tests' own allocators end: the process's live until exit.
    cudaStreamSynchronize(cudaStreamLegacy);
    cudaMemPoolDestroy(pool_);
  }

  void release_cached() override {
    std::lock_guard<std::mutex> g(mu_);
    trim();
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    std::lock_guard<std::mutex> g(mu_);
    if (!fits_budget(bytes)) {
      trim();
      if (!fits_budget(bytes)) return nullptr;
    }
    int prev;
    RIG_CUDA_CHECK(cudaGetDevice(&prev));
    RIG_CUDA_CHECK(cudaSetDevice(index_));
    void* p = nullptr;
    if (cudaMallocFromPoolAsync(&p, bytes, pool_, cudaStreamLegacy) != cudaSuccess) {
      cudaGetLastError();
      trim();
      if (cudaMallocFromPoolAsync(&p, bytes, pool_, cudaStreamLegacy) != cudaSuccess) {
        cudaGetLastError();
        p = nullptr;
      }
    }
    RIG_CUDA_CHECK(cudaSetDevice(prev));
    sync_reserved();
    return p;
  }

  void raw_deallocate(void* p, size_t) override {
    std::lock_guard<std::mutex> g(mu_);
    int prev;
    RIG_CUDA_CHECK(cudaGetDevice(&prev));
    RIG_CUDA_CHECK(cudaSetDevice(index_));
    cudaFreeAsync(p, cudaStreamLegacy);
    RIG_CUDA_CHECK(cudaSetDevice(prev));
  }

 private:
  // The pool's reserved bytes become the allocator's (the budget and the reported peak).
  void sync_reserved() {
    uint64_t cur = 0;
    RIG_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &cur));
    const size_t now = reserved();
    if (cur > now) note_reserved(size_t(cur) - now);
    if (cur < now) note_released(now - size_t(cur));
  }
  // Gives the pool's unused memory back to the device once the queued work is done.
  void trim() {
    int prev;
    RIG_CUDA_CHECK(cudaGetDevice(&prev));
    RIG_CUDA_CHECK(cudaSetDevice(index_));
    RIG_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    RIG_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
    RIG_CUDA_CHECK(cudaSetDevice(prev));
    sync_reserved();
  }

  int index_;
  std::mutex mu_;
  cudaMemPool_t pool_ = nullptr;
};

}  // namespace

std::unique_ptr<Allocator> make_cuda_allocator(int index, bool pool) {
  if (pool) return std::make_unique<CudaPoolAllocator>(index);
  return std::make_unique<CudaCachingAllocator>(index);
}

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
  static std::vector<std::unique_ptr<Allocator>> allocs;
  std::lock_guard<std::mutex> g(mu);
  if (!cuda_runtime_available()) bad_input("device cuda:{} requested, but no CUDA GPU is visible", index);
  int n = 0;
  RIG_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (index < 0 || index >= n) bad_input("device cuda:{} requested, but only {} GPU(s) are visible", index, n);
  if (allocs.empty()) allocs.resize(size_t(n));
  if (!allocs[size_t(index)]) {
    allocs[size_t(index)] =
        make_cuda_allocator(index, cuda_pool_requested(std::getenv("RIG_CUDA_ALLOCATOR")));
  }
  return *allocs[size_t(index)];
}

void cuda_copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n) {
  cudaMemcpyKind kind = dst_dev.is_cpu() ? cudaMemcpyDeviceToHost
                        : src_dev.is_cpu() ? cudaMemcpyHostToDevice
                                           : cudaMemcpyDeviceToDevice;
  RIG_CUDA_CHECK(cudaMemcpy(dst, src, n, kind));
}

size_t cuda_runtime_total_memory(int index) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return p.totalGlobalMem;
}

int cuda_runtime_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void* cuda_host_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void cuda_host_free(void* p) { cudaFreeHost(p); }

bool cuda_host_register(void* p, size_t bytes) {
  if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

void cuda_host_unregister(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

void cuda_memset_zero(void* p, size_t n, int index) {
  int prev;
  RIG_CUDA_CHECK(cudaGetDevice(&prev));
  RIG_CUDA_CHECK(cudaSetDevice(index));
  RIG_CUDA_CHECK(cudaMemset(p, 0, n));
  RIG_CUDA_CHECK(cudaSetDevice(prev));
}

}  // namespace rig

namespace rig {

namespace {
// Runs f with `index` as the current device, restoring the caller's.
template <typename F>
auto on_device(int index, F f) {
  int prev;
  RIG_CUDA_CHECK(cudaGetDevice(&prev));
  RIG_CUDA_CHECK(cudaSetDevice(index));
  auto r = f();
  RIG_CUDA_CHECK(cudaSetDevice(prev));
  return r;
}
}  // namespace

bool cuda_ipc_alloc(int index, size_t bytes, void** p, char handle[64]) {
  static_assert(sizeof(cudaIpcMemHandle_t) == 64);
  return on_device(index, [&] {
    if (cudaMalloc(p, bytes) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, *p) != cudaSuccess) {
      cudaGetLastError();
      cudaFree(*p);
      return false;
    }
    std::memcpy(handle, &h, 64);
    return true;
  });
}

void cuda_ipc_free(int index, void* p) {
  on_device(index, [&] { return cudaFree(p); });
}

void* cuda_ipc_open(int index, const char handle[64]) {
  return on_device(index, [&]() -> void* {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle, 64);
    void* p = nullptr;
    if (cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  });
}

void cuda_ipc_close(int index, void* p) {
  on_device(index, [&] { return cudaIpcCloseMemHandle(p); });
}

void cuda_stream_sync(int index) {
  on_device(index, [&] {
    RIG_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    return 0;
  });
}

}  // namespace rig
