// The plain C++ interface between the host wrappers (ops_cuda.cpp, compiled by the host compiler,
// where tensors, fmt and error messages live) and the kernels (*.cu, compiled by nvcc and kept
// free of fmt, which nvcc's C++20 mode cannot parse). Every launcher takes the stream explicitly
// and returns the launch status; the wrappers check it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace rig::ops::cuda::k {

// Element types the kernels know; activations are one of these.
enum class T : int { F32 = 0, BF16 = 1 };

// A record a kernel fills when it finds bad input (an id outside the vocabulary, a position outside
// the rope table); the host reads it at the next synchronising op. code 0: no error.
struct DeviceError {
  int code;
  int pad;
  long long where, value, limit;
};
enum ErrorCode : int { kNoError = 0, kBadTokenId = 1, kBadRopePos = 2, kBadLabel = 3 };

// ---- elementwise.cu
cudaError_t add(T ta, void* a, T tb, const void* b, float alpha, int64_t n, cudaStream_t s);
cudaError_t scale(T ta, void* a, float sc, int64_t n, cudaStream_t s);
cudaError_t cast(T tsrc, const void* src, T tdst, void* dst, int64_t n, cudaStream_t s);
// Writes per-block partial sums (double) into `partial` [blocks]; `blocks` <= 1024.
cudaError_t sum_squares_partial(T ta, const void* a, int64_t n, double* partial, int blocks,
                                cudaStream_t s);
cudaError_t sum_doubles(const double* partial, int n, double* out, cudaStream_t s);
// The same for up to kSumSqSlotsPerLaunch tensors in two launches: slot j's partials follow slot
// j-1's in `partial` (`blocks` each, <= 1024), and sums[j] receives its total; the values equal
// sum_squares_partial + sum_doubles on each tensor alone.
struct SumSqSlot {
  const void* a;
  int64_t n;
  T t;
  int blocks;
};
constexpr int kSumSqSlotsPerLaunch = 64;
cudaError_t sum_squares_multi(const SumSqSlot* slots, int count, double* partial, double* sums,
                              cudaStream_t s);
cudaError_t dropout(T tx, const void* x, T to, void* out, float p, uint64_t seed, int64_t n,
                    cudaStream_t s);
cudaError_t swiglu_fwd(T t, const void* g, const void* u, void* a, int64_t n, cudaStream_t s);
cudaError_t swiglu_bwd(T t, const void* da, const void* g, const void* u, void* dg, void* du,
                       int64_t n, cudaStream_t s);

// ---- guard.cu (one device counter for a whole list: the caller zeroes it, reads it once)
// Adds to *count the elements that are NaN, Inf, or above max_abs in magnitude (max_abs > 0).
cudaError_t count_bad(T ta, const void* a, int64_t n, float max_abs, unsigned long long* count,
                      cudaStream_t s);
// Adds the hash contributions (ops/guard_hash.h) of `bytes` bytes at p, the index_in_list-th
// tensor of the list, to *sum (modulo 2^64).
cudaError_t hash_bytes(const void* p, int64_t bytes, uint64_t index_in_list,
                       unsigned long long* sum, cudaStream_t s);

// ---- adamw.cu (m, v float32)
cudaError_t adamw(T tp, void* p, T tg, const void* g, float* m, float* v, int64_t n, float decay,
                  float w1, float beta2, float w2, float bc2_sqrt, float eps, float step_size,
                  cudaStream_t s);
// Many tensors in one launch (kernel parameters, no table to copy): gradients are read as
// g * grad_scale; `copy` (BF16, may be null) receives the updated parameter.
struct AdamWSlot {
  void* p;
  const void* g;
  float* m;
  float* v;
  void* copy;
  int64_t n;
  float decay;
  T tp, tg;
};
constexpr int kAdamWSlotsPerLaunch = 40;
cudaError_t adamw_list(const AdamWSlot* slots, int count, float grad_scale, float w1, float beta2,
                       float w2, float bc2_sqrt, float eps, float step_size, cudaStream_t s);

// ---- embedding.cu
cudaError_t embedding_fwd(const int64_t* ids, int64_t rows, T tt, const void* table, int64_t vocab,
                          int64_t h, T to, void* out, DeviceError* err, cudaStream_t s);
// Deterministic: the rows are sorted by id (a stable radix sort, so rows of one id keep their
// order), each id's rows are summed in that order and added to its table row once. scratch holds
// embedding_bwd_scratch_bytes(rows) bytes.
size_t embedding_bwd_scratch_bytes(int64_t rows);
cudaError_t embedding_bwd(const int64_t* ids, int64_t rows, T td, const void* dout, T tt,
                          void* dtable, int64_t vocab, int64_t h, void* scratch, cudaStream_t s);

