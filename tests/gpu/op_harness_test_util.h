// Helpers of the op_harness_*test.cpp files: device copies and the comparison with the CPU oracle.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "../op_cases.h"
#include "rig/core/tensor.h"

namespace rig::test::op_harness {

#define RIG_REQUIRE_GPU()                                                                   \
  do {                                                                                      \
    if (!rig::cuda_available())                                                             \
      GTEST_SKIP() << "no CUDA GPU: the op harness compares the CUDA backend with the CPU " \
                      "and needs a visible GPU in a -DRIG_CUDA=ON build";                   \
  } while (0)

inline const DType kDtypes[] = {DType::F32, DType::BF16};

inline double tol(DType dt) {
  return dt == DType::F32 ? 1e-5 : 2e-2;
}
inline const char* name(DType dt) {
  return dt == DType::F32 ? "F32" : "BF16";
}

inline Tensor rand_ids(int64_t n, int64_t hi, std::mt19937& g) {
  std::uniform_int_distribution<int64_t> u(0, hi - 1);
  std::vector<int64_t> v{};
  v.resize(size_t(n));
  for (auto& x : v) x = u(g);
  return ints(v, {n});
}

// A CPU float32 copy holding exactly the values a `dt` tensor can hold.
inline Tensor rounded(const Tensor& t, DType dt) {
  return dt == DType::F32 ? t.clone() : t.to_dtype(dt).to_dtype(DType::F32);
}
// A device copy of a CPU tensor (float tensors converted to dt, integer tensors as they are).
inline Tensor gpu(const Tensor& t, DType dt = DType::F32) {
  if (t.dtype() != DType::F32) return t.to(Device::cuda(0));
  return t.to_dtype(dt).to(Device::cuda(0));
}
// A CPU float32 copy of a device tensor.
inline Tensor host(const Tensor& t) {
  Tensor c = t.to(Device::cpu());
  return c.dtype() == DType::F32 ? c : c.to_dtype(DType::F32);
}

inline double nerr(const Tensor& a, const Tensor& ref) {
  EXPECT_EQ(a.shape(), ref.shape());
  const float *pa = a.f32(), *pr = ref.f32();
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(pa[i]) - double(pr[i]);
    num += d * d;
    den += double(pr[i]) * pr[i];
  }
  if (!std::isfinite(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

#define EXPECT_CLOSE(gpu_f32, cpu_f32, dt, what)                                         \
  do {                                                                                   \
    const double e_ = nerr(gpu_f32, cpu_f32);                                            \
    EXPECT_LE(e_, tol(dt)) << (what) << " [" << name(dt) << "] normalised error " << e_; \
  } while (0)

}  // namespace rig::test::op_harness
