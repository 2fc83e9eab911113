// The launcher of the key/value-cache attention kernel (attention_decode.cu), called by its host
// wrapper (decode_cuda.cpp); plain C++ like launch.h, so nvcc never sees fmt.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "rig/ops/cuda/launch.h"

namespace rig::ops::cuda::k {

// q/out [n,Hq,D], caches [max_len,Hk,D], all of element type t; row r reads cache rows
// 0..past+r. D <= attention_decode_max_head_dim().
struct DecodeDims {
  int64_t n, past;
  int Hq, Hk, D;
};
cudaError_t attention_decode_fwd(T t, const void* q, const void* k_cache, const void* v_cache,
                                 void* out, DecodeDims d, cudaStream_t s);
int attention_decode_max_head_dim();

}  // namespace rig::ops::cuda::k