// ---- norm.cu (rstd float32; w and the parameter gradients dw/dbias F32 or BF16)
cudaError_t rmsnorm_fwd(T tx, const void* x, T tw, const void* w, float eps, T ty, void* y,
                        float* rstd, int64_t rows, int64_t h, cudaStream_t s);
// dx written; dw += via `partial` scratch [chunks, h] float32, chunks = colsum_chunks(rows).
cudaError_t rmsnorm_bwd(T tdy, const void* dy, T tx, const void* x, T tw, const void* w,
                        const float* rstd, T tdx, void* dx, T tdw, void* dw, float* partial,
                        int64_t rows, int64_t h, cudaStream_t s);
// dh (float32) += dx; copy (null, or [rows, h] in tc) receives the new dh; dw += when not null.
cudaError_t rmsnorm_bwd_add(T tdy, const void* dy, T tx, const void* x, T tw, const void* w,
                            const float* rstd, float* dh, T tc, void* copy, T tdw, void* dw,
                            float* partial, int64_t rows, int64_t h, cudaStream_t s);
cudaError_t add_bias(T ty, void* y, T tb, const void* b, int64_t rows, int64_t n, cudaStream_t s);
cudaError_t bias_bwd(T tdy, const void* dy, T tdb, void* db, float* partial, int64_t rows,
                     int64_t n, cudaStream_t s);
int colsum_chunks(int64_t rows);

// ---- rope.cu (cos/sin tables F32 or BF16, read as float)
cudaError_t rope(T tx, void* x, const int64_t* pos, int64_t rows, int heads, int64_t head_dim,
                 T ttab, const void* cos, const void* sin, int64_t positions, bool backward,
                 DeviceError* err, cudaStream_t s);

// ---- attention.cu (q/k/v/out/dout/dq/dk/dv one dtype t; lse and the delta scratch float32)
struct AttnDims {
  int B, T, Hq, Hk, D;
};
cudaError_t attention_fwd(T t, const void* q, const void* k, const void* v, const int64_t* seg,
                          void* out, float* lse, AttnDims d, cudaStream_t s);
cudaError_t attention_bwd(T t, const void* dout, const void* q, const void* k, const void* v,
                          const int64_t* seg, const void* out, const float* lse, float* delta,
                          void* dq, void* dk, void* dv, AttnDims d, cudaStream_t s);
int attention_max_head_dim();
// lse [B,H,T] <-> per-token rows [B*T,H] (cuDNN's layout for packed rows); to_tokens picks the
// direction.
cudaError_t lse_layout(const float* src, float* dst, int B, int T, int H, bool to_tokens,
                       cudaStream_t s);

// ---- cross_entropy.cu (dlogits may alias logits or have its own dtype td)
// row_loss [rows] float32; a label outside [0, V) other than -100 is recorded in err.
cudaError_t cross_entropy(T t, const void* logits, const int64_t* targets, int64_t rows, int64_t V,
                          float grad_scale, T td, void* dlogits, float* row_loss, DeviceError* err,
                          cudaStream_t s);
// The loss over column slices: stats [rows, 3] float32 (running max, sum, target's logit).
cudaError_t cross_entropy_slice(T t, const void* logits, const int64_t* targets, int64_t rows,
                                int64_t Vc, int64_t v0, float* stats, cudaStream_t s);
cudaError_t cross_entropy_finish(float* stats, const int64_t* targets, int64_t rows, int64_t V,
                                 float* row_loss, DeviceError* err, cudaStream_t s);
cudaError_t cross_entropy_slice_backward(T t, void* logits, const int64_t* targets, int64_t rows,
                                         int64_t Vc, int64_t v0, const float* stats,
                                         float grad_scale, cudaStream_t s);

// ---- nf4.cu (bitsandbytes 4-bit weights: packed nibbles, element 2i in the high nibble)
struct Nf4Args {
  const uint8_t* packed;       // (n + 1) / 2 bytes
  const void* absmax;          // nested: U8 codes [n_blocks]; otherwise F32 [n_blocks]
  const float* nested_absmax;  // nested: [ceil(n_blocks / nested_blocksize)]
  const float* nested_map;     // nested: the 256-value dynamic code
  const float* code;           // the 16-value NF4/FP4 code
  float offset;                // nested: added after the nested dequantization
  int64_t n, blocksize, nested_blocksize;
  int nested;    // 0 or 1
  int round_to;  // the original weight dtype the value is rounded to first: 0 F32, 1 BF16, 2 F16
};
// out[i] = round(f32(code[nibble i] * absmax[i / blocksize])) in `tout`. One pass: 16-byte loads
// of packed data (32 weights a thread) when the layout allows, else one weight a thread.
cudaError_t dequantize_4bit(const Nf4Args& a, T tout, void* out, cudaStream_t s);

}  // namespace rig::ops::cuda::k
