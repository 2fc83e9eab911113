// The training strategies over several ranks, as StepHooks the model calls during its step:
//   DataParallel  every rank holds the whole model; gradients are summed across ranks in buckets
//                 that start while the backward pass is still running.
//   Sharded       every rank holds 1/world of every parameter (flat per layer), of its gradients
//                 and of the optimizer state; a layer's weights are all-gathered just before use
//                 and freed after, its gradients reduce-scattered as soon as they are final.
//                 4-bit weights (QLoRA's base) are sharded as the bytes they are stored in.
// Plus what resuming on another world size needs: loader positions of every rank, and sharded
// checkpoints (one file per rank and a layout) re-sliced for any world.
// The code, one file a role: parallel.cpp (DataParallel, PowerSGD), parallel_sharded.cpp (flat
// units, Sharded), parallel_resume.cpp (loader positions, sharded checkpoint files), with
// parallel_impl.h for what the last two share.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rig/data/loader.h"
#include "rig/dist/bucket.h"
#include "rig/model/llama.h"
#include "rig/optim/adamw.h"

namespace rig {

class DataParallel : public StepHooks {
 public:
  // Allocates the model's gradients (zero_grad) so the buckets can refer to them; they must stay
  // the same tensors afterwards (zero_grad zeroes in place). powersgd_rank > 0 compresses the
  // gradients of weight matrices to that rank (PowerSGD with error feedback, after the backward
  // pass); vectors and small matrices still go through the buckets.
  DataParallel(dist::Communicator& comm, LlamaModel& model, size_t bucket_bytes,
               int powersgd_rank = 0, uint64_t seed = 0);
  ~DataParallel() override;
  // Only the micro-step whose backward ends the accumulation communicates.
  void set_sync(bool on) { sync_ = on; }
  void before(int, Phase) override {}
  void after(int group, Phase phase) override;
  // Waits for every bucket: the gradients are then the sums over all ranks.
  void finish();
  size_t num_buckets() const { return buckets_ ? buckets_->num_buckets() : 0; }
  // PowerSGD's error feedback and warm start back to their first state (zero, the seeded start):
  // after a skipped step whose gradients were not finite, and after a rollback.
  void reset_compression();

 private:
  struct Compressed;
  void powersgd();
  dist::Communicator& comm_;
  std::unique_ptr<dist::BucketedAllReduce> buckets_;
  std::map<int, std::vector<size_t>> of_group_;  // group -> bucket tensor indices
  std::vector<Compressed> compressed_;
  int rank_ = 0;
  bool sync_ = true;
};

// One flat buffer of a parameter group, as a sharded checkpoint's layout records it.
struct FlatUnit {
  std::string name;  // "outer.decay", "layer.3.no_decay", "layer.3.frozen", "layer.3.frozen_4bit"
  int group = -1;
  bool trainable = false, no_decay = false;
  // The group's 4-bit weights (frozen): the bytes of every tensor of their quantization state
  // (packed codes, absmax, quant_map, nested_absmax, nested_quant_map), each padded to 16 bytes,
  // carried in float32 words so the float32 collectives move them untouched. params then name
  // the tensors as transformers does ("...q_proj.weight", "...q_proj.weight.absmax", ...) with
  // their size in words.
  bool four_bit = false;
  // A frozen unit under bf16 compute: its matrices are stored in bf16 beside float32 norms, so it
  // too carries each tensor's bytes in float32 words (params: name and size in words).
  bool bytes = false;
  // The frozen input embedding alone ("outer.embedding.frozen"), released after its lookup.
  bool embedding = false;
  // The frozen head (final norm, lm_head) of a model whose embedding is a unit of its own:
  // gathered after the last layer's forward (outer_needed), not beside the layers' weights.
  bool head = false;
  // A slice of a frozen lm_head's vocabulary rows [row0, row0 + rows), carried as bytes: the
  // loss gathers one slice at a time (StepHooks::head_slice), never the whole matrix.
  int head_slice = -1;
  int64_t row0 = 0, rows = 0;
  std::vector<std::pair<std::string, int64_t>> params;  // name and numel, in flat order
  // 8-bit AdamW (trainable units): every param starts on a multiple of align (its block of 256)
  // and each rank's shard is a multiple of it too, so a shard holds whole blocks of the very
  // tensors one rank quantizes: the sharded step equals the unsharded one bit for bit, and the
  // 8-bit state does not depend on the world size (padding: under 256 elements per tensor).
  int64_t align = 1;
  int64_t min_8bit_size = -1;  // params of at least this many elements have 8-bit moments; -1: none
  bool eight_bit(size_t param) const {
    return min_8bit_size >= 0 && params[param].second >= min_8bit_size;
  }
  int64_t numel() const;                 // of the params
  std::vector<int64_t> offsets() const;  // where each param starts in the flat vector
  int64_t flat_numel() const;            // the flat vector: params and alignment padding
  dist::FlatShard shard_of(int world) const;
};

class Sharded : public StepHooks {
 public:
  // Takes over the model's parameters: keeps this rank's shard of each flat unit and releases
  // the full tensors (Param::value, and a 4-bit weight's packed/absmax/map tensors, become
  // undefined until a hook gathers them). No communication. With an 8-bit `opt`, the trainable
  // units are block-aligned (FlatUnit::align) and `opt` learns which tensor each piece of a
  // shard belongs to (AdamW::set_pieces).
  Sharded(dist::Communicator& comm, LlamaModel& model, AdamW* opt = nullptr);
  ~Sharded() override;
  // The trainable shards, one Param per unit, named by the unit: what the optimizer steps.
  std::vector<Param>& params() { return shard_params_; }
  const std::vector<FlatUnit>& units() const { return units_; }
  // This rank's shards of the frozen units (LoRA base weights; those of 4-bit units as U8 bytes),
  // in the order of the frozen units in units(): nothing writes them after start.
  std::vector<Tensor> frozen_shards() const;
  void zero_grad();
  // The global gradient norm (as clip_grad_norm_ over all ranks' shards) and the clipping.
  double clip_grad_norm(float max_norm);

