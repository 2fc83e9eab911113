// cuDNN's fused attention (flash SDPA) through the backend graph API: causal, grouped-query heads,
// bf16 q/k/v/out in rig's [B,T,H,D] layout read in place, fp32 log-sum-exp saved for backward.
// Each call either runs cuDNN or returns false with the reason (old runtime, unsupported shape or
// GPU, no engine found), so the caller can take another implementation.
#pragma once
#include <string>

#include "rig/core/tensor.h"

namespace rig::ops::cuda::sdpa_cudnn {

// The cuDNN runtime version (e.g. 91400), or 0 when rig was built without cuDNN.
int runtime_version();

bool forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
             std::string* why);
// deterministic: cuDNN's bitwise-repeatable variant (B*Hq*T*T*2 bytes more workspace, slower).
bool backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
              bool deterministic, std::string* why);

}  // namespace rig::ops::cuda::sdpa_cudnn
