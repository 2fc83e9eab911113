// 8-bit AdamW (bitsandbytes' blockwise scheme): both moments stored as one byte per element,
// codes into a 256-value dynamic map (signed for m, unsigned for v) scaled by one float32 absmax
// per block of 256 elements. Each step dequantizes a block, applies torch's AdamW update in
// float32 (the same order of operations as adamw_step), and quantizes the new moments to the
// nearest code with the block's new absmax. State: 2 bytes + 8 bytes per 256 elements per
// parameter element instead of 8 bytes.
#pragma once
#include <vector>

#include "rig/ops/ops.h"

namespace rig::ops {

constexpr int64_t kAdam8Block = 256;

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), sorted ascending.
const std::vector<float>& adam8_map(bool is_signed);

// One step on one tensor. param and grad F32 or BF16 (same element count); mq, vq U8 [n]; mabs,
// vabs F32 [ceil(n / 256)]. Zero-initialised state (codes of 0.0, absmax 0) is the fresh state.
void adamw8bit_step(Tensor& param, const Tensor& grad, Tensor& mq, Tensor& mabs, Tensor& vq,
                    Tensor& vabs, const AdamWParams& h);

#ifdef RIG_WITH_CUDA
namespace cuda::k8 {
// The kernel's launcher (adamw8bit.cu): param/grad F32 (is_bf16 = 0) or BF16 (1); maps on the
// device, 256 floats each. Returns the launch status.
int adamw8bit(void* p, int p_bf16, const void* g, int g_bf16, unsigned char* mq, float* mabs,
              unsigned char* vq, float* vabs, const float* mmap, const float* vmap, long long n,
              float decay, float w1, float beta2, float w2, float bc2_sqrt, float eps,
              float step_size, void* stream);
}  // namespace cuda::k8
#endif

}  // namespace rig::ops
