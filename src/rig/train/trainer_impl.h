// The Trainer behind train(), internal to the train module. Its parts, one file each:
//   trainer_setup.cpp   config, device, ranks, data, model, optimizer, strategy, the checkpoint to
//                       resume from, and restoring one (resume and rollback)
//   trainer_step.cpp    one optimizer step and the guard's decisions around it
//   trainer_save.cpp    checkpoints, evaluation, the final output
//   trainer.cpp         the loop, the run's log and GPU telemetry, and train()
// (evaluate.cpp holds the evaluation and generation helpers trainer.h declares.)
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rig/data/loader.h"
#include "rig/data/records.h"
#include "rig/dist/communicator.h"
#include "rig/hw/telemetry.h"
#include "rig/optim/adamw.h"
#include "rig/train/checkpoint.h"
#include "rig/train/guard.h"
#include "rig/train/metrics.h"
#include "rig/train/parallel.h"
#include "rig/train/progress.h"
#include "rig/train/train_step.h"
#include "rig/train/trainer.h"

namespace rig {

class Allocator;

// The run's token data: the training split and the held-out one (null when eval.split is 0).
struct TrainData {
  std::shared_ptr<const TokenDataset> train, eval;
  RenderStats stats;
  std::vector<std::string> templates;  // "path: template" of each chat dataset
};

std::string tokenizer_path(const TrainConfig& cfg);
TrainData load_data(const TrainConfig& cfg, const Tokenizer& tok);
// A config's identity for resuming, and the same at any world size and split of the batch.
std::string resume_hash(TrainConfig c);
std::string global_batch_hash(TrainConfig c, int world);
// The kill faults: what a power cut or the OOM killer does, with the metrics already flushed.
[[noreturn]] void kill_self();
inline TokenBatch to_token_batch(const Batch& b) {
  return TokenBatch{b.input_ids, b.labels, b.position_ids, b.segment_ids};
}
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Trainer {
 public:
  // Setup: everything up to the first step, resuming from a checkpoint when there is one.
  Trainer(const TrainConfig& cfg, const TrainHooks& hooks);
  ~Trainer();
  TrainResult run();

 private:
  // ---- setup (trainer_setup.cpp) ----
  void setup_device();
  void setup_ranks();
  void share_gpu(int ranks_per_gpu);
  void find_resume_checkpoint();
  void check_resume_config() const;
  void setup_model();
  void setup_optimizer();
  void setup_strategy();
  void check_generation_fits() const;
  // ---- resume and rollback (trainer_setup.cpp) ----
  // The newest checkpoint that passes verification: rank 0 verifies, sets rejected ones aside
  // and tells the others which. Sets choice_ (a step, kNoCheckpoint or kAllRejected).
  std::optional<std::string> choose_checkpoint();
  // Everything a checkpoint holds back into the model, optimizer, data position and guard.
  void restore(const LoadedCheckpoint& ck);
  // Frozen weights from the model's source again (a checkpoint does not hold them).
  void reload_frozen();

  // ---- one optimizer step and the guard (trainer_step.cpp) ----
  // Retried: the guard skipped the step or rolled back; Stopped: a signal, after a checkpoint.
  enum class Attempt { Stepped, Retried, Stopped };
  Attempt step_once();
  struct GlobalBatch {
    std::vector<TokenBatch> micro;    // this rank's micro-batches
    int64_t trained = 0, tokens = 0;  // over every rank
  };
  // This rank's micro-batches, and the global counts; false when a rank asked to stop.
  bool draw_global_batch(bool stop, const LoaderState& at, GlobalBatch& b);
  // Whether a fault of `k` hits this rank at step `next` (logged either way).
  bool take_fault(FaultKind k, int64_t next);
  void inject_weight_faults(int64_t next);
  // The guard's verdict on a computed step: false when it skipped the step or rolled back.
  bool guard_allows_update(int64_t next, bool nonfinite, const std::optional<Spike>& spike,
                           bool shard_check, uint64_t shard_ref);
  void log_step(double loss, float lr, double norm, double tokens_per_s, int64_t trained);
  // Every parameter a rank holds (frozen ones too), and the frozen ones alone.
  std::vector<Tensor> weights();
  std::vector<Tensor> frozen_weights();
  // The weights at rest: replica hashes (data-parallel), implausible values, frozen changes.
  std::optional<HealthVerdict> check_weights();
  void report_verdict(const HealthVerdict& v, int64_t s, const std::string& found_by);
  bool rollback(int64_t at, const std::string& rule, nlohmann::json details, bool skip_window);
  bool check_due(int64_t s) const;
  void save_if_healthy();
  std::string last_checkpoint_words() const;

  // ---- checkpoints, evaluation, output (trainer_save.cpp) ----
  void save(int64_t s);
  void run_eval(int64_t s, bool final_eval);
  void write_final();
  // Every rank's peak reserved and in-use device memory (setup included), as an event.
  void report_rank_memory();
  void note_planned_memory();

  // ---- the run's log and telemetry (trainer.cpp) ----
  void open_run_log();
  void note(const std::string& s);
  void say(const std::string& s);
  void event(const std::string& name, int64_t s, const nlohmann::json& fields,
             const std::string& text);
  void report_rejected();
  void log_fault(const Injection& i, int64_t s);
  void open_telemetry();
  void watch_gpus(StepMetrics& m);

  static constexpr int64_t kNoCheckpoint = -1, kAllRejected = -2;

  TrainConfig cfg_;
  const TrainHooks& hooks_;
  Device dev_;
  std::string precision_;
  std::unique_ptr<dist::Group> group_;
  dist::Communicator* comm_ = nullptr;
  int rank_ = 0, world_ = 1;
  bool lead_ = true, sharding_ = false;
  std::string strategy_name_;
  std::string placement_;  // how the ranks sit on the GPUs, for the log
  uint64_t max_memory_ = 0;  // cfg_.max_memory, or by default an even share of a shared GPU
  Allocator* alloc_ = nullptr;
  std::optional<size_t> prior_budget_;  // the allocator's budget before max_memory set it
  std::string run_;  // the run folder
  Injector injector_;

  std::vector<RejectedCheckpoint> rejected_;  // reported once the metrics file is open
  int64_t choice_ = kNoCheckpoint;
  std::optional<LoadedCheckpoint> ckpt_;  // the one resumed from, until it is restored
  bool resumed_ = false;

  std::optional<Tokenizer> tok_;
  TrainData data_;
  std::unique_ptr<LlamaModel> model_;
  int64_t n_params_ = 0, n_trainable_ = 0;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<DataLoader> loader_;
  int64_t total_ = 0, accum_ = 1;
  int64_t step_ = 0;  // optimizer steps done
  std::unique_ptr<Sharded> shard_;
  std::unique_ptr<DataParallel> ddp_;
  std::unique_ptr<TrainStep> stepper_;

  // The guard's state: the spike rule's history, and counts that checkpoints carry.
  SpikeDetector spikes_;
  int64_t skipped_total_ = 0, rollbacks_ = 0, skips_in_row_ = 0;
  int64_t batches_drawn_ = 0;  // global batches taken from the data so far, skipped ones included
  size_t setup_peak_reserved_ = 0;  // the allocator's reserved peak before the first step
  uint64_t frozen_ref_ = 0;    // the frozen weights' hash at start: nothing may change them

  std::unique_ptr<MetricsWriter> metrics_;  // rank 0 only
  std::unique_ptr<Progress> progress_;      // rank 0, unless quiet
  std::optional<hw::Telemetry> telemetry_;
  std::optional<hw::ThermalPause> thermal_;
  int throttled_steps_ = 0;
  TrainResult result_;
};

}  // namespace rig
