// A Hugging Face `tokenizer.json` BPE tokenizer that reproduces `tokenizers` exactly:
//   added tokens -> normalizer -> pre-tokenizer -> BPE model -> (post-processor) ; decoder.
// Supported: normalizers NFC/NFD/NFKC/NFKD, Lowercase, Prepend, Replace, Strip, Sequence;
// pre-tokenizers Split (regex or string, all behaviours), ByteLevel, Metaspace, Sequence;
// BPE with merges (string or pair form), ignore_merges, byte_fallback, unk/fuse_unk;
// decoders ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence;
// post-processors TemplateProcessing, ByteLevel, Sequence (used only when add_special is set).
// Anything else is rejected at load time with the key that names it.
//
// Special tokens: Hugging Face's `encode` always matches added tokens in the text. Here they are
// matched only when EncodeOptions::special is true, so user data that contains "<|eot_id|>" cannot
// inject a control token; with special=true the ids equal HF's `encode(text,
// add_special_tokens=False)`, with special=false they equal HF with `split_special_tokens=True`
// (non-special added tokens are still matched, as there).
//
// Thread safety: a loaded Tokenizer is immutable; encode/decode may be called from any number of
// threads (each thread keeps its own word cache).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace rig {

struct EncodeOptions {
  bool special = false;      // match special added tokens written in the text
  bool add_special = false;  // apply the post-processor (e.g. prepend BOS for Llama 2)
};

struct DecodeOptions {
  bool skip_special = false;  // drop special added tokens from the output
};

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, normalized = false, single_word = false;
};

class Tokenizer {
 public:
  // Loads tokenizer.json; throws InputError naming the file and key on anything unsupported.
  static Tokenizer load(const std::string& path);
  static Tokenizer from_json(const std::string& json_text, const std::string& name = "tokenizer.json");
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // `text` must be valid UTF-8 (InputError with the byte offset otherwise).
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt = {}) const;
  // Encodes many texts on `threads` threads (0: all hardware threads); results in input order.
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string>& texts,
                                                 const EncodeOptions& opt = {},
                                                 int threads = 0) const;
  // Invalid UTF-8 produced by partial byte tokens becomes U+FFFD, as in HF. Unknown ids throw.
  std::string decode(const std::vector<int32_t>& ids, const DecodeOptions& opt = {}) const;

  int32_t vocab_size() const;  // model vocabulary plus added tokens (max id + 1)
  // Id of a vocabulary or added token, or -1.
  int32_t token_to_id(std::string_view token) const;
  std::string id_to_token(int32_t id) const;  // "" for an unknown id
  const std::vector<AddedToken>& added_tokens() const;
  const std::string& path() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Utilities shared with the data pipeline and tests.
bool utf8_valid(std::string_view s, size_t* bad_offset = nullptr);
std::string utf8_lossy(std::string_view bytes);  // invalid sequences -> U+FFFD (Rust's rules)
std::string nfc(std::string_view s);

}  // namespace rig
