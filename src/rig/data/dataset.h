// A tokenized dataset: samples stored back to back (token ids and train flags) with an offsets
// index. Built in memory from Samples, or opened from a prepared cache folder that
// `rig data prepare` (prepare_dataset) writes once and every run memory-maps.
//
// Cache folder: data.safetensors with tensors
//   tokens  I32 [N]    all samples' ids back to back
//   train   U8  [N]    1 where the token is a loss target
//   offsets I64 [n+1]  sample i is [offsets[i], offsets[i+1])
// and __metadata__ {"rig_data": JSON of the settings, source size and xxh3 checksum, tokenizer
// checksum, stats}. The file is written atomically, so a present file is a complete one.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rig/core/tensor.h"
#include "rig/data/records.h"

namespace rig {

class TokenDataset {
 public:
  static TokenDataset from_samples(const std::vector<Sample>& samples);
  // Opens a prepared cache; throws InputError if it is missing, malformed or inconsistent.
  static TokenDataset open(const std::string& dir);

  size_t size() const { return n_; }
  uint64_t num_tokens() const { return size_t(offsets_[n_]); }
  std::span<const int32_t> ids(size_t i) const;
  std::span<const uint8_t> train(size_t i) const;
  const std::string& metadata() const { return meta_; }  // the rig_data JSON ("" in memory)
  // The backing tensors (CPU; views of the mapping when opened from a cache).
  const Tensor& tokens_tensor() const { return tokens_; }
  const Tensor& train_tensor() const { return train_; }
  const Tensor& offsets_tensor() const { return offsets_t_; }

 private:
  Tensor tokens_, train_, offsets_t_;  // keep storage (or the mapping) alive
  const int32_t* tok_ = nullptr;
  const uint8_t* trn_ = nullptr;
  const int64_t* offsets_ = nullptr;
  size_t n_ = 0;
  std::string meta_;
};

struct PrepareOptions {
  std::string source;     // dataset file
  std::string tokenizer;  // tokenizer.json (not needed for Tokens format)
  std::string out_dir;
  RenderOptions render;
  bool force = false;  // rebuild even when the cache is current
};

struct PrepareResult {
  bool rebuilt = false;  // false: the cache was current and left as is
  std::string reason;    // why it was (re)built: "no cache", "source changed", ...
  RenderStats stats;
  std::string path;  // the data.safetensors written or found
};

// The settings key of a cache: source checksum + settings + tokenizer checksum, as JSON.
std::string dataset_fingerprint(const PrepareOptions& opt);
// Builds the cache unless one with the same fingerprint exists.
PrepareResult prepare_dataset(const PrepareOptions& opt);
// Opens the cache and checks it was built from this source and these settings; a stale cache
// throws InputError saying what changed and to re-run `rig data prepare`.
TokenDataset open_prepared(const PrepareOptions& opt);

}  // namespace rig
