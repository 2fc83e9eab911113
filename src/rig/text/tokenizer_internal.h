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
#include <mutex>
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

// Reads token ids whole and refuses ids far beyond the number of tokens: ids index a table as
// large as the largest one (get<int32_t> would wrap a large one silently).
struct IdReader {
  int64_t limit;
  size_t vocab_size;
  int32_t operator()(const json& v, const std::string& where) const;
};

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
// BPE model (tokenizer_bpe.cpp)

// Word cache: the final ids of each piece, per thread or per encode_batch worker.
struct BpeCache {
  uint64_t owner = 0;
  StrMap<std::vector<int32_t>> map;
};

struct BpeModel {
  StrMap<int32_t> vocab;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  int32_t byte_fallback_ids[256];
  std::string cont_prefix, word_suffix;
  bool byte_level = false;
  int32_t byte_ids[256];  // byte-level: vocab id of each byte's character

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (uint64_t(uint32_t(a)) << 32) | uint32_t(b);
  }

  // Reads model.vocab; max_id grows to the largest id seen.
  void load_vocab(const json& vocab, const std::string& name, const IdReader& id_of,
                  int32_t& max_id);
  // Reads model.merges and the options after the vocabulary is known.
  void load_merges(const json& m, const std::string& name);
  void load_options(const json& m, const std::string& name);
  // Switches to byte-level input (the pre-tokenizer ends in ByteLevel).
  void set_byte_level(const std::string& name);

  // Appends the ids of one pre-tokenized piece.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out, BpeCache& cache) const;
  // HF BPE::merge_word + Word::merge_all.
  void bpe_word(std::string_view w, std::vector<int32_t>& out) const;
};

// ---------------------------------------------------------------------------------------------
// Added tokens (tokenizer_added.cpp)

struct AddedMatch {
  size_t b, e;
  int32_t id;
};

struct AddedVocab {
  std::vector<AddedToken> tokens;
  std::vector<const AddedToken*> by_first_byte[256];  // longest first; points into tokens
  bool has_normalized = false;

  // Reads added_tokens; max_id grows to the largest id seen.
  void load(const json& list, const std::string& name, const IdReader& id_of, int32_t& max_id);
  // Builds the search index once tokens is final.
  void index();
  // Leftmost-longest search for added tokens; normalized_set selects which set.
  std::vector<AddedMatch> find(std::string_view s, bool normalized_set, bool special) const;
};

// ---------------------------------------------------------------------------------------------
// Post-processor (tokenizer_postprocess.cpp): single-sequence template ids, or the unsupported
// type's name (an error only when add_special asks for it).

struct PostProcessor {
  std::vector<int32_t> prefix, suffix;
  std::string unsupported;

  void parse(const json& j, const std::string& path);
  void apply(std::vector<int32_t>& ids, const std::string& path) const;
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

namespace rig {

// The loaded pipeline (tokenizer.cpp loads and encodes, tokenizer_decode.cpp decodes).
struct Tokenizer::Impl {
  std::string path;
  uint64_t serial = 0;
  tok::BpeModel model;
  std::vector<std::string> id_to_tok;  // model and added tokens
  std::vector<bool> is_special;        // by id
  tok::AddedVocab added;
  std::vector<tok::Normalizer> normalizer;  // zero or one
  std::vector<tok::PreTokenizer> pre;       // zero or one
  std::vector<tok::Decoder> decoder;        // zero or one
  tok::PostProcessor post;
  const tok::Regex* fast_split = nullptr;  // set when the pre-tokenizer is the Llama 3/Qwen shape

  // Word caches for encode_batch workers, kept across calls so each batch starts warm.
  mutable std::mutex pool_mu;
  mutable std::vector<std::unique_ptr<tok::BpeCache>> cache_pool;

  // Loading, in the order that decides which error a file with several gets.
  void load(const tok::json& j);
  void index_ids(int32_t max_id);
  void load_pipeline(const tok::json& j);

  std::unique_ptr<tok::BpeCache> take_cache() const;
  void give_cache(std::unique_ptr<tok::BpeCache> c) const;
  tok::BpeCache& thread_cache() const;

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt) const;
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt,
                              tok::BpeCache& cache) const;
  void encode_text(std::string_view seg, bool first, bool special, std::vector<int32_t>& out,
                   tok::BpeCache& cache) const;
};

}  // namespace rig
