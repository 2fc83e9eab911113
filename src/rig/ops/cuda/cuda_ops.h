// CUDA implementations behind ops.h: one function per row of op_table.inc (as cpu_ops.h), and
// the CUDA-only controls below.
//
// Dtype rules (every tensor contiguous and on one CUDA device):
//  - Activations and their gradients may be F32 or BF16: gemm A/B/C, add_bias y, embedding out and
//    dout, rmsnorm x/y/dy/dx, rope x, attention q/k/v/out/dout/dq/dk/dv (one dtype for all of
//    them), attention_decode q/k_cache/v_cache/out (one dtype), swiglu g/u/a/da/dg/du (one
//    dtype), cross_entropy logits/dlogits (one dtype), add_ a/b, scale_, sum_squares, dropout
//    x/out. Math is float32 everywhere; BF16 is rounded on store.
//  - gemm: A and B share a dtype; F32 A/B need F32 C (computed in true fp32, CUBLAS_COMPUTE_32F,
//    no TF32); BF16 A/B may write BF16 or F32 C. beta=1 accumulates into C (the dW += case).
//  - Parameters and their gradients: rmsnorm w/dw, bias/dbias, embedding table/dtable F32 or BF16
//    (F32 recommended for gradients: the reductions accumulate in float32 and round once).
//  - Reduction outputs are F32: rmsnorm rstd [rows], attention lse [B,Hq,T].
//  - rope cos/sin tables F32 or BF16; pos, ids, targets, seg I64; argmax x F32 or BF16, out I64.
//  - adamw_step(_list): param and grad F32 or BF16, m and v F32; the list's copies BF16.
// dropout draws its mask from a counter-based hash of (seed, element index), so it is
// deterministic and independent of the launch shape, but it differs from the CPU backend's
// sequential mt19937 mask for the same seed.
#pragma once
#include <string>

#include "rig/ops/ops.h"

namespace rig::quant {
struct QuantizedWeight;
}

namespace rig::ops::cuda {
#define RIG_OP(ret, name, category, device_of, params, args) ret name params;
#define RIG_OP_CUSTOM(ret, name, params) ret name params;
#define RIG_BACKEND(ret, name, params) ret name params;
#include "rig/ops/op_table.inc"

// How many gemm_bias calls found no bias-epilogue algorithm and ran gemm + add_bias instead.
int64_t gemm_bias_fallbacks();
// Attention implementation: "auto" (default, or the RIG_ATTENTION environment variable): cuDNN's
// fused SDPA where it supports the call (bf16; packed segments with head_dim 96 and up as ragged
// batches on cuDNN >= 9.6 with sm_90, >= 9.18.1 with sm_8x), else rig's tensor-core flash kernel
// (bf16, head_dim 64/80/96/128, packed segments), else the fp32 reference kernel.
// "cudnn", "flash" or "reference" force one (an error where it cannot run).
void set_attention_impl(const std::string& impl);
const std::string& attention_impl();
// The implementation the last attention_forward (backward = false) or _backward call ran.
const std::string& last_attention_impl(bool backward);
// Bitwise-repeatable kernels where a faster nondeterministic one exists (cuDNN's backward), and
// the same cuBLASLt algorithm in every process (no autotuning by timing).
void set_deterministic(bool on);
bool deterministic();
// out (F32 or BF16, q's element count, on q's device) = the 4-bit weight decoded: double-quantized
// absmax inline, f32(code[nibble] * absmax) rounded to q.dtype, then stored in out's dtype.
void dequantize_4bit(const quant::QuantizedWeight& q, Tensor& out);
}  // namespace rig::ops::cuda