  void before(int group, Phase phase) override;
  void after(int group, Phase phase) override;
  // Releases the gathered frozen embedding, or the frozen head (final norm, lm_head), until the
  // next step's before(-1).
  void outer_done(OuterPart part) override;
  // Gathers the frozen head, which before(-1) holds back while the layers run.
  void outer_needed(OuterPart part) override;
  int head_slices() const override { return head_whole_ ? 0 : head_slices_; }
  Tensor head_slice(int c, int next, int64_t& v0) override;
  void head_slice_done(int c) override;
  // Waits for the gradient reduce-scatters still in flight (before clipping).
  void finish();
  // Every parameter full on every rank (generation, the final output) and back. With
  // `trainable_only`, the trainable units alone (a LoRA adapter's output): the frozen base stays
  // sharded, as it must when it is larger than one card.
  void gather_all(bool trainable_only = false);
  void release_all();
  bool gathered() const { return pinned_; }

  // Checkpoints: this rank's tensors ("param.<unit>", and the optimizer's "adamw.m.<unit>",
  // "adamw.v.<unit>", "adamw8bit.{mq,mabs,vq,vabs}.<unit>") and the layout every rank shares.
  std::vector<std::pair<std::string, Tensor>> shard_tensors(const AdamW& opt) const;
  nlohmann::json layout() const;
  // Fills this rank's shards (and optimizer state) from `read`, which gives [begin, end) of the
  // unit's param'th tensor for a prefix ("param.", "adamw.m.", "adamw.v." in float32 elements;
  // "adamw8bit.mq.", "adamw8bit.vq." in U8 codes; "adamw8bit.mabs.", "adamw8bit.vabs." in
  // float32 absmax per block of 256), or false when the checkpoint has none (optimizer state
  // before the first step). Per tensor, so the writer's alignment and world size do not matter.
  using RangeReader = std::function<bool(const std::string& prefix, const FlatUnit& u, size_t param,
                                         int64_t begin, int64_t end, void* out)>;
  void load(const RangeReader& read, AdamW& opt, int64_t opt_step, Device dev);

 private:
  struct Unit;
  struct PendingGrad;
  void start_gather(Unit& u);
  void gather(Unit& u);
  void prefetch(int group);
  void release(Unit& u);
  dist::Communicator& comm_;
  LlamaModel& model_;
  std::vector<FlatUnit> units_;
  std::vector<std::unique_ptr<Unit>> state_;
  std::map<int, std::vector<size_t>> of_group_;
  std::vector<Param> shard_params_;
  std::vector<PendingGrad> pending_;  // reduce-scatters overlapping the next layer's backward
  bool pinned_ = false;               // gather_all: keep everything until release_all
  int head_slices_ = 0;               // units holding lm_head slices (FlatUnit::head_slice)
  std::vector<size_t> slice_units_;   // their indices in units_, by slice
  bool head_whole_ = false;           // gather_all bound lm_head whole
};

// Loader positions of every rank (a collective when comm is set).
std::vector<LoaderState> gather_loader_states(dist::Communicator* comm, const LoaderState& mine);
// This rank's position when resuming on `world` ranks from positions saved by saved.size()
// ranks. Another world size works when the ranks were in step (no packing): the global position
// is re-split. Throws InputError naming the checkpoint otherwise.
LoaderState resplit_loader_state(const std::vector<LoaderState>& saved, int rank, int world,
                                 const std::string& ckpt_dir);

// Sharded checkpoints on disk: shard-R-of-W.safetensors per rank plus the layout in the state.
std::string shard_file_name(int rank, int world);
// A reader over the shard files of a checkpoint written by `saved_layout["world"]` ranks; checks
// each file against the manifest once.
Sharded::RangeReader sharded_checkpoint_reader(const std::string& ckpt_dir,
                                               const nlohmann::json& saved_layout);
// A reader over named full tensors (a checkpoint of an unsharded run).
Sharded::RangeReader named_tensor_reader(const std::map<std::string, Tensor>& tensors);
// Every unit of a sharded checkpoint as named full tensors ("param.<name>", "adamw.m.<name>",
// ...), for resuming it without sharding.
std::map<std::string, Tensor> read_sharded_as_named(const std::string& ckpt_dir,
                                                    const nlohmann::json& saved_layout);
// Checks a saved layout against the current model's units; InputError naming the first mismatch.
void check_layout(const nlohmann::json& saved_layout, const std::vector<FlatUnit>& units,
                  const std::string& ckpt_dir);
// The units a model's parameters form (without sharding anything).
// The size of one slice of a frozen lm_head gathered for the loss under sharding: 256 MiB, or
// RIG_HEAD_SLICE_BYTES (tests split a tiny model's head with it). A head within one slice is
// gathered whole.
int64_t head_slice_bytes();
std::vector<FlatUnit> flat_units(const LlamaModel& model);

// Counts summed exactly over ranks in float32 collectives: 16-bit pieces.
void encode_count(int64_t v, float* out3);
int64_t decode_count(const float* in3);

}  // namespace rig
