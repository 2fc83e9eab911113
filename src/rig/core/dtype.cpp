#include "rig/core/dtype.h"

#include <array>

#include "rig/core/error.h"

namespace rig {

namespace {
struct Info {
  DType t;
  std::string_view name;
  size_t size;
};
constexpr std::array<Info, 11> kInfo{{{DType::F32, "F32", 4},
                                      {DType::F16, "F16", 2},
                                      {DType::BF16, "BF16", 2},
                                      {DType::F64, "F64", 8},
                                      {DType::I64, "I64", 8},
                                      {DType::I32, "I32", 4},
                                      {DType::I16, "I16", 2},
                                      {DType::I8, "I8", 1},
                                      {DType::U8, "U8", 1},
                                      {DType::BOOL, "BOOL", 1},
                                      {DType::NF4, "NF4", 0}}};
}  // namespace

size_t dtype_size(DType t) { return kInfo[size_t(t)].size; }
std::string_view dtype_name(DType t) { return kInfo[size_t(t)].name; }

size_t dtype_nbytes(DType t, int64_t numel) {
  if (t == DType::NF4) return size_t(numel + 1) / 2;
  return dtype_size(t) * size_t(numel);
}

bool dtype_from_name(std::string_view name, DType* out) {
  for (const auto& i : kInfo) {
    if (i.name == name) {
      *out = i.t;
      return true;
    }
  }
  return false;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  int32_t exp = int32_t((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 31) return uint16_t(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return uint16_t(sign);
    man |= 0x800000;
    uint32_t shift = uint32_t(14 - exp);
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = sign | uint32_t(exp) << 10 | man >> 13;
  uint32_t rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return uint16_t(half);
}

void convert_to_f32(DType src, const void* in, float* out, size_t n) {
  switch (src) {
    case DType::F32: std::memcpy(out, in, n * 4); return;
    case DType::BF16: {
      auto* p = static_cast<const uint16_t*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
      return;
    }
    case DType::F16: {
      auto* p = static_cast<const uint16_t*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(p[i]);
      return;
    }
    case DType::F64: {
      auto* p = static_cast<const double*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = float(p[i]);
      return;
    }
    case DType::I64: {
      auto* p = static_cast<const int64_t*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = float(p[i]);
      return;
    }
    case DType::I32: {
      auto* p = static_cast<const int32_t*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = float(p[i]);
      return;
    }
    case DType::U8:
    case DType::BOOL: {
      auto* p = static_cast<const uint8_t*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = float(p[i]);
      return;
    }
    default: fail("cannot convert {} to F32", dtype_name(src));
  }
}

void convert_from_f32(DType dst, const float* in, void* out, size_t n) {
  switch (dst) {
    case DType::F32: std::memcpy(out, in, n * 4); return;
    case DType::BF16: {
      auto* p = static_cast<uint16_t*>(out);
      for (size_t i = 0; i < n; ++i) p[i] = f32_to_bf16(in[i]);
      return;
    }
    case DType::F16: {
      auto* p = static_cast<uint16_t*>(out);
      for (size_t i = 0; i < n; ++i) p[i] = f32_to_f16(in[i]);
      return;
    }
    case DType::F64: {
      auto* p = static_cast<double*>(out);
      for (size_t i = 0; i < n; ++i) p[i] = in[i];
      return;
    }
    default: fail("cannot convert F32 to {}", dtype_name(dst));
  }
}

}  // namespace rig
