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

// Whether this runtime and GPU run packed rows as ragged batches (else *why).
bool ragged_supported(int dev, std::string* why);
// Packed rows (seg [B,T] I64 on the GPU): each maximal run of one segment id in a row becomes one
// of cuDNN's ragged batch entries, causal from the run's first token. Declines (false, *why) where
// the runtime or GPU has no ragged support, where an id comes back after another in the same row,
// and, for backward, in deterministic mode (the flash kernel is deterministic and needs no
// n·Hq·S² workspace). The run table is read to the host once per seg storage and kept: segment
// ids must not be rewritten in place.
bool forward_packed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                    Tensor& out, Tensor& lse, std::string* why);
bool backward_packed(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& seg, const Tensor& out, const Tensor& lse, Tensor& dq,
                     Tensor& dk, Tensor& dv, bool deterministic, std::string* why);

}  // namespace rig::ops::cuda::sdpa_cudnn
