// Internal declarations shared by the tokenizer_*.cpp files, one per stage of the Hugging Face
// `tokenizers` pipeline: added tokens -> normalizer -> pre-tokenizer -> BPE model ->
// post-processor ; decoder. Each stage mirrors the HF crate step by step; comments name the HF
// behaviour a piece reproduces where it is not obvious. Not part of the public interface.
#pragma once
#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "rig/core/error.h"
#include "rig/text/tokenizer.h"
#include "rig/text/utf8.h"

namespace rig::tok {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Shared helpers (tokenizer_util.cpp)

// GPT-2 byte <-> unicode table (ByteLevel).
struct ByteTable {
  char32_t byte_to_char[256];
  std::string byte_to_str[256];
  std::unordered_map<char32_t, uint8_t> char_to_byte;
  ByteTable();
};
const ByteTable& bytes();

// Hash maps keyed by std::string but searchable by string_view without a copy.
struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StrMap = std::unordered_map<std::string, V, SvHash, std::equal_to<>>;

// PCRE2 regex with JIT; match data is per thread. Patterns are made Oniguruma-compatible first.
class Regex {
 public:
  Regex(const std::string& pattern_in, const std::string& where);
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

void replace_all(std::string& s, const std::string& from, const std::string& to);

// A "pattern" field: {"String": "..."} or {"Regex": "..."}.
struct Pattern {
  std::string literal;
  std::unique_ptr<Regex> regex;
  static Pattern parse(const json& j, const std::string& where);
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

std::string replace_pattern(std::string_view s, const Pattern& p, const std::string& content);

std::string jstr(const json& j, const char* key, const std::string& where);
bool jbool(const json& j, const char* key, bool dflt);

// ---------------------------------------------------------------------------------------------
// Normalizer (tokenizer_normalizer.cpp)

std::string utf8proc_transform(std::string_view s, int options);

struct Normalizer {
  enum Kind { NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, Seq } kind;
  std::string text, content;
  Pattern pattern;
  bool left = true, right = true;
  std::vector<Normalizer> children;

  static Normalizer parse(const json& j, const std::string& where);
  void apply(std::string& s) const;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer (tokenizer_pretokenize.cpp). A pre-tokenized segment is a list of pieces;
// transformations split or rewrite.

using Pieces = std::vector<std::string>;

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

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

  static PreTokenizer parse(const json& j, const std::string& where);
  bool byte_level() const;
  // first: this is the first segment of the input (Metaspace prepend_scheme "first").
  void apply(Pieces& pieces, bool first) const;
};

// ---------------------------------------------------------------------------------------------
// Decoder (tokenizer_decode.cpp): maps a list of token strings to a list of strings (HF
// decode_chain).

struct Decoder {
  enum Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Seq } kind;
  Pattern pattern;
  std::string content;
  char32_t strip_char = ' ';
  size_t start = 0, stop = 0;
  bool prepend = true;
  std::vector<Decoder> children;

  static Decoder parse(const json& j, const std::string& where);
  std::vector<std::string> apply(std::vector<std::string> toks) const;
};

}  // namespace rig::tok
