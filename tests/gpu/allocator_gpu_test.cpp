// Both CUDA allocators' budgets bound the bytes reserved from the GPU (cached free blocks
// included), not only the bytes in use: what `max_memory` promises about nvidia-smi.
#include <gtest/gtest.h>

#include "rig/core/allocator.h"
#include "rig/core/tensor.h"

using namespace rig;

#ifdef RIG_WITH_CUDA
TEST(CudaAllocator, BudgetBoundsReservedBytes) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible";
  const size_t MiB = size_t(1) << 20;
  for (bool pool : {true, false}) {
    SCOPED_TRACE(pool ? "pool" : "caching");
    std::unique_ptr<Allocator> a = make_cuda_allocator(0, pool);
    EXPECT_EQ(a->reserved(), 0u);
    a->set_budget(256 * MiB);
    // A freed 100 MiB block stays reserved; a 180 MiB block cannot reuse it, and both together
    // would pass the budget: the cached block is given back first.
    a->deallocate(a->allocate(100 * MiB, "first"), 100 * MiB);
    EXPECT_GE(a->reserved(), 100 * MiB);
    void* big = a->allocate(180 * MiB, "big");
    EXPECT_LE(a->reserved(), 256 * MiB);
    EXPECT_LE(a->peak_reserved(), 256 * MiB + 2 * MiB);  // 2 MiB rounding of the peak
    // 180 + 100 in use cannot fit 256 whatever is cached.
    EXPECT_THROW(a->allocate(100 * MiB, "too much"), OutOfMemory);
    EXPECT_GE(a->reserved(), a->in_use());
    a->deallocate(big, 180 * MiB);
    a->release_cached();
    EXPECT_EQ(a->reserved(), 0u);
  }
}
#endif
