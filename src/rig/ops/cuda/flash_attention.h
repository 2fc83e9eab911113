// rig's own tensor-core attention (FlashAttention-2 tiling, mma.sync bf16 -> fp32), causal, grouped
// kv heads, packed segments (flash_fwd.cu, flash_bwd.cu). Plain C++ like launch.h: the host
// wrappers in attention_ops_cuda.cpp call it.
//
// Workspace (caller allocates flash_*_workspace bytes, 256-byte aligned; may be nullptr when the
// size is 0), each part starting on a 256-byte boundary, no contents expected on entry:
//   bwd only:  delta  float [B, Hq, T]   rowsum(dout * out)
//   with seg:  first  int32 [B, T]       first position of the row with the same id as t
//              last   int32 [B, T]       last position of t's segment (T-1 when the row's ids
//                                        ever decrease)
//              tiles  int4 [B, cap]      the blocks' tiles, longest first, and their count [B]
//                                        (forward: one list; backward: dQ's and dK/dV's)
// The backward is deterministic (no atomics): bitwise the same run to run.
#pragma once
#include "rig/ops/cuda/launch.h"

namespace rig::ops::cuda::k {

// Head dims the tensor-core kernel compiles for (64, 80, 96, 128).
bool flash_supports(int head_dim);
// Bytes of device scratch flash_fwd / flash_bwd need (caller allocates, 256-byte aligned).
size_t flash_fwd_workspace(AttnDims d, bool has_seg);
size_t flash_bwd_workspace(AttnDims d, bool has_seg);
// q/out [B,T,Hq,D], k/v [B,T,Hk,D], contiguous bf16 (__nv_bfloat16 passed as void*); lse [B,Hq,T]
// fp32 out. seg [B,T] int64 or nullptr. Query i sees key j iff j <= i and (no seg or
// seg[b,j] == seg[b,i]). scale = 1/sqrt(D).
cudaError_t flash_fwd(const void* q, const void* k, const void* v, const int64_t* seg, void* out,
                      float* lse, AttnDims d, void* workspace, cudaStream_t s);
// dout/dq [B,T,Hq,D], dk/dv [B,T,Hk,D] bf16; lse from flash_fwd (or any correct fp32 natural-log
// LSE of the scaled scores).
cudaError_t flash_bwd(const void* dout, const void* q, const void* k, const void* v,
                      const int64_t* seg, const void* out, const float* lse, void* dq, void* dk,
                      void* dv, AttnDims d, void* workspace, cudaStream_t s);

}  // namespace rig::ops::cuda::k
