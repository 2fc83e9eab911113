// The launchers of generation's kernels (attention_decode.cu: the key/value-cache attention and
// the greedy argmax), called by their host wrappers (decode_cuda.cpp); plain C++ like launch.h, so
// nvcc never sees fmt.
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

// out[r] = the first index of the largest non-NaN value among x[r, 0..limit) (0 when none), x
// [rows, V] of element type t; one block per row.
cudaError_t argmax_rows(T t, const void* x, int64_t rows, int64_t V, int64_t limit, int64_t* out,
                        cudaStream_t s);

}  // namespace rig::ops::cuda::k
