// bitsandbytes 4-bit weights (NF4/FP4, optionally double-quantized scales) decoded into F32 or
// BF16 in one pass, for the product that reads the weight next.
//
// Bit for bit what the CPU oracle (rig/quant/nf4.cpp) and bitsandbytes compute: the block scale
// is f32(f32(nested_map[q] * nested_absmax[b / 256]) + offset) and the weight f32(code * scale),
// each with its own rounding (__fmul_rn / __fadd_rn: nvcc would otherwise fuse them into an FMA),
// then rounded to the original weight dtype and stored in the output's.
#include <cuda_fp16.h>

#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

constexpr int kThreads = 256;
// Weights per thread on the vector path: 16 packed bytes, one 16-byte load.
constexpr int kPerThread = 32;

__device__ __forceinline__ float block_scale(const Nf4Args& a, const float* nmap, int64_t blk) {
  if (!a.nested) return static_cast<const float*>(a.absmax)[blk];
  const uint8_t q = static_cast<const uint8_t*>(a.absmax)[blk];
  return __fadd_rn(__fmul_rn(nmap[q], a.nested_absmax[blk / a.nested_blocksize]), a.offset);
}

__device__ __forceinline__ float round_to(float v, int dt) {
  if (dt == 1) return __bfloat162float(__float2bfloat16_rn(v));
  if (dt == 2) return __half2float(__float2half_rn(v));
  return v;
}

// The tables every block reads, in shared memory.
struct Tables {
  float code[16];
  float nmap[256];
};

__device__ __forceinline__ void load_tables(const Nf4Args& a, Tables& t) {
  for (int i = threadIdx.x; i < 16; i += blockDim.x) t.code[i] = a.code[i];
  if (a.nested)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) t.nmap[i] = a.nested_map[i];
  __syncthreads();
}

__device__ __forceinline__ uint32_t bf16_bits(float v) {
  return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}

// 32 weights a thread: blocksize a multiple of 32, n a multiple of 32, 16-byte aligned buffers.
// A thread's weights share one block scale.
template <typename E>
__global__ void dequant_vec_kernel(Nf4Args a, E* out) {
  __shared__ Tables t;
  load_tables(a, t);
  const int64_t chunks = a.n / kPerThread;
  const uint4* src = reinterpret_cast<const uint4*>(a.packed);
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < chunks;
       c += int64_t(gridDim.x) * blockDim.x) {
    const uint4 raw = src[c];
    const float scale = block_scale(a, t.nmap, c * kPerThread / a.blocksize);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float v[kPerThread];
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t byte = (words[w] >> (8 * b)) & 0xffu;  // little-endian: lowest address first
        v[8 * w + 2 * b] = round_to(__fmul_rn(t.code[byte >> 4], scale), a.round_to);
        v[8 * w + 2 * b + 1] = round_to(__fmul_rn(t.code[byte & 15u], scale), a.round_to);
      }
    if constexpr (sizeof(E) == 2) {
      uint4* dst = reinterpret_cast<uint4*>(out + c * kPerThread);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint4 o;
        o.x = bf16_bits(v[8 * s + 0]) | bf16_bits(v[8 * s + 1]) << 16;
        o.y = bf16_bits(v[8 * s + 2]) | bf16_bits(v[8 * s + 3]) << 16;
        o.z = bf16_bits(v[8 * s + 4]) | bf16_bits(v[8 * s + 5]) << 16;
        o.w = bf16_bits(v[8 * s + 6]) | bf16_bits(v[8 * s + 7]) << 16;
        dst[s] = o;
      }
    } else {
      float4* dst = reinterpret_cast<float4*>(out + c * kPerThread);
#pragma unroll
      for (int s = 0; s < 8; ++s)
        dst[s] = make_float4(v[4 * s], v[4 * s + 1], v[4 * s + 2], v[4 * s + 3]);
    }
  }
}

// Any layout (odd sizes, partial blocks, small blocksizes): one weight a thread.
template <typename E>
__global__ void dequant_scalar_kernel(Nf4Args a, E* out) {
  __shared__ Tables t;
  load_tables(a, t);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < a.n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t byte = a.packed[i >> 1];
    const float scale = block_scale(a, t.nmap, i / a.blocksize);
    st(out, i, round_to(__fmul_rn(t.code[(i & 1) ? (byte & 15) : (byte >> 4)], scale), a.round_to));
  }
}

}  // namespace

cudaError_t dequantize_4bit(const Nf4Args& a, T tout, void* out, cudaStream_t s) {
  if (a.n == 0) return cudaSuccess;
  const bool aligned =
      reinterpret_cast<uintptr_t>(a.packed) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const bool vec = aligned && a.n % kPerThread == 0 && a.blocksize % kPerThread == 0;
  if (vec) {
    const int64_t chunks = a.n / kPerThread;
    RIG_K_DISPATCH(tout, E,
                   (dequant_vec_kernel<E>
                    <<<grid_for(chunks, kThreads), kThreads, 0, s>>>(a, static_cast<E*>(out))));
  } else {
    RIG_K_DISPATCH(tout, E,
                   (dequant_scalar_kernel<E>
                    <<<grid_for(a.n, kThreads), kThreads, 0, s>>>(a, static_cast<E*>(out))));
  }
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
