// Helpers shared by the tokenizer stages: UTF-8 checks, the GPT-2 byte table, Oniguruma-compatible
// regexes and "pattern" fields, and tokenizer.json field readers.
#include <algorithm>

#include "rig/text/tokenizer_internal.h"

namespace rig {

// ---------------------------------------------------------------------------------------------
// UTF-8 utilities

bool utf8_valid(std::string_view s, size_t* bad_offset) {
  size_t i = 0;
  while (i < s.size()) {
    if (uint8_t(s[i]) < 0x80) {
      ++i;
      continue;
    }
    int n = utf8::seq_len(s, i);
    if (n == 0) {
      if (bad_offset) *bad_offset = i;
      return false;
    }
    i += size_t(n);
  }
  return true;
}

// Bytes to replace by one U+FFFD at an invalid position (Rust's Utf8Chunks rules).
static size_t invalid_run(std::string_view s, size_t i) {
  auto at = [&](size_t k) -> int { return k < s.size() ? uint8_t(s[k]) : -1; };
  auto cont = [&](size_t k) {
    int b = at(k);
    return b >= 0x80 && b <= 0xBF;
  };
  int c = at(i), c1 = at(i + 1);
  if (c >= 0xC2 && c <= 0xDF) return 1;
  if (c >= 0xE0 && c <= 0xEF) {
    bool ok = (c == 0xE0 && c1 >= 0xA0 && c1 <= 0xBF) || (c >= 0xE1 && c <= 0xEC && cont(i + 1)) ||
              (c == 0xED && c1 >= 0x80 && c1 <= 0x9F) || (c >= 0xEE && cont(i + 1));
    if (!ok) return 1;
    return 2;  // the third byte is the bad one
  }
  if (c >= 0xF0 && c <= 0xF4) {
    bool ok = (c == 0xF0 && c1 >= 0x90 && c1 <= 0xBF) || (c >= 0xF1 && c <= 0xF3 && cont(i + 1)) ||
              (c == 0xF4 && c1 >= 0x80 && c1 <= 0x8F);
    if (!ok) return 1;
    if (!cont(i + 2)) return 2;
    return 3;
  }
  return 1;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    int n = uint8_t(s[i]) < 0x80 ? 1 : utf8::seq_len(s, i);
    if (n > 0) {
      out.append(s.data() + i, size_t(n));
      i += size_t(n);
    } else {
      out += "\xEF\xBF\xBD";
      i += invalid_run(s, i);
    }
  }
  return out;
}

namespace tok {

// ---------------------------------------------------------------------------------------------
// GPT-2 byte <-> unicode table (ByteLevel)

ByteTable::ByteTable() {
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    byte_to_char[b] = printable ? char32_t(b) : char32_t(256 + n++);
    byte_to_str[b] = utf8::encode(byte_to_char[b]);
    char_to_byte[byte_to_char[b]] = uint8_t(b);
  }
}

const ByteTable& bytes() {
  static const ByteTable t;
  return t;
}

// ---------------------------------------------------------------------------------------------
// Regexes and patterns

namespace {

// HF compiles these patterns with Oniguruma, whose \s is Unicode White_Space. PCRE2's \s also
// takes U+180E (and its \S leaves it out), so \s and \S are spelled out as that set.
const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

std::string onig_compatible(const std::string& pat) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pat.size(); ++i) {
    char c = pat[i];
    if (c == '\\' && i + 1 < pat.size()) {
      char n = pat[i + 1];
      if (n == 's' || (n == 'S' && !in_class)) {
        if (!in_class) out += n == 's' ? "[" : "[^";
        out.append(kWhiteSpace);
        if (!in_class) out += ']';
      } else {
        out.append(pat, i, 2);
      }  // \S inside a class stays PCRE2's (not used by known files)
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < pat.size() && pat[i + 1] == '^') out += pat[++i];
      if (i + 1 < pat.size() && pat[i + 1] == ']') out += pat[++i];  // literal ] first
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& pattern_in, const std::string& where) {
  int err;
  PCRE2_SIZE off;
  std::string pattern = onig_compatible(pattern_in);
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!code_) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    bad_input("{}: regex at offset {} does not compile: {}", where, off,
              reinterpret_cast<char*>(msg));
  }
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0, hit;
  while ((hit = s.find(from, pos)) != std::string::npos) {
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  if (pos == 0) return;
  out.append(s, pos);
  s.swap(out);
}

Pattern Pattern::parse(const json& j, const std::string& where) {
  Pattern p;
  if (j.is_object() && j.contains("String")) {
    p.literal = j["String"].get<std::string>();
  } else if (j.is_object() && j.contains("Regex")) {
    p.regex = std::make_unique<Regex>(j["Regex"].get<std::string>(), where);
  } else {
    bad_input("{}: expected {{\"String\": ...}} or {{\"Regex\": ...}}", where);
  }
  return p;
}

std::string replace_pattern(std::string_view s, const Pattern& p, const std::string& content) {
  std::string out;
  size_t last = 0;
  p.for_each_match(s, [&](size_t b, size_t e) {
    out.append(s.data() + last, b - last);
    out += content;
    last = e;
  });
  out.append(s.data() + last, s.size() - last);
  return out;
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json fields

std::string jstr(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_string())
    bad_input("{}: missing string field '{}'", where, key);
  return j[key].get<std::string>();
}

bool jbool(const json& j, const char* key, bool dflt) {
  return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : dflt;
}

int32_t IdReader::operator()(const json& v, const std::string& where) const {
  if (!v.is_number_integer()) bad_input("{}: expected an integer id, got {}", where, v.dump());
  const int64_t id = v.get<int64_t>();
  if (id < 0) bad_input("{}: negative id {}", where, id);
  if (id >= limit)
    bad_input(
        "{}: id {} is far beyond the {} tokens of this file (ids of a vocabulary are "
        "0, 1, 2, ...)",
        where, id, vocab_size);
  return int32_t(id);
}

}  // namespace tok
}  // namespace rig
