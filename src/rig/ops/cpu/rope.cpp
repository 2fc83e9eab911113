#include "rig/ops/cpu/cpu_ops.h"

namespace rig::ops::cpu {

// Forward: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin (halves of each head).
// Backward is the transpose: the same rotation with -sin.
void rope(Tensor& x, const Tensor& pos, const Tensor& cos, const Tensor& sin, int heads,
          bool backward) {
  const int64_t rows = x.dim(0), width = x.dim(1), d = width / heads, half = d / 2;
  RIG_CHECK(cos.dim(1) == half, "rope table width {} for head_dim {}", cos.dim(1), d);
  const int64_t* p = pos.data<int64_t>();
  const float *pc = cos.f32(), *ps = sin.f32();
  float* px = x.f32();
  const float sgn = backward ? -1.0f : 1.0f;
  for (int64_t r = 0; r < rows; ++r)
    RIG_CHECK(p[r] >= 0 && p[r] < cos.dim(0), "position {} outside the rope table ({})", p[r],
              cos.dim(0));
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const float *c = pc + p[r] * half, *s = ps + p[r] * half;
    for (int h = 0; h < heads; ++h) {
      float* v = px + r * width + h * d;
      for (int64_t i = 0; i < half; ++i) {
        float x1 = v[i], x2 = v[i + half], si = sgn * s[i];
        v[i] = x1 * c[i] - x2 * si;
        v[i + half] = x2 * c[i] + x1 * si;
      }
    }
  }
}

}  // namespace rig::ops::cpu
