// The 64-bit parameter hash of ops::hash64, shared by the CPU twin (ops/cpu/guard.cpp) and the
// CUDA kernel (ops/cuda/guard.cu) so both give the same value for the same bytes.
//
// A tensor's bytes are read as little-endian 32-bit words w_i (the last one zero-padded). Word i
// of the t-th tensor of the list contributes mix64(((i << 32) | w_i) + (i >> 32) * K ^ base_t),
// base_t = mix64(t + C), and the hash is the sum of every contribution modulo 2^64. The sum is
// associative and commutative, so any split over threads or blocks gives the same value; for a
// fixed position the map from word to contribution is a bijection, so changing any one word (a
// flipped bit) always changes the hash, and changing several leaves it equal with probability
// about 2^-64.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define RIG_HASH_FN __host__ __device__ __forceinline__
#else
#define RIG_HASH_FN inline
#endif

namespace rig::ops::hash {

RIG_HASH_FN uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

RIG_HASH_FN uint64_t tensor_base(uint64_t index_in_list) {
  return mix64(index_in_list + 0x5851f42d4c957f2dULL);
}

RIG_HASH_FN uint64_t word_term(uint64_t base, uint64_t i, uint32_t w) {
  const uint64_t key = ((i << 32) | uint64_t(w)) + (i >> 32) * 0xd6e8feb86659fd93ULL;
  return mix64(key ^ base);
}

}  // namespace rig::ops::hash
