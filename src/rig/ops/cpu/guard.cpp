// The CPU twins of the guard's checks: bad-value counts and the parameter hash
// (ops/guard_hash.h), the same results as the CUDA kernels in ops/cuda/guard.cu.
#include <cmath>
#include <cstring>

#include "rig/core/dtype.h"
#include "rig/ops/cpu/cpu_ops.h"
#include "rig/ops/guard_hash.h"

namespace rig::ops::cpu {

namespace {

template <typename Load>
int64_t count_bad(int64_t n, double max_abs, Load load) {
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad)
  for (int64_t i = 0; i < n; ++i) {
    const double x = load(i);
    bad += !std::isfinite(x) || (max_abs > 0 && std::fabs(x) > max_abs);
  }
  return bad;
}

}  // namespace

int64_t count_bad_values(const std::vector<Tensor>& ts, double max_abs) {
  int64_t bad = 0;
  for (const Tensor& t : ts) {
    const int64_t n = t.numel();
    const uint8_t* p = static_cast<const uint8_t*>(t.raw());
    switch (t.dtype()) {
      case DType::F32:
        bad += count_bad(n, max_abs, [p](int64_t i) {
          float x;
          std::memcpy(&x, p + 4 * i, 4);
          return double(x);
        });
        break;
      case DType::BF16:
      case DType::F16: {
        const bool bf = t.dtype() == DType::BF16;
        bad += count_bad(n, max_abs, [p, bf](int64_t i) {
          uint16_t h;
          std::memcpy(&h, p + 2 * i, 2);
          return double(bf ? bf16_to_f32(h) : f16_to_f32(h));
        });
        break;
      }
      case DType::F64:
        bad += count_bad(n, max_abs, [p](int64_t i) {
          double x;
          std::memcpy(&x, p + 8 * i, 8);
          return x;
        });
        break;
      default:
        break;  // integers are always finite
    }
  }
  return bad;
}

uint64_t hash64(const std::vector<Tensor>& ts) {
  uint64_t h = 0;
  for (size_t t = 0; t < ts.size(); ++t) {
    const uint8_t* p = static_cast<const uint8_t*>(ts[t].raw());
    const int64_t bytes = int64_t(ts[t].nbytes());
    const int64_t words = (bytes + 3) / 4;
    const uint64_t base = hash::tensor_base(t);
    uint64_t s = 0;
    // Sums modulo 2^64: the same value for any split over threads.
#pragma omp parallel for reduction(+ : s)
    for (int64_t i = 0; i < words; ++i) {
      uint32_t w = 0;
      const int64_t b = 4 * i;
      if (b + 4 <= bytes) {
        std::memcpy(&w, p + b, 4);
      } else {
        for (int64_t k = b; k < bytes; ++k) w |= uint32_t(p[k]) << (8 * (k - b));
      }
      s += hash::word_term(base, uint64_t(i), w);
    }
    h += s;
  }
  return h;
}

}  // namespace rig::ops::cpu
