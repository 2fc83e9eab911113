// The training guard's parts, kept out of the step loop so they can move with it
// (docs/reliability.md):
//   - fault injection specs ("nan-grad@5:1") and which fault is due when;
//   - the spike rule on the running loss and gradient norm;
//   - replica and weight health: parameter hashes and implausible values, gathered over ranks;
//   - choosing the newest checkpoint that passes verification, and setting rejected ones aside.
#pragma once
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "rig/core/tensor.h"
#include "rig/train/checkpoint.h"

namespace rig {

namespace dist {
class Communicator;
}

// ---- fault injection -----------------------------------------------------------------------

enum class FaultKind {
  NanGrad,
  BitFlip,
  BitFlipFrozen,
  LossSpike,
  Kill,
  KillDuringSave,
  CorruptCheckpoint
};

struct Injection {
  FaultKind kind = FaultKind::NanGrad;
  int64_t step = 1;  // the optimizer step (as metrics.jsonl counts them, from 1) it hits
  int rank = 0;      // the rank it hits (rank 0 when the spec names none)
  std::string spec;  // as written
  bool fired = false;
};

const char* fault_name(FaultKind k);
const std::vector<std::string>& fault_names();
// "KIND@STEP[:RANK]"; InputError naming `where` and, for a misspelt kind, the closest one.
Injection parse_injection(const std::string& spec, const std::string& where);
inline void check_injection_spec(const std::string& spec, const std::string& where) {
  parse_injection(spec, where);
}

// The faults of one run. Every rank holds all of them (the lead logs faults aimed at others).
class Injector {
 public:
  Injector() = default;
  Injector(const std::vector<std::string>& specs, int world, const std::string& where);
  // The first unfired injection of `kind` for `step` (at_or_after: for any step up to `step`,
  // for the faults that wait for the next checkpoint), marked fired. Several injections of one
  // kind and step fire on successive calls: nan-grad@3 written twice hits two attempts at step 3.
  std::optional<Injection> take(FaultKind kind, int64_t step, bool at_or_after = false);
  bool empty() const { return all_.empty(); }

 private:
  std::vector<Injection> all_;
};

// What each fault does to the tensors it hits (tests and the trainer share them).
// A NaN into element 0 of the first tensor that has one.
void poison_first_element(const std::vector<Tensor>& grads);
// Flips the highest exponent bit (bit 30 of F32, bit 14 of BF16) of element numel/2 of `t`, or
// the top bit of a U8 byte (packed 4-bit weights: its first code moves by 8 of 16); returns the
// value (the byte) before and after as float.
std::pair<float, float> flip_high_exponent_bit(Tensor& t);
// Flips bytes in the middle of the largest .safetensors file of a checkpoint folder; returns it.
std::string corrupt_checkpoint_file(const std::string& ckpt_dir);

// ---- the spike rule ------------------------------------------------------------------------

struct SpikeRule {
  int64_t window = 100;  // steps of history
  int64_t warmup = 20;   // steps in the history before the rule applies
  double k = 8;          // robust deviations above the median
  double loss_ratio = 1.5, grad_ratio = 10;
};

struct Spike {
  std::string metric;  // "loss" or "grad_norm"
  double value = 0, median = 0, mad = 0, threshold = 0;
  nlohmann::json to_json() const;
};

// The median of v (the mean of the two middle values for an even count), and the median
// absolute deviation from it.
double median_of(std::vector<double> v);
double mad_of(const std::vector<double>& v, double median);

// A value x of a metric spikes when, with m and MAD over the last `window` healthy values,
//   x > max(m + k * 1.4826 * MAD, ratio * m)
// (1.4826 MAD estimates the standard deviation of normal noise; the ratio keeps a very steady
// curve from flagging small moves). Only healthy steps enter the history.
class SpikeDetector {
 public:
  SpikeDetector() = default;
  explicit SpikeDetector(const SpikeRule& r) : rule_(r) {}
  std::optional<Spike> check(double loss, double grad_norm) const;
  void record(double loss, double grad_norm);
  size_t size() const { return loss_.size(); }
  // The history, for checkpoints (an exact resume decides as the uninterrupted run would).
  nlohmann::json to_json() const;
  void from_json(const nlohmann::json& j);  // tolerates a missing history (older checkpoints)

 private:
  std::optional<Spike> check_one(const char* metric, const std::deque<double>& h, double x,
                                 double ratio) const;
  SpikeRule rule_;
  std::deque<double> loss_, grad_;
};

// ---- replica and weight health ---------------------------------------------------------------

// Above this magnitude a weight is implausible: trained weights stay far below it, and a flipped
// high exponent bit lands far above it (x 2^64 or more).
inline constexpr double kImplausibleWeight = 1e8;

struct RankHealth {
  uint64_t hash = 0;        // parameter hash (data-parallel replicas), 0 when not taken
  int64_t implausible = 0;  // weights that are NaN/Inf or above kImplausibleWeight
  bool changed = false;     // weights changed while nothing should write them (frozen weights;
                            // a sharded rank's shards during a checked step)
};

// Every rank's health (one all-gather); {mine} without a communicator.
std::vector<RankHealth> gather_health(dist::Communicator* comm, const RankHealth& mine);

struct HealthVerdict {
  bool ok = true;
  std::string rule;        // "replica" (hashes differ), "weights" (implausible values), "shard" or
                           // "frozen" (changed at rest)
  std::vector<int> ranks;  // the ranks to blame (every rank when they cannot be told apart)
  std::string detail;      // in words
  std::vector<uint64_t> hashes;  // every rank's parameter hash, when replicas were compared
};
// compare_hashes: the ranks are data-parallel replicas whose hashes must agree. The blamed
// ranks are those with implausible weights, else those whose weights changed at rest, else those
// outside the majority hash, else (a tie, as with 2 ranks) all of them. Without a hash
// difference, changed weights are reported under `changed_rule` ("shard", "frozen").
HealthVerdict judge_health(const std::vector<RankHealth>& all, bool compare_hashes,
                           const std::string& changed_rule = "frozen");

// ---- checkpoints fit for use ---------------------------------------------------------------

struct RejectedCheckpoint {
  int64_t step = 0;
  std::string dir;
  std::vector<std::string> problems;
};
struct CheckpointChoice {
  std::optional<CheckpointRef> chosen;
  std::vector<RejectedCheckpoint> rejected;  // newer ones that failed, newest first
};
// What a checkpoint must pass before use: the manifest, every checksum, no NaN/Inf anywhere,
// weights ("param." tensors) below kImplausibleWeight.
VerifyOptions verify_for_use();
// The newest complete checkpoint of a run that passes verify_for_use (verify = false: the newest
// complete one, unverified).
CheckpointChoice newest_usable_checkpoint(const std::string& run_dir, bool verify);
// Moves a rejected checkpoint to checkpoints/rejected-step-N (kept for a look, never listed,
// resumed or counted by keep_last); returns the new path.
std::string set_aside_checkpoint(const std::string& dir);

}  // namespace rig
