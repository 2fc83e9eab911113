// Generation's ops (op_table.inc): attention of new rows against a key/value cache
// (attention_decode, float32) and the greedy pick of a row's largest logit (argmax).
#include <cmath>
#include <limits>
#include <vector>

#include "rig/ops/cpu/cpu_ops.h"

namespace rig::ops::cpu {

void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t past,
                      Tensor& out) {
  RIG_CHECK(q.ndim() == 3 && k_cache.ndim() == 3 && v_cache.ndim() == 3 && out.ndim() == 3,
            "attention_decode expects q/out [n,Hq,D] and caches [max_len,Hk,D], got {} and {}",
            shape_str(q.shape()), shape_str(k_cache.shape()));
  const int64_t n = q.dim(0), Hq = q.dim(1), D = q.dim(2), max_len = k_cache.dim(0),
                Hk = k_cache.dim(1);
  RIG_CHECK(out.shape() == q.shape(), "attention_decode: out {} for q {}", shape_str(out.shape()),
            shape_str(q.shape()));
  RIG_CHECK(v_cache.shape() == k_cache.shape() && k_cache.dim(2) == D && Hk > 0 && Hq % Hk == 0,
            "attention_decode: q {} with caches {} and {}", shape_str(q.shape()),
            shape_str(k_cache.shape()), shape_str(v_cache.shape()));
  RIG_CHECK(past >= 0 && past + n <= max_len,
            "attention_decode: rows [{}, {}) past the cache's {} rows", past, past + n, max_len);
  const float scale = 1.0f / std::sqrt(float(D));
  const float *pq = q.f32(), *pk = k_cache.f32(), *pv = v_cache.f32();
  float* po = out.f32();
  const int64_t group = Hq / Hk;
#pragma omp parallel
  {
    std::vector<float> s(size_t(past + n));
#pragma omp for collapse(2)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t len = past + r + 1, hk = h / group;
        const float* qr = pq + (r * Hq + h) * D;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < len; ++j) {
          const float* kj = pk + (j * Hk + hk) * D;
          float dot = 0;
          for (int64_t x = 0; x < D; ++x) dot += qr[x] * kj[x];
          s[size_t(j)] = dot * scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < len; ++j) sum += std::exp(double(s[size_t(j)] - mx));
        const float l = mx + float(std::log(sum));
        float* o = po + (r * Hq + h) * D;
        std::fill_n(o, D, 0.0f);
        for (int64_t j = 0; j < len; ++j) {
          const float p = std::exp(s[size_t(j)] - l);
          const float* vj = pv + (j * Hk + hk) * D;
          for (int64_t x = 0; x < D; ++x) o[x] += p * vj[x];
        }
      }
  }
}

void argmax(const Tensor& x, int64_t limit, Tensor& out) {
  RIG_CHECK(x.ndim() == 2 && x.device().is_cpu() && out.device().is_cpu(),
            "argmax expects x [rows, V] on the CPU, got {} on {}", shape_str(x.shape()),
            x.device().str());
  RIG_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16, "argmax: x is {}, not F32 or BF16",
            dtype_name(x.dtype()));
  const int64_t rows = x.dim(0), V = x.dim(1);
  RIG_CHECK(limit >= 1 && limit <= V, "argmax: limit {} outside [1, {}]", limit, V);
  RIG_CHECK(out.dtype() == DType::I64 && out.numel() == rows,
            "argmax: out must be int64 with {} elements, got {} {}", rows, dtype_name(out.dtype()),
            shape_str(out.shape()));
  const bool bf16 = x.dtype() == DType::BF16;
  const float* xf = bf16 ? nullptr : x.f32();
  const uint16_t* xb = x.data<uint16_t>();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best = -1;
    float bv = 0;
    for (int64_t i = 0; i < limit; ++i) {
      const float v = bf16 ? bf16_to_f32(xb[r * V + i]) : xf[r * V + i];
      if (std::isnan(v)) continue;
      if (best < 0 || v > bv) {
        best = i;
        bv = v;
      }
    }
    out.data<int64_t>()[r] = best < 0 ? 0 : best;
  }
}

}  // namespace rig::ops::cpu
