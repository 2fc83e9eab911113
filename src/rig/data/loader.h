// What the trainer calls: a DataLoader that gives each rank its micro-batches.
//
//   auto data = std::make_shared<const TokenDataset>(TokenDataset::open(dir));
//   DataLoader loader(data, {.seq_len = 4096, .micro_batch = 2, .pack = true, .seed = 42,
//                            .rank = rank, .world = world});
//   loader.restore(LoaderState::from_json(ckpt["data"]));   // optional, exact resume
//   for (step...) { Batch b = loader.next(); ...; ckpt["data"] = loader.state().to_json(); }
//
// Order: each epoch is a permutation of all samples by (seed, epoch) (own splitmix64
// Fisher-Yates, identical on every platform). Rank r takes permutation positions r, r+world, ...;
// the tail that does not divide by world is dropped that epoch, so ranks never overlap and all
// have the same number of samples. The stream is endless: a batch that reaches the end of an epoch
// continues with the next, so every rank can always produce a batch (same step count everywhere).
//
// Rows: a sample longer than seq_len is truncated to its first seq_len tokens (samples left with
// no trained token are skipped). With pack, consecutive samples of the rank's stream fill a row
// until the next does not fit; without pack, one sample per row. Rows are padded to seq_len.
//
// Batch tensors are CPU int64 [B, T] with B = micro_batch, T = seq_len:
//   input_ids     token ids; padding is pad_id
//   labels        HF convention, NOT shifted: labels[t] = input_ids[t] where that token is a loss
//                 target, else -100. The loss predicts labels[t+1] from position t. The first
//                 token of every sample is -100, so no position is ever trained to predict the
//                 next sample's first token; prompt tokens and padding are -100 too.
//   position_ids  0,1,2,... restarting at every sample; padding continues from 0 too
//   segment_ids   1,2,3,... per sample within a row, 0 for padding. Attention must only connect
//                 tokens with equal segment id (and causal): samples never see each other.
// cu_seqlens (I32 [S+1]) are the cumulative lengths of all segments over the flattened B*T
// tokens, padding included as its own segment, for varlen attention kernels; max_seqlen is the
// longest. trained_tokens counts labels != -100 that the shifted loss uses.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "rig/core/tensor.h"
#include "rig/data/dataset.h"

namespace rig {

struct Batch {
  Tensor input_ids, labels, position_ids, segment_ids;  // I64 [B, T]
  Tensor cu_seqlens;                                    // I32 [S+1]
  int64_t max_seqlen = 0;
  int64_t trained_tokens = 0;
  int64_t samples = 0;  // samples (whole or truncated) in this batch
};

struct LoaderOptions {
  int64_t seq_len = 2048;
  int64_t micro_batch = 1;
  bool pack = true;
  uint64_t seed = 0;
  int rank = 0, world = 1;
  int32_t pad_id = 0;
};

// Position in this rank's sample stream: epoch and index into the rank's share of that epoch.
struct LoaderState {
  uint64_t epoch = 0;
  uint64_t index = 0;
  nlohmann::json to_json() const;
  static LoaderState from_json(const nlohmann::json& j);  // InputError on a bad object
  bool operator==(const LoaderState&) const = default;
};

// The rank's sample order for one epoch (indices into the dataset), as described above.
std::vector<uint64_t> rank_order(uint64_t n_samples, uint64_t seed, uint64_t epoch, int rank,
                                 int world);

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const TokenDataset> data, const LoaderOptions& opt);
  Batch next();
  LoaderState state() const { return state_; }
  void restore(const LoaderState& s);  // InputError if index is past the rank's epoch length
  uint64_t samples_per_epoch() const { return per_rank_; }  // this rank's share

 private:
  uint64_t current_sample();  // the dataset index at state_, moving past epoch ends
  std::shared_ptr<const TokenDataset> data_;
  LoaderOptions opt_;
  LoaderState state_;
  uint64_t per_rank_ = 0;
  std::vector<uint64_t> order_;
  uint64_t order_epoch_ = UINT64_MAX;
};

}  // namespace rig
