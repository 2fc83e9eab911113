#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace rig {

// NF4 is packed 4-bit: two values a byte; its element size is reported as 0 and handled by nbytes().
enum class DType : uint8_t { F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, NF4 };

size_t dtype_size(DType t);             // bytes per element (0 for NF4)
size_t dtype_nbytes(DType t, int64_t numel);
std::string_view dtype_name(DType t);   // safetensors spelling: "F32", "BF16", ...
bool dtype_from_name(std::string_view name, DType* out);

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Converts n elements of a floating or integer dtype to float32.
void convert_to_f32(DType src, const void* in, float* out, size_t n);
// Converts n float32 values into a floating dtype.
void convert_from_f32(DType dst, const float* in, void* out, size_t n);

}  // namespace rig
