// The nearest-code search of 8-bit AdamW, shared by the CPU oracle (adamw8bit.cpp) and the CUDA
// kernel (cuda/adamw8bit.cu) so both pick the same code for the same float. Plain C++: nvcc
// includes it too.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define RIG_ADAM8_HD __host__ __device__ __forceinline__
#else
#define RIG_ADAM8_HD inline
#endif

namespace rig::ops {

// The index of the code nearest to x in a sorted 256-value map: the number of midpoints between
// neighbouring codes that lie below x.
RIG_ADAM8_HD uint8_t adam8_nearest_code(const float* map, float x) {
  int lo = 0, hi = 255;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (x > (map[mid] + map[mid + 1]) * 0.5f) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return uint8_t(lo);
}

}  // namespace rig::ops
