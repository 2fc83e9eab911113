// Mirrors the Hugging Face `tokenizers` crate step by step; comments name the HF behaviour each
// piece reproduces where it is not obvious.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "rig/text/tokenizer.h"

#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <thread>
#include <unordered_map>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/text/utf8.h"

namespace rig {

using json = nlohmann::json;

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
  auto cont = [&](size_t k) { int b = at(k); return b >= 0x80 && b <= 0xBF; };
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

static std::string utf8proc_transform(std::string_view s, int options) {
  bool ascii = std::all_of(s.begin(), s.end(), [](char c) { return uint8_t(c) < 0x80; });
  if (ascii && !(options & UTF8PROC_COMPAT)) return std::string(s);
  utf8proc_uint8_t* out = nullptr;
  auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()),
                        &out, utf8proc_option_t(options | UTF8PROC_STABLE));
  if (n < 0) fail("unicode normalization failed: {}", utf8proc_errmsg(n));
  std::string r(reinterpret_cast<char*>(out), size_t(n));
  free(out);
  return r;
}

std::string nfc(std::string_view s) { return utf8proc_transform(s, UTF8PROC_COMPOSE); }

// ---------------------------------------------------------------------------------------------
// GPT-2 byte <-> unicode table (ByteLevel)

namespace {

struct ByteTable {
  char32_t byte_to_char[256];
  std::string byte_to_str[256];
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  ByteTable() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_char[b] = printable ? char32_t(b) : char32_t(256 + n++);
      byte_to_str[b] = utf8::encode(byte_to_char[b]);
      char_to_byte[byte_to_char[b]] = uint8_t(b);
    }
  }
};
const ByteTable& bytes() {
  static const ByteTable t;
  return t;
}

// Hash maps keyed by std::string but searchable by string_view without a copy.
struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StrMap = std::unordered_map<std::string, V, SvHash, std::equal_to<>>;

// ---------------------------------------------------------------------------------------------
// PCRE2 regex with JIT; match data is per thread.

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

class Regex {
 public:
  Regex(const std::string& pattern_in, const std::string& where) {
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
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;

  // Calls f(begin, end) for each non-overlapping match in s.
  template <typename F>
  void for_each_match(std::string_view s, F&& f) const {
    thread_local struct MD {
      pcre2_match_data* md = pcre2_match_data_create(32, nullptr);
      ~MD() { pcre2_match_data_free(md); }
    } md;
    size_t pos = 0;
    while (pos <= s.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                           PCRE2_NO_UTF_CHECK, md.md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) fail("regex match failed with code {}", rc);
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.md);
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: skip one character
        if (b >= s.size()) break;
        int n = utf8::seq_len(s, b);
        pos = b + size_t(n > 0 ? n : 1);
        continue;
      }
      f(b, e);
      pos = e;
    }
  }

 private:
  pcre2_code* code_ = nullptr;
};

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

// A "pattern" field: {"String": "..."} or {"Regex": "..."}.
struct Pattern {
  std::string literal;
  std::unique_ptr<Regex> regex;
  static Pattern parse(const json& j, const std::string& where) {
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
  template <typename F>
  void for_each_match(std::string_view s, F&& f) const {
    if (regex) return regex->for_each_match(s, f);
    if (literal.empty()) return;
    size_t pos = 0, hit;
    while ((hit = s.find(literal, pos)) != std::string_view::npos) {
      f(hit, hit + literal.size());
      pos = hit + literal.size();
    }
  }
};

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

std::string jstr(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_string())
    bad_input("{}: missing string field '{}'", where, key);
  return j[key].get<std::string>();
}
bool jbool(const json& j, const char* key, bool dflt) {
  return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : dflt;
}

// ---------------------------------------------------------------------------------------------
// Normalizers

struct Normalizer {
  enum Kind { NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, Seq } kind;
  std::string text, content;
  Pattern pattern;
  bool left = true, right = true;
  std::vector<Normalizer> children;

