#include "rig/ops/adamw8bit.h"

#include <algorithm>
#include <cmath>

#include "rig/ops/adam8_code.h"
#include "rig/ops/profile.h"
#include "rig/quant/nf4.h"
#ifdef RIG_WITH_CUDA
#include "rig/ops/cuda/context.h"
#endif

namespace rig::ops {

const std::vector<float>& adam8_map(bool is_signed) {
  static const std::vector<float> s = quant::create_dynamic_map(true);
  static const std::vector<float> u = quant::create_dynamic_map(false);
  return is_signed ? s : u;
}

namespace {

void check_state(const Tensor& param, const Tensor& grad, const Tensor& mq, const Tensor& mabs,
                 const Tensor& vq, const Tensor& vabs) {
  const int64_t n = param.numel(), blocks = (n + kAdam8Block - 1) / kAdam8Block;
  RIG_CHECK(grad.numel() == n, "adamw8bit: grad {} for param {}", shape_str(grad.shape()),
            shape_str(param.shape()));
  for (const Tensor* q : {&mq, &vq})
    RIG_CHECK(q->dtype() == DType::U8 && q->numel() == n,
              "adamw8bit: codes must be U8 [{}], got {} {}", n, dtype_name(q->dtype()),
              shape_str(q->shape()));
  for (const Tensor* a : {&mabs, &vabs})
    RIG_CHECK(a->dtype() == DType::F32 && a->numel() == blocks,
              "adamw8bit: absmax must be F32 [{}], got {} {}", blocks, dtype_name(a->dtype()),
              shape_str(a->shape()));
  for (const Tensor* t : {&grad, &mq, &mabs, &vq, &vabs})
    RIG_CHECK(t->device() == param.device(), "adamw8bit: state on {} but param on {}",
              t->device().str(), param.device().str());
}

}  // namespace

void adamw8bit_step(Tensor& param, const Tensor& grad, Tensor& mq, Tensor& mabs, Tensor& vq,
                    Tensor& vabs, const AdamWParams& h) {
  OpScope scope("adamw8bit_step", "optimizer", param.device().is_cuda(), param.device().index);
  check_state(param, grad, mq, mabs, vq, vabs);
  RIG_CHECK(h.step >= 1, "adamw8bit: step {} (counts from 1)", h.step);
  // The scalars exactly as adamw_step computes them.
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(h.step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(h.step));
  const float step_size = float(double(h.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float decay = 1.0f - h.lr * h.weight_decay;
  const float w1 = 1.0f - h.beta1, w2 = 1.0f - h.beta2;
  const int64_t n = param.numel(), blocks = (n + kAdam8Block - 1) / kAdam8Block;
#ifdef RIG_WITH_CUDA
  if (param.device().is_cuda()) {
    const int dev = param.device().index;
    RIG_CHECK(param.dtype() == DType::F32 || param.dtype() == DType::BF16,
              "adamw8bit: param must be F32 or BF16");
    RIG_CHECK(grad.dtype() == DType::F32 || grad.dtype() == DType::BF16,
              "adamw8bit: grad must be F32 or BF16");
    cuda::DeviceGuard g(dev);
    // The two maps live on each device once, never freed (they must outlive the allocators at
    // exit, as the cuBLASLt workspaces do).
    static Tensor* maps = new Tensor[16];
    RIG_CHECK(dev < 16, "adamw8bit: device {}", dev);
    if (!maps[dev].defined()) {
      std::vector<float> both = adam8_map(true);
      both.insert(both.end(), adam8_map(false).begin(), adam8_map(false).end());
      maps[dev] = Tensor::from_f32(both, {512}).to(param.device(), "adam8 maps");
    }
    const int rc = cuda::k8::adamw8bit(param.raw(), param.dtype() == DType::BF16, grad.raw(),
                                       grad.dtype() == DType::BF16, mq.data<uint8_t>(), mabs.f32(),
                                       vq.data<uint8_t>(), vabs.f32(), maps[dev].f32(),
                                       maps[dev].f32() + 256, n, decay, w1, h.beta2, w2, bc2_sqrt,
                                       h.eps, step_size, cuda::stream_for(dev));
    RIG_CHECK(rc == 0, "adamw8bit: kernel launch failed ({})", cudaGetErrorString(cudaError_t(rc)));
    return;
  }
#endif
  RIG_CHECK(param.dtype() == DType::F32 && grad.dtype() == DType::F32,
            "adamw8bit on the CPU needs F32 param and grad");
  const float *mmap = adam8_map(true).data(), *vmap = adam8_map(false).data();
  float* pp = param.f32();
  const float* pg = grad.f32();
  uint8_t *pmq = mq.data<uint8_t>(), *pvq = vq.data<uint8_t>();
  float *pma = mabs.f32(), *pva = vabs.f32();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kAdam8Block, i1 = std::min(n, i0 + kAdam8Block);
    float m[kAdam8Block], v[kAdam8Block];
    float mmax = 0, vmax = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const float g = pg[i];
      float p = pp[i] * decay;
      float mi = mmap[pmq[i]] * pma[b], vi = vmap[pvq[i]] * pva[b];
      mi += w1 * (g - mi);
      vi = vi * h.beta2 + w2 * g * g;
      const float denom = std::sqrt(vi) / bc2_sqrt + h.eps;
      p -= step_size * (mi / denom);
      pp[i] = p;
      m[i - i0] = mi;
      v[i - i0] = vi;
      mmax = std::max(mmax, std::fabs(mi));
      vmax = std::max(vmax, vi);
    }
    pma[b] = mmax;
    pva[b] = vmax;
    for (int64_t i = i0; i < i1; ++i) {
      pmq[i] = adam8_nearest_code(mmap, mmax > 0 ? m[i - i0] / mmax : 0.0f);
      pvq[i] = adam8_nearest_code(vmap, vmax > 0 ? v[i - i0] / vmax : 0.0f);
    }
  }
}

}  // namespace rig::ops
