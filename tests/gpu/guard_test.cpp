// The guard's device checks against their CPU twins (docs/reliability.md): the parameter hash must
// be the same value on both backends (the CUDA sum of 64-bit words runs in any block order), and
// the bad-value counts the same, over F32 and BF16 tensors at awkward sizes and an unaligned view.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "rig/core/tensor.h"
#include "rig/ops/ops.h"

namespace rig {
namespace {

TEST(GpuGuard, HashAndBadValueCountsMatchTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU: the guard's kernels need a visible GPU";
  std::mt19937 g(7);
  std::normal_distribution<float> n(0.0f, 0.02f);
  std::vector<Tensor> host;
  for (int64_t size : {1, 3, 111, 989, 65537, 1000003}) {
    std::vector<float> v(static_cast<size_t>(size));
    for (auto& x : v) x = n(g);
    host.push_back(Tensor::from_f32(v, {size}));
  }
  host.push_back(host[4].to_dtype(DType::BF16));
  host.push_back(host.back().slice_rows(1, 990));  // an odd BF16 offset: unaligned 32-bit words
  std::vector<Tensor> dev;
  for (const auto& t : host) dev.push_back(t.to(Device::cuda(0), "guard test"));
  // The slice of the device copy, so the view is unaligned on the device too.
  dev.back() = dev[dev.size() - 2].slice_rows(1, 990);
  EXPECT_EQ(ops::hash64(dev), ops::hash64(host));
  for (size_t i = 0; i < host.size(); ++i)
    EXPECT_EQ(ops::hash64({dev[i]}), ops::hash64({host[i]})) << i;
  EXPECT_EQ(ops::count_bad_values(dev), 0);
  // NaN, Inf and an implausible value, in F32 and BF16.
  host[3].f32()[5] = std::nanf("");
  host[3].f32()[6] = INFINITY;
  host[3].f32()[7] = 3e9f;
  dev[3].copy_from(host[3]);
  Tensor b = host[3].to_dtype(DType::BF16);
  Tensor db = b.to(Device::cuda(0), "guard test");
  EXPECT_EQ(ops::count_bad_values({dev[3], db}), ops::count_bad_values({host[3], b}));
  EXPECT_EQ(ops::count_bad_values({dev[3], db}), 4);
  EXPECT_EQ(ops::count_bad_values({dev[3], db}, 1e8), 6);
  EXPECT_NE(ops::hash64({dev[3]}), ops::hash64({dev[2]}));
}

}  // namespace
}  // namespace rig