  static Normalizer parse(const json& j, const std::string& where) {
    Normalizer n;
    std::string type = jstr(j, "type", where);
    if (type == "NFC") n.kind = NFC;
    else if (type == "NFD") n.kind = NFD;
    else if (type == "NFKC") n.kind = NFKC;
    else if (type == "NFKD") n.kind = NFKD;
    else if (type == "Lowercase") n.kind = Lowercase;
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

  void apply(std::string& s) const {
    switch (kind) {
      case NFC: s = utf8proc_transform(s, UTF8PROC_COMPOSE); break;
      case NFD: s = utf8proc_transform(s, UTF8PROC_DECOMPOSE); break;
      case NFKC: s = utf8proc_transform(s, UTF8PROC_COMPOSE | UTF8PROC_COMPAT); break;
      case NFKD: s = utf8proc_transform(s, UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT); break;
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
        if (pattern.regex) s = replace_pattern(s, pattern, content);
        else replace_all(s, pattern.literal, content);
        break;
      case Strip: {
        auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
        size_t b = 0, e = s.size();
        if (left) while (b < e && ws(s[b])) ++b;
        if (right) while (e > b && ws(s[e - 1])) --e;
        s = s.substr(b, e - b);
        break;
      }
      case Seq:
        for (const auto& c : children) c.apply(s);
        break;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers. A pre-tokenized segment is a list of pieces; transformations split or rewrite.

using Pieces = std::vector<std::string>;

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// HF normalizer.rs `split`: turns (range, is_match) runs into pieces by behaviour.
void split_by(const std::string& s, const std::vector<std::pair<size_t, size_t>>& matches,
              bool invert, SplitBehavior beh, Pieces& out) {
  struct Run {
    size_t b, e;
    bool m;
  };
  std::vector<Run> runs;
  size_t last = 0;
  for (auto [b, e] : matches) {
    if (b > last) runs.push_back({last, b, invert});
    runs.push_back({b, e, !invert});
    last = e;
  }
  if (last < s.size()) runs.push_back({last, s.size(), invert});
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> acc;  // range, remove?
  switch (beh) {
    case SplitBehavior::Isolated:
      for (auto& r : runs) acc.push_back({{r.b, r.e}, false});
      break;
    case SplitBehavior::Removed:
      for (auto& r : runs) acc.push_back({{r.b, r.e}, r.m});
      break;
    case SplitBehavior::Contiguous: {
      bool prev = false;
      for (auto& r : runs) {
        if (r.m == prev && !acc.empty()) acc.back().first.second = r.e;
        else acc.push_back({{r.b, r.e}, false});
        prev = r.m;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      bool prev = false;
      for (auto& r : runs) {
        if (r.m && !prev && !acc.empty()) acc.back().first.second = r.e;
        else acc.push_back({{r.b, r.e}, false});
        prev = r.m;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool prev = false;
      for (auto it = runs.rbegin(); it != runs.rend(); ++it) {
        if (it->m && !prev && !acc.empty()) acc.back().first.first = it->b;
        else acc.push_back({{it->b, it->e}, false});
        prev = it->m;
      }
      std::reverse(acc.begin(), acc.end());
      break;
    }
  }
  for (auto& [r, remove] : acc)
    if (!remove && r.second > r.first) out.emplace_back(s, r.first, r.second - r.first);
}

const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

struct PreTokenizer {
  enum Kind { Split, ByteLevel, Metaspace, Whitespace, Seq } kind;
  Pattern pattern;
  bool invert = false;
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool add_prefix_space = false;
  std::shared_ptr<Regex> gpt2;  // ByteLevel with use_regex
  std::string replacement;      // Metaspace
  enum { Always, First, Never } prepend = Always;
  bool split = true;
  std::vector<PreTokenizer> children;

  static PreTokenizer parse(const json& j, const std::string& where) {
    PreTokenizer p;
    std::string type = jstr(j, "type", where);
    if (type == "Split") {
      p.kind = Split;
      p.pattern = Pattern::parse(j.value("pattern", json()), where + ".pattern");
      p.invert = jbool(j, "invert", false);
      std::string b = jstr(j, "behavior", where);
      if (b == "Removed") p.behavior = SplitBehavior::Removed;
      else if (b == "Isolated") p.behavior = SplitBehavior::Isolated;
      else if (b == "MergedWithPrevious") p.behavior = SplitBehavior::MergedWithPrevious;
      else if (b == "MergedWithNext") p.behavior = SplitBehavior::MergedWithNext;
      else if (b == "Contiguous") p.behavior = SplitBehavior::Contiguous;
      else bad_input("{}.behavior: unknown value '{}'", where, b);
    } else if (type == "ByteLevel") {
      p.kind = ByteLevel;
      p.add_prefix_space = jbool(j, "add_prefix_space", true);
      if (jbool(j, "use_regex", true)) p.gpt2 = std::make_shared<Regex>(kGpt2Pattern, where);
    } else if (type == "Metaspace") {
      p.kind = Metaspace;
      p.replacement = jstr(j, "replacement", where);
      p.split = jbool(j, "split", true);
      std::string scheme = j.contains("prepend_scheme") && j["prepend_scheme"].is_string()
                               ? j["prepend_scheme"].get<std::string>()
                               : (jbool(j, "add_prefix_space", true) ? "always" : "never");
      if (scheme == "always") p.prepend = Always;
      else if (scheme == "first") p.prepend = First;
      else if (scheme == "never") p.prepend = Never;
      else bad_input("{}.prepend_scheme: unknown value '{}'", where, scheme);
    } else if (type == "Whitespace") {
      p.kind = Whitespace;
      p.pattern.regex = std::make_unique<Regex>("\\w+|[^\\w\\s]+", where);
    } else if (type == "Sequence") {
      p.kind = Seq;
      const json& list = j.value("pretokenizers", json::array());
      for (size_t i = 0; i < list.size(); ++i) {
        p.children.push_back(parse(list[i], fmt::format("{}.pretokenizers[{}]", where, i)));
        if (p.children.back().kind == ByteLevel && i + 1 != list.size())
          bad_input("{}: ByteLevel must be the last pre-tokenizer of a Sequence", where);
      }
    } else {
      bad_input("{}: pre-tokenizer type '{}' is not supported", where, type);
    }
    return p;
  }

  bool byte_level() const {
    if (kind == ByteLevel) return true;
    return kind == Seq && !children.empty() && children.back().byte_level();
  }

  // first: this is the first segment of the input (Metaspace prepend_scheme "first").
  void apply(Pieces& pieces, bool first) const {
    Pieces out;
    std::vector<std::pair<size_t, size_t>> m;
    switch (kind) {
      case Seq:
        for (const auto& c : children) c.apply(pieces, first);
        return;
      case Split:
      case Whitespace:
        for (const auto& s : pieces) {
          m.clear();
          pattern.for_each_match(s, [&](size_t b, size_t e) { m.emplace_back(b, e); });
          if (kind == Whitespace) split_by(s, m, false, SplitBehavior::Isolated, out);
          else split_by(s, m, invert, behavior, out);
        }
        break;
      case ByteLevel:
        for (auto& s : pieces) {
          if (add_prefix_space && !s.empty() && s[0] != ' ') s.insert(s.begin(), ' ');
          if (!gpt2) {
            out.push_back(std::move(s));
            continue;
          }
          m.clear();
          gpt2->for_each_match(s, [&](size_t b, size_t e) { m.emplace_back(b, e); });
          split_by(s, m, false, SplitBehavior::Isolated, out);
        }
        break;
      case Metaspace:
        for (size_t i = 0; i < pieces.size(); ++i) {
          std::string s = pieces[i];
          replace_all(s, " ", replacement);
          bool pre = prepend == Always || (prepend == First && first && i == 0);
          if (pre && s.compare(0, replacement.size(), replacement) != 0) s = replacement + s;
          if (!split) {
            out.push_back(std::move(s));
            continue;
          }
          m.clear();
          size_t pos = 0, hit;
          while ((hit = s.find(replacement, pos)) != std::string::npos) {
            m.emplace_back(hit, hit + replacement.size());
            pos = hit + replacement.size();
          }
          split_by(s, m, false, SplitBehavior::MergedWithNext, out);
        }
        break;
    }
    pieces.swap(out);
  }
};

// ---------------------------------------------------------------------------------------------
// Decoders: each maps a list of token strings to a list of strings (HF decode_chain).

struct Decoder {
  enum Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Seq } kind;
  Pattern pattern;
  std::string content;
  char32_t strip_char = ' ';
  size_t start = 0, stop = 0;
  bool prepend = true;
  std::vector<Decoder> children;

  static Decoder parse(const json& j, const std::string& where) {
    Decoder d;
    std::string type = jstr(j, "type", where);
    if (type == "ByteLevel") d.kind = ByteLevel;
    else if (type == "Replace") {
      d.kind = Replace;
      d.pattern = Pattern::parse(j.value("pattern", json()), where + ".pattern");
      d.content = jstr(j, "content", where);
    } else if (type == "ByteFallback") d.kind = ByteFallback;
    else if (type == "Fuse") d.kind = Fuse;
    else if (type == "Strip") {
      d.kind = Strip;
      std::string c = jstr(j, "content", where);
      int n = c.empty() ? 0 : utf8::seq_len(c, 0);
      if (n == 0 || size_t(n) != c.size()) bad_input("{}.content: expected one character", where);
      d.strip_char = utf8::decode_at(c, 0, n);
      d.start = j.value("start", 0);
      d.stop = j.value("stop", 0);
    } else if (type == "Metaspace") {
      d.kind = Metaspace;
      d.content = jstr(j, "replacement", where);
      std::string scheme = j.contains("prepend_scheme") && j["prepend_scheme"].is_string()
                               ? j["prepend_scheme"].get<std::string>()
                               : (jbool(j, "add_prefix_space", true) ? "always" : "never");
      d.prepend = scheme != "never";
    } else if (type == "Sequence") {
      d.kind = Seq;
      const json& list = j.value("decoders", json::array());
      for (size_t i = 0; i < list.size(); ++i)
        d.children.push_back(parse(list[i], fmt::format("{}.decoders[{}]", where, i)));
    } else {
      bad_input("{}: decoder type '{}' is not supported", where, type);
    }
    return d;
  }

  std::vector<std::string> apply(std::vector<std::string> toks) const {
    std::vector<std::string> out;
    switch (kind) {
      case Seq:
        for (const auto& c : children) toks = c.apply(std::move(toks));
        return toks;
      case ByteLevel: {
        const auto& bt = bytes();
        std::string raw;
        for (const auto& t : toks) {
          std::string tb;
          bool ok = true;
          for (size_t i = 0; i < t.size() && ok;) {
            int n = utf8::seq_len(t, i);
            auto it = n ? bt.char_to_byte.find(utf8::decode_at(t, i, n)) : bt.char_to_byte.end();
            if (it == bt.char_to_byte.end()) ok = false;
            else tb += char(it->second);
            i += size_t(n ? n : 1);
          }
          raw += ok ? tb : t;  // a token with a non-byte character passes through as is
        }
        out.push_back(utf8_lossy(raw));
        return out;
      }
      case Replace:
        for (auto& t : toks) out.push_back(replace_pattern(t, pattern, content));
        return out;
      case ByteFallback: {
        std::string pending;
        auto flush = [&] {
          if (pending.empty()) return;
          if (utf8_valid(pending)) out.push_back(pending);
          else
            for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
          pending.clear();
        };
        for (auto& t : toks) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              isxdigit(uint8_t(t[3])) && isxdigit(uint8_t(t[4]))) {
            pending += char(std::stoi(t.substr(3, 2), nullptr, 16));
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        return out;
      }
      case Fuse: {
        std::string all;
        for (auto& t : toks) all += t;
        out.push_back(std::move(all));
        return out;
      }
      case Strip:
        for (auto& t : toks) {
          std::vector<std::pair<size_t, char32_t>> cs;  // byte offset, char
          for (size_t i = 0; i < t.size();) {
            int n = std::max(1, utf8::seq_len(t, i));
            cs.push_back({i, utf8::decode_at(t, i, n)});
            i += size_t(n);
          }
          size_t b = 0, e = cs.size();
          for (size_t i = 0; i < start && i < cs.size() && cs[i].second == strip_char; ++i) b = i + 1;
          for (size_t i = 0; i < stop && i < cs.size() && cs[cs.size() - i - 1].second == strip_char; ++i)
            e = cs.size() - i - 1;
          if (e < b) e = b;
          size_t bb = b < cs.size() ? cs[b].first : t.size();
          size_t eb = e < cs.size() ? cs[e].first : t.size();
          out.push_back(t.substr(bb, eb - bb));
        }
        return out;
      case Metaspace:
        for (size_t i = 0; i < toks.size(); ++i) {
          std::string r;
          const std::string& t = toks[i];
          for (size_t k = 0; k < t.size();) {
            if (t.compare(k, content.size(), content) == 0) {
              if (!(i == 0 && prepend)) r += ' ';
              k += content.size();
            } else {
              r += t[k++];
            }
          }
          out.push_back(std::move(r));
        }
        return out;
    }
    return out;
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string path;
  uint64_t serial = 0;
  // model
  StrMap<int32_t> vocab;
  std::vector<std::string> id_to_tok;  // model and added tokens
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  int32_t byte_fallback_ids[256];
  std::string cont_prefix, word_suffix;
  bool byte_level = false;
  int32_t byte_ids[256];  // byte-level: vocab id of each byte's character
  // pipeline
  std::vector<Normalizer> normalizer;  // zero or one
  std::vector<PreTokenizer> pre;       // zero or one
  std::vector<Decoder> decoder;        // zero or one
  // added tokens
  std::vector<AddedToken> added;
  std::vector<bool> is_special;  // by id
  std::vector<const AddedToken*> by_first_byte[256];  // longest first
  // post-processor: single-sequence template ids, or the unsupported type's name
  std::vector<int32_t> post_prefix, post_suffix;
  std::string post_unsupported;

  // Leftmost-longest search for added tokens; normalized selects which set.
  struct Match {
    size_t b, e;
    int32_t id;
  };
  std::vector<Match> find_added(std::string_view s, bool normalized_set, bool special) const {
    std::vector<Match> out;
    size_t i = 0;
    while (i < s.size()) {
      const auto& cands = by_first_byte[uint8_t(s[i])];
      const AddedToken* hit = nullptr;
      for (const AddedToken* t : cands) {
        if (t->normalized != normalized_set || (t->special && !special)) continue;
        if (s.compare(i, t->content.size(), t->content) == 0) {
          if (t->single_word) {
            auto word = [](char c) { return isalnum(uint8_t(c)) || c == '_' || uint8_t(c) >= 0x80; };
            size_t e = i + t->content.size();
            if ((i > 0 && word(s[i - 1])) || (e < s.size() && word(s[e]))) continue;
          }
          hit = t;
          break;
        }
      }
      if (!hit) {
        ++i;
        continue;
      }
      size_t b = i, e = i + hit->content.size();
      size_t floor = out.empty() ? 0 : out.back().e;
      auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
      if (hit->lstrip) while (b > floor && ws(s[b - 1])) --b;
      if (hit->rstrip) while (e < s.size() && ws(s[e])) ++e;
      out.push_back({b, e, hit->id});
      i = e;
    }
    return out;
  }

  static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  // HF BPE::merge_word + Word::merge_all.
  void bpe_word(std::string_view w, std::vector<int32_t>& out) const {
    struct Sym {
      int32_t id;
      int32_t prev, next;
      bool alive;
    };
    std::vector<Sym> syms;
    syms.reserve(w.size());
    auto add = [&](int32_t id) {
      int32_t n = int32_t(syms.size());
      syms.push_back({id, n - 1, -1, true});
      if (n > 0) syms[size_t(n - 1)].next = n;
    };
    if (byte_level) {
      for (unsigned char c : w) {
        if (byte_ids[c] < 0) bad_input("tokenizer: byte 0x{:02X} has no token in the vocabulary", c);
        add(byte_ids[c]);
      }
    } else {
      int32_t unk = -1;
      bool have_unk = false;
      for (size_t i = 0; i < w.size();) {
        int n = std::max(1, utf8::seq_len(w, i));
        bool first = i == 0, last = i + size_t(n) == w.size();
        std::string s(w.substr(i, size_t(n)));
        if (!first && !cont_prefix.empty()) s = cont_prefix + s;
        if (last && !word_suffix.empty()) s += word_suffix;
        auto it = vocab.find(std::string_view(s));
        if (it != vocab.end()) {
          if (have_unk) add(unk), have_unk = false;
          add(it->second);
        } else {
          bool done = false;
          if (byte_fallback) {
            bool all = true;
            for (unsigned char c : s) all = all && byte_fallback_ids[c] >= 0;
            if (all) {
              for (unsigned char c : s) add(byte_fallback_ids[c]);
              done = true;
            }
          }
          if (!done && unk_id >= 0) {
            if (have_unk && !fuse_unk) add(unk);
            unk = unk_id;
            have_unk = true;
          }
        }
        i += size_t(n);
      }
      if (have_unk) add(unk);
    }
    struct Cand {
      int32_t rank, pos, new_id;
      bool operator<(const Cand& o) const {  // max-heap: lowest rank, then lowest pos on top
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Cand> q;
    auto lookup = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
      auto it = merges.find(pair_key(a, b));
      return it == merges.end() ? nullptr : &it->second;
    };
    for (size_t i = 0; i + 1 < syms.size(); ++i)
      if (auto m = lookup(syms[i].id, syms[i + 1].id)) q.push({m->first, int32_t(i), m->second});
    while (!q.empty()) {
      Cand top = q.top();
      q.pop();
      Sym& cur = syms[size_t(top.pos)];
      if (!cur.alive || cur.next < 0) continue;
      Sym& right = syms[size_t(cur.next)];
      auto m = lookup(cur.id, right.id);
      if (!m || m->second != top.new_id) continue;  // stale entry
      cur.id = top.new_id;
      right.alive = false;
      cur.next = right.next;
      if (right.next >= 0) syms[size_t(right.next)].prev = top.pos;
      if (cur.prev >= 0)
        if (auto pm = lookup(syms[size_t(cur.prev)].id, cur.id)) q.push({pm->first, cur.prev, pm->second});
      if (cur.next >= 0)
        if (auto nm = lookup(cur.id, syms[size_t(cur.next)].id)) q.push({nm->first, top.pos, nm->second});
    }
    for (const auto& s : syms)
      if (s.alive) out.push_back(s.id);
  }

  struct Cache {
    uint64_t owner = 0;
    StrMap<std::vector<int32_t>> map;
  };

  void model_piece(std::string_view piece, std::vector<int32_t>& out, Cache& cache) const {
    if (piece.empty()) return;
    // The cache holds the final ids of a piece, including the ignore_merges shortcut.
    auto it = cache.map.find(piece);
    if (it != cache.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
    std::vector<int32_t> ids;
    int32_t whole = -1;
    if (ignore_merges) {
      if (byte_level) {
        std::string mapped;
        mapped.reserve(piece.size() * 2);
        for (unsigned char c : piece) mapped += bytes().byte_to_str[c];
        auto v = vocab.find(std::string_view(mapped));
        if (v != vocab.end()) whole = v->second;
      } else {
        auto v = vocab.find(piece);
        if (v != vocab.end()) whole = v->second;
      }
    }
    if (whole >= 0) ids.push_back(whole);
    else bpe_word(piece, ids);
    out.insert(out.end(), ids.begin(), ids.end());
    if (cache.map.size() > (1u << 18)) cache.map.clear();
    cache.map.emplace(std::string(piece), std::move(ids));
  }

  Cache& thread_cache() const {
    thread_local Cache c;
    if (c.owner != serial) {
      c.map.clear();
      c.owner = serial;
    }
    return c;
  }

  void encode_text(std::string_view seg, bool first, bool special, std::vector<int32_t>& out,
                   Cache& cache) const {
    std::string normed;
    std::string_view s = seg;
    if (!normalizer.empty()) {
      normed.assign(seg);
      normalizer[0].apply(normed);
      s = normed;
    }
    // Added tokens marked "normalized" are matched after normalization, as in HF.
    std::vector<Match> nm = has_normalized_added ? find_added(s, true, special) : std::vector<Match>{};
    size_t last = 0;
    auto run = [&](std::string_view part, bool is_first) {
      if (part.empty()) return;
      if (fast_split) {  // Isolated split + plain ByteLevel: pieces are views, nothing copied
        size_t gap = 0;
        fast_split->for_each_match(part, [&](size_t b, size_t e) {
          if (b > gap) model_piece(part.substr(gap, b - gap), out, cache);
          model_piece(part.substr(b, e - b), out, cache);
          gap = e;
        });
        if (gap < part.size()) model_piece(part.substr(gap), out, cache);
        return;
      }
      Pieces pieces{std::string(part)};
      if (!pre.empty()) pre[0].apply(pieces, is_first);
      for (const auto& p : pieces) model_piece(p, out, cache);
    };
    for (const auto& m : nm) {
      run(std::string_view(s).substr(last, m.b - last), first && last == 0);
      out.push_back(m.id);
      last = m.e;
    }
    run(std::string_view(s).substr(last), first && last == 0);
  }
  bool has_normalized_added = false;
  const Regex* fast_split = nullptr;  // set when the pre-tokenizer is the common Llama 3/Qwen shape

  // Word caches for encode_batch workers, kept across calls so each batch starts warm.
  mutable std::mutex pool_mu;
  mutable std::vector<std::unique_ptr<Cache>> cache_pool;
  std::unique_ptr<Cache> take_cache() const {
    std::lock_guard<std::mutex> lk(pool_mu);
    if (cache_pool.empty()) return std::make_unique<Cache>();
    auto c = std::move(cache_pool.back());
    cache_pool.pop_back();
    return c;
  }
  void give_cache(std::unique_ptr<Cache> c) const {
    std::lock_guard<std::mutex> lk(pool_mu);
    cache_pool.push_back(std::move(c));
  }

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt) const {
    return encode(text, opt, thread_cache());
  }
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt, Cache& cache) const {
    size_t bad;
    if (!utf8_valid(text, &bad)) bad_input("text is not valid UTF-8 at byte offset {}", bad);
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    auto matches = find_added(text, false, opt.special);
    size_t last = 0;
    for (const auto& m : matches) {
      if (m.b > last) encode_text(text.substr(last, m.b - last), last == 0, opt.special, out, cache);
      out.push_back(m.id);
      last = m.e;
    }
    if (last < text.size()) encode_text(text.substr(last), last == 0, opt.special, out, cache);
    if (opt.add_special) {
      if (!post_unsupported.empty())
        bad_input("{}: post_processor type '{}' is not supported", path, post_unsupported);
      out.insert(out.begin(), post_prefix.begin(), post_prefix.end());
      out.insert(out.end(), post_suffix.begin(), post_suffix.end());
    }
    return out;
  }

  void parse_post(const json& j, bool in_seq) {
    if (j.is_null()) return;
    std::string type = j.value("type", "");
    if (type == "ByteLevel") return;
    if (type == "Sequence") {
      for (const auto& c : j.value("processors", json::array())) parse_post(c, true);
      return;
    }
    if (type != "TemplateProcessing") {
      post_unsupported = type;
      return;
    }
    const json& specials = j.value("special_tokens", json::object());
    bool seen_a = false;
    for (const auto& item : j.value("single", json::array())) {
      if (item.contains("Sequence")) {
        seen_a = true;
      } else if (item.contains("SpecialToken")) {
        std::string id = item["SpecialToken"].value("id", "");
        if (!specials.contains(id)) bad_input("{}: post_processor: special token '{}' not listed", path, id);
        for (const auto& v : specials[id].value("ids", json::array()))
          (seen_a ? post_suffix : post_prefix).push_back(v.get<int32_t>());
      }
    }
  }
};

namespace {
std::atomic<uint64_t> g_serial{1};
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) { return from_json(read_file(path), path); }

Tokenizer Tokenizer::from_json(const std::string& text, const std::string& name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    bad_input("{}: not valid JSON: {}", name, e.what());
  }
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.path = name;
  t.serial = g_serial++;
  try {
    const json& m = j.value("model", json());
    if (!m.is_object()) bad_input("{}: missing 'model'", name);
    std::string type = m.value("type", "BPE");
    if (type != "BPE") bad_input("{}: model.type '{}' is not supported (only BPE)", name, type);
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
      bad_input("{}: model.dropout is not supported", name);
    const json& vocab = m.value("vocab", json());
    if (!vocab.is_object()) bad_input("{}: model.vocab: expected an object", name);
    int32_t max_id = -1;
    t.vocab.reserve(vocab.size());
    // Ids index a table as large as the largest one: read them whole (get<int32_t> would wrap a
    // large one silently) and refuse ids far beyond the number of tokens.
    const json& added_list = j.value("added_tokens", json::array());
    const int64_t limit = 4 * int64_t(vocab.size() + added_list.size()) + 4096;
    auto id_of = [&](const json& v, const std::string& where) {
      if (!v.is_number_integer()) bad_input("{}: expected an integer id, got {}", where, v.dump());
      const int64_t id = v.get<int64_t>();
      if (id < 0) bad_input("{}: negative id {}", where, id);
      if (id >= limit)
        bad_input(
            "{}: id {} is far beyond the {} tokens of this file (ids of a vocabulary are "
            "0, 1, 2, ...)",
            where, id, vocab.size());
      return int32_t(id);
    };
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      int32_t id = id_of(it.value(), fmt::format("{}: model.vocab['{}']", name, it.key()));
      t.vocab.emplace(it.key(), id);
      max_id = std::max(max_id, id);
    }
    const json& added = j.value("added_tokens", json::array());
    for (size_t i = 0; i < added.size(); ++i) {
      const json& a = added[i];
      std::string where = fmt::format("{}: added_tokens[{}]", name, i);
      AddedToken tok;
      if (!a.is_object() || !a.contains("id")) bad_input("{}: missing 'id'", where);
      tok.id = id_of(a["id"], where + ": id");
      tok.content = jstr(a, "content", where);
      if (tok.content.empty()) bad_input("{}: empty content", where);
      tok.special = jbool(a, "special", false);
      tok.lstrip = jbool(a, "lstrip", false);
      tok.rstrip = jbool(a, "rstrip", false);
      tok.normalized = jbool(a, "normalized", !tok.special);
      tok.single_word = jbool(a, "single_word", false);
      max_id = std::max(max_id, tok.id);
      t.added.push_back(tok);
    }
    t.id_to_tok.assign(size_t(max_id + 1), std::string());
    t.is_special.assign(size_t(max_id + 1), false);
    for (const auto& [k, v] : t.vocab) t.id_to_tok[size_t(v)] = k;
    for (const auto& a : t.added) {
      t.id_to_tok[size_t(a.id)] = a.content;
      t.is_special[size_t(a.id)] = a.special;
      t.has_normalized_added = t.has_normalized_added || a.normalized;
    }
    for (const auto& a : t.added) t.by_first_byte[uint8_t(a.content[0])].push_back(&a);
    for (auto& v : t.by_first_byte)
      std::stable_sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->content.size() > b->content.size(); });

    const json& merges = m.value("merges", json::array());
    t.merges.reserve(merges.size() * 2);
    for (size_t i = 0; i < merges.size(); ++i) {
      std::string a, b;
      const json& e = merges[i];
      if (e.is_string()) {
        std::string s = e.get<std::string>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos) bad_input("{}: model.merges[{}]: expected \"a b\", got '{}'", name, i, s);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        bad_input("{}: model.merges[{}]: expected a string or a pair", name, i);
      }
      auto ia = t.vocab.find(a), ib = t.vocab.find(b), in = t.vocab.find(a + b);
      if (ia == t.vocab.end() || ib == t.vocab.end() || in == t.vocab.end())
        bad_input("{}: model.merges[{}]: '{}' + '{}' uses a token missing from the vocabulary", name, i, a, b);
      t.merges[Impl::pair_key(ia->second, ib->second)] = {int32_t(i), in->second};
    }
    t.ignore_merges = jbool(m, "ignore_merges", false);
    t.byte_fallback = jbool(m, "byte_fallback", false);
    t.fuse_unk = jbool(m, "fuse_unk", false);
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = t.vocab.find(m["unk_token"].get<std::string>());
      if (it == t.vocab.end()) bad_input("{}: model.unk_token is not in the vocabulary", name);
      t.unk_id = it->second;
    }
    for (int b = 0; b < 256; ++b) {
      auto it = t.vocab.find(fmt::format("<0x{:02X}>", b));
      t.byte_fallback_ids[b] = it == t.vocab.end() ? -1 : it->second;
    }
    if (m.contains("continuing_subword_prefix") && m["continuing_subword_prefix"].is_string())
      t.cont_prefix = m["continuing_subword_prefix"].get<std::string>();
    if (m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string())
      t.word_suffix = m["end_of_word_suffix"].get<std::string>();

    if (j.contains("normalizer") && !j["normalizer"].is_null())
      t.normalizer.push_back(Normalizer::parse(j["normalizer"], name + ": normalizer"));
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
      t.pre.push_back(PreTokenizer::parse(j["pre_tokenizer"], name + ": pre_tokenizer"));
    if (j.contains("decoder") && !j["decoder"].is_null())
      t.decoder.push_back(Decoder::parse(j["decoder"], name + ": decoder"));
    t.parse_post(j.value("post_processor", json()), false);

    t.byte_level = !t.pre.empty() && t.pre[0].byte_level();
    if (t.byte_level && t.pre[0].kind == PreTokenizer::Seq && t.pre[0].children.size() == 2) {
      const PreTokenizer& sp = t.pre[0].children[0];
      const PreTokenizer& bl = t.pre[0].children[1];
      if (sp.kind == PreTokenizer::Split && sp.pattern.regex && !sp.invert &&
          sp.behavior == SplitBehavior::Isolated && !bl.add_prefix_space && !bl.gpt2)
        t.fast_split = sp.pattern.regex.get();
    }
    if (t.byte_level) {
      if (!t.cont_prefix.empty() || !t.word_suffix.empty())
        bad_input("{}: continuing_subword_prefix/end_of_word_suffix with ByteLevel are not supported", name);
      for (int b = 0; b < 256; ++b) {
        auto it = t.vocab.find(bytes().byte_to_str[b]);
        t.byte_ids[b] = it == t.vocab.end() ? -1 : it->second;
      }
    }
  } catch (const json::exception& e) {
    bad_input("{}: unexpected structure: {}", name, e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& opt) const {
  return impl_->encode(text, opt);
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string>& texts,
                                                          const EncodeOptions& opt,
                                                          int threads) const {
  std::vector<std::vector<int32_t>> out(texts.size());
  int n = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
  n = int(std::min<size_t>(size_t(n), texts.size()));
  if (n <= 1) {
    for (size_t i = 0; i < texts.size(); ++i) out[i] = encode(texts[i], opt);
    return out;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr err;
  std::mutex err_mu;
  auto work = [&] {
    try {
      auto cache = impl_->take_cache();
      for (;;) {
        size_t b = next.fetch_add(64);
        if (b >= texts.size()) break;
        for (size_t i = b; i < std::min(texts.size(), b + 64); ++i) out[i] = impl_->encode(texts[i], opt, *cache);
      }
      impl_->give_cache(std::move(cache));
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_mu);
      if (!err) err = std::current_exception();
      next = texts.size();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < n; ++i) pool.emplace_back(work);
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, const DecodeOptions& opt) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t id = ids[i];
    if (id < 0 || size_t(id) >= impl_->id_to_tok.size() || impl_->id_to_tok[size_t(id)].empty())
      bad_input("decode: id {} at position {} is not in the vocabulary (size {})", id, i, vocab_size());
    if (opt.skip_special && impl_->is_special[size_t(id)]) continue;
    toks.push_back(impl_->id_to_tok[size_t(id)]);
  }
  if (!impl_->decoder.empty()) toks = impl_->decoder[0].apply(std::move(toks));
  else {
    std::string joined;
    for (size_t i = 0; i < toks.size(); ++i) joined += (i ? " " : "") + toks[i];
    return joined;
  }
  std::string r;
  for (auto& t : toks) r += t;
  return r;
}

int32_t Tokenizer::vocab_size() const { return int32_t(impl_->id_to_tok.size()); }

int32_t Tokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || size_t(id) >= impl_->id_to_tok.size()) return "";
  return impl_->id_to_tok[size_t(id)];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
const std::string& Tokenizer::path() const { return impl_->path; }

}  // namespace rig
