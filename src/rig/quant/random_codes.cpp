#include "rig/quant/random_codes.h"

#include <algorithm>
#include <cstring>

namespace rig::quant {

namespace {

// Block scales: kScale + kSpread * u with u in [-1, 1]. E max|x| over 64 draws of normal(0, 0.02)
// is about 0.048.
constexpr float kScale = 0.048f, kSpread = 0.008f;

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Eight random bytes per (seed, stream, word).
uint64_t word(uint64_t seed, uint64_t stream, uint64_t i) {
  return splitmix(splitmix(seed ^ (stream * 0xD1B54A32D192ED03ull)) + i);
}

// Random bytes [begin, end) of stream `stream`.
void random_bytes(uint64_t seed, uint64_t stream, int64_t begin, int64_t end, uint8_t* out) {
  const int64_t w0 = begin / 8, w1 = (end + 7) / 8;
#pragma omp parallel for schedule(static) if (w1 - w0 > (1 << 16))
  for (int64_t w = w0; w < w1; ++w) {
    const uint64_t v = word(seed, stream, uint64_t(w));
    for (int64_t b = 0; b < 8; ++b) {
      const int64_t i = w * 8 + b;
      if (i >= begin && i < end) out[i - begin] = uint8_t(v >> (8 * b));
    }
  }
}

// The whole (small) tensor as bytes, then the range.
void copy_range(const std::vector<float>& v, int64_t begin, int64_t end, uint8_t* out) {
  std::memcpy(out, reinterpret_cast<const uint8_t*>(v.data()) + begin, size_t(end - begin));
}

}  // namespace

std::vector<StoredTensor> stored_tensors(const QuantizedWeight& q) {
  const int64_t nb = q.n_blocks();
  std::vector<StoredTensor> out = {
      {&QuantizedWeight::packed, {(q.numel() + 1) / 2, 1}, DType::U8},
      {&QuantizedWeight::absmax, {nb}, q.nested ? DType::U8 : DType::F32},
      {&QuantizedWeight::quant_map, {16}, DType::F32},
  };
  if (q.nested) {
    out.push_back({&QuantizedWeight::nested_absmax,
                   {(nb + q.nested_blocksize - 1) / q.nested_blocksize},
                   DType::F32});
    out.push_back({&QuantizedWeight::nested_quant_map, {256}, DType::F32});
  }
  return out;
}

QuantizedWeight drawn_4bit_skeleton(const Shape& shape, QuantType type, int64_t blocksize,
                                    bool double_quant) {
  QuantizedWeight q;
  q.type = type;
  q.blocksize = blocksize;
  q.dtype = DType::BF16;
  q.shape = shape;
  q.nested = double_quant;
  q.nested_offset = double_quant ? kScale : 0.0f;
  return q;
}

void draw_4bit_bytes(const QuantizedWeight& q, uint64_t seed, Tensor QuantizedWeight::*field,
                     int64_t begin, int64_t end, uint8_t* out) {
  if (begin >= end) return;
  if (field == &QuantizedWeight::packed) return random_bytes(seed, 0, begin, end, out);
  if (field == &QuantizedWeight::absmax) {
    // Double quantization: codes of the signed dynamic map, scaled by nested_absmax = kSpread
    // around the offset kScale. Without it: float32 scales in the same range.
    if (q.nested) return random_bytes(seed, 1, begin, end, out);
    const int64_t e0 = begin / 4, e1 = (end + 3) / 4;
    std::vector<float> v(size_t(e1 - e0));
    std::vector<uint8_t> r(size_t(e1 - e0) * 4);
    random_bytes(seed, 1, e0 * 4, e1 * 4, r.data());
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &r[i * 4], 4);
      v[i] = kScale + kSpread * (float(u >> 8) / float(1 << 23) - 1.0f);
    }
    std::memcpy(out, reinterpret_cast<uint8_t*>(v.data()) + (begin - e0 * 4),
                size_t(end - begin));
    return;
  }
  if (field == &QuantizedWeight::quant_map) {
    const auto& c = code_table(q.type);
    return copy_range(std::vector<float>(c.begin(), c.end()), begin, end, out);
  }
  if (field == &QuantizedWeight::nested_absmax) {
    const int64_t n = (q.n_blocks() + q.nested_blocksize - 1) / q.nested_blocksize;
    return copy_range(std::vector<float>(size_t(n), kSpread), begin, end, out);
  }
  if (field == &QuantizedWeight::nested_quant_map)
    return copy_range(create_dynamic_map(true), begin, end, out);
  fail("draw_4bit_bytes: not a stored tensor of a 4-bit weight");
}

void draw_4bit(QuantizedWeight& q, uint64_t seed) {
  for (const auto& st : stored_tensors(q)) {
    Tensor t = Tensor::empty(st.shape, st.dtype, Device::cpu(), "4-bit weight");
    draw_4bit_bytes(q, seed, st.field, 0, int64_t(st.nbytes()), static_cast<uint8_t*>(t.raw()));
    q.*st.field = t;
  }
}

}  // namespace rig::quant
