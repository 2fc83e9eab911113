// Small UTF-8 helpers used by the tokenizer (decoding one code point, encoding one).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace rig::utf8 {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid there.
inline int seq_len(std::string_view s, size_t i) {
  auto b = [&](size_t k) { return uint8_t(s[k]); };
  uint8_t c = b(i);
  size_t n = s.size();
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return (i + 1 < n && (b(i + 1) & 0xC0) == 0x80) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (i + 2 >= n) return 0;
    uint8_t c1 = b(i + 1);
    if (c == 0xE0 && c1 < 0xA0) return 0;
    if (c == 0xED && c1 > 0x9F) return 0;  // surrogates
    return ((c1 & 0xC0) == 0x80 && (b(i + 2) & 0xC0) == 0x80) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (i + 3 >= n) return 0;
    uint8_t c1 = b(i + 1);
    if (c == 0xF0 && c1 < 0x90) return 0;
    if (c == 0xF4 && c1 > 0x8F) return 0;
    return ((c1 & 0xC0) == 0x80 && (b(i + 2) & 0xC0) == 0x80 && (b(i + 3) & 0xC0) == 0x80) ? 4
                                                                                          : 0;
  }
  return 0;
}

// Code point of a valid sequence of length len at s[i].
inline char32_t decode_at(std::string_view s, size_t i, int len) {
  auto b = [&](size_t k) { return char32_t(uint8_t(s[k])); };
  switch (len) {
    case 1: return b(i);
    case 2: return ((b(i) & 0x1F) << 6) | (b(i + 1) & 0x3F);
    case 3: return ((b(i) & 0x0F) << 12) | ((b(i + 1) & 0x3F) << 6) | (b(i + 2) & 0x3F);
    default:
      return ((b(i) & 0x07) << 18) | ((b(i + 1) & 0x3F) << 12) | ((b(i + 2) & 0x3F) << 6) |
             (b(i + 3) & 0x3F);
  }
}

inline void append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

inline std::string encode(char32_t c) {
  std::string s;
  append(s, c);
  return s;
}

}  // namespace rig::utf8
