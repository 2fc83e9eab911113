#include "rig/core/allocator.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <new>
#include <vector>

namespace rig {

void* Allocator::allocate(size_t bytes, std::string_view what) {
  if (bytes == 0) bytes = 1;
  size_t b = budget_.load();
  size_t now = in_use_.fetch_add(bytes) + bytes;
  if (b && now > b) {
    in_use_.fetch_sub(bytes);
    throw OutOfMemory(fmt::format(
        "out of memory on {}: allocating {} for {} with {} in use would exceed the budget of {}",
        device_, format_bytes(double(bytes)), what, format_bytes(double(now - bytes)),
        format_bytes(double(b))));
  }
  void* p = raw_allocate(bytes);
  if (!p) {
    in_use_.fetch_sub(bytes);
    // Within the budget after the cache was released, yet refused: the device itself is full
    // (other processes, or ranks sharing the GPU, hold the rest).
    if (b && !fits_budget(bytes))
      throw OutOfMemory(fmt::format(
          "out of memory on {}: allocating {} for {} with {} in use ({} reserved) would exceed "
          "the budget of {}",
          device_, format_bytes(double(bytes)), what, format_bytes(double(now - bytes)),
          format_bytes(double(reserved_.load())), format_bytes(double(b))));
    throw OutOfMemory(fmt::format(
        "out of memory on {}: allocating {} for {} with {} in use ({} reserved by this process) "
        "failed: the device has no more free memory{}",
        device_, format_bytes(double(bytes)), what, format_bytes(double(now - bytes)),
        format_bytes(double(reserved_.load())),
        b ? fmt::format(" (the budget of {} was not reached; other processes hold the rest)",
                        format_bytes(double(b)))
          : std::string()));
  }
  size_t pk = peak_.load();
  while (now > pk && !peak_.compare_exchange_weak(pk, now)) {
  }
  return p;
}

void Allocator::note_reserved(size_t bytes) {
  const size_t now = reserved_.fetch_add(bytes) + bytes;
  size_t pk = peak_reserved_.load();
  while (now > pk && !peak_reserved_.compare_exchange_weak(pk, now)) {
  }
}

void Allocator::deallocate(void* p, size_t bytes) {
  if (!p) return;
  if (bytes == 0) bytes = 1;
  raw_deallocate(p, bytes);
  in_use_.fetch_sub(bytes);
}

namespace {
// Large blocks are cached by size: training allocates the same activation shapes every step, and
// returning them to the OS costs page faults and zeroing on every reuse.
class CpuAllocator final : public Allocator {
 public:
  CpuAllocator() : Allocator("cpu") {}
  ~CpuAllocator() override {
    for (auto& [size, blocks] : cache_)
      for (void* p : blocks) std::free(p);
  }
  // Cached blocks count as reserved; small ones are returned to the C library at once.

 protected:
  static constexpr size_t kCacheMin = 64 << 10;
  static size_t rounded(size_t bytes) {
    return bytes >= kCacheMin ? (bytes + 4095) / 4096 * 4096 : (bytes + 63) / 64 * 64;
  }
  void* raw_allocate(size_t bytes) override {
    size_t b = rounded(bytes);
    if (b >= kCacheMin) {
      std::lock_guard<std::mutex> g(mu_);
      auto it = cache_.find(b);
      if (it != cache_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        return p;
      }
    }
    // 64-byte alignment suits AVX-512 loads and BLAS.
    void* p = std::aligned_alloc(64, b);
    if (p) note_reserved(b);
    return p;
  }
  void raw_deallocate(void* p, size_t bytes) override {
    size_t b = rounded(bytes);
    if (b >= kCacheMin) {
      std::lock_guard<std::mutex> g(mu_);
      cache_[b].push_back(p);
      return;
    }
    std::free(p);
    note_released(b);
  }

 private:
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> cache_;
};
}  // namespace

Allocator& cpu_allocator() {
  static CpuAllocator a;
  return a;
}

bool cuda_pool_requested(const char* value) {
  const std::string v = value ? value : "";
  if (v.empty() || v == "pool") return true;
  if (v == "caching") return false;
  bad_input("RIG_CUDA_ALLOCATOR='{}': expected pool or caching", v);
}

size_t parse_bytes(std::string_view text, std::string_view what) {
  std::string s(text);
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  std::string num = s.substr(0, i), unit = s.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  char* end = nullptr;
  double v = num.empty() ? -1 : std::strtod(num.c_str(), &end);
  if (num.empty() || end != num.c_str() + num.size() || v < 0)
    bad_input("{}: '{}' is not a size (expected e.g. 22GiB, 512MiB, 1.5GB)", what, text);
  struct U {
    const char* name;
    double mult;
  };
  static const U units[] = {{"", 1},      {"B", 1},       {"K", 1e3},    {"KB", 1e3},
                            {"KiB", 1024.}, {"M", 1e6},   {"MB", 1e6},   {"MiB", 1048576.},
                            {"G", 1e9},   {"GB", 1e9},    {"GiB", 1073741824.}, {"T", 1e12},
                            {"TB", 1e12}, {"TiB", 1099511627776.}};
  for (const auto& u : units)
    if (unit == u.name) {
      if (v * u.mult > 0x1p62) bad_input("{}: '{}' is too large a size", what, text);
      return size_t(std::llround(v * u.mult));
    }
  bad_input("{}: unknown unit '{}' in '{}' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", what, unit,
            text);
}

std::string format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(b) >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.2f} {}", b, units[u]);
}

}  // namespace rig
