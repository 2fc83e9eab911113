// Random 4-bit weights drawn straight as codes, for random models (benchmarks, memory runs):
// uniform NF4/FP4 indices (NF4's levels are quantiles of a normal, so the weights come out
// close to normal) and block scales near those of normal(0, 0.02) blocks of 64. Every stored
// byte is a function of (seed, tensor, position) alone, so a sharded rank draws just its own
// byte range, and no float copy of the weight is ever made (a 70B model starts in seconds).
#pragma once
#include <cstdint>
#include <vector>

#include "rig/quant/nf4.h"

namespace rig::quant {

// One stored tensor of a 4-bit weight, from its scalars alone (the tensor may be undefined).
struct StoredTensor {
  Tensor QuantizedWeight::*field;
  Shape shape;
  DType dtype;
  size_t nbytes() const { return dtype_nbytes(dtype, shape_numel(shape)); }
};
// packed, absmax, quant_map and, with double quantization, nested_absmax and nested_quant_map.
std::vector<StoredTensor> stored_tensors(const QuantizedWeight& q);

// A 4-bit weight of `shape` with its scalars set (nested_offset included) and no tensors yet.
QuantizedWeight drawn_4bit_skeleton(const Shape& shape, QuantType type, int64_t blocksize,
                                    bool double_quant);
// Bytes [begin, end) of `field`'s tensor of the drawn weight (`seed` names the tensor).
void draw_4bit_bytes(const QuantizedWeight& q, uint64_t seed, Tensor QuantizedWeight::*field,
                     int64_t begin, int64_t end, uint8_t* out);
// Every tensor of the drawn weight, on the CPU.
void draw_4bit(QuantizedWeight& q, uint64_t seed);

}  // namespace rig::quant
