// Normalizers: NFC/NFD/NFKC/NFKD, Lowercase, Prepend, Replace, Strip, Sequence.
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>

#include "rig/text/tokenizer_internal.h"

namespace rig {

namespace tok {

std::string utf8proc_transform(std::string_view s, int options) {
  bool ascii = std::all_of(s.begin(), s.end(), [](char c) { return uint8_t(c) < 0x80; });
  if (ascii && !(options & UTF8PROC_COMPAT)) return std::string(s);
  utf8proc_uint8_t* out = nullptr;
  auto n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()),
                   &out, utf8proc_option_t(options | UTF8PROC_STABLE));
  if (n < 0) fail("unicode normalization failed: {}", utf8proc_errmsg(n));
  std::string r(reinterpret_cast<char*>(out), size_t(n));
  free(out);
  return r;
}

Normalizer Normalizer::parse(const json& j, const std::string& where) {
  Normalizer n;
  std::string type = jstr(j, "type", where);
  if (type == "NFC")
    n.kind = NFC;
  else if (type == "NFD")
    n.kind = NFD;
  else if (type == "NFKC")
    n.kind = NFKC;
  else if (type == "NFKD")
    n.kind = NFKD;
  else if (type == "Lowercase")
    n.kind = Lowercase;
  else if (type == "Prepend") {
    n.kind = Prepend;
    n.text = jstr(j, "prepend", where);
  } else if (type == "Replace") {
    n.kind = Replace;
    n.pattern = Pattern::parse(j.value("pattern", json()), where + ".pattern");
    n.content = jstr(j, "content", where);
  } else if (type == "Strip") {
    n.kind = Strip;
    n.left = jbool(j, "strip_left", true);
    n.right = jbool(j, "strip_right", true);
  } else if (type == "Sequence") {
    n.kind = Seq;
    const json& list = j.value("normalizers", json::array());
    for (size_t i = 0; i < list.size(); ++i)
      n.children.push_back(parse(list[i], fmt::format("{}.normalizers[{}]", where, i)));
  } else {
    bad_input("{}: normalizer type '{}' is not supported", where, type);
  }
  return n;
}

void Normalizer::apply(std::string& s) const {
  switch (kind) {
    case NFC:
      s = utf8proc_transform(s, UTF8PROC_COMPOSE);
      break;
    case NFD:
      s = utf8proc_transform(s, UTF8PROC_DECOMPOSE);
      break;
    case NFKC:
      s = utf8proc_transform(s, UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
      break;
    case NFKD:
      s = utf8proc_transform(s, UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
      break;
    case Lowercase: {
      std::string out;
      for (size_t i = 0; i < s.size();) {
        int n = utf8::seq_len(s, i);
        utf8::append(out, char32_t(utf8proc_tolower(utf8proc_int32_t(utf8::decode_at(s, i, n)))));
        i += size_t(n);
      }
      s.swap(out);
      break;
    }
    case Prepend:
      if (!s.empty()) s = text + s;  // HF prepends only to non-empty strings
      break;
    case Replace:
      if (pattern.regex)
        s = replace_pattern(s, pattern, content);
      else
        replace_all(s, pattern.literal, content);
      break;
    case Strip: {
      auto ws = [](char c) {
        return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
      };
      size_t b = 0, e = s.size();
      if (left)
        while (b < e && ws(s[b])) ++b;
      if (right)
        while (e > b && ws(s[e - 1])) --e;
      s = s.substr(b, e - b);
      break;
    }
    case Seq:
      for (const auto& c : children) c.apply(s);
      break;
  }
}

}  // namespace tok

std::string nfc(std::string_view s) {
  return tok::utf8proc_transform(s, UTF8PROC_COMPOSE);
}

}  // namespace rig
