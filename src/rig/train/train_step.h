// One optimizer step as `rig train` computes it, in the parts the guard reads between: zero the
// gradients and run the micro-batches (the strategy's hooks sum or shard the gradients as the
// backward pass produces them), look for NaN/Inf, take the global gradient norm, then clip and
// step AdamW. `rig bench train` times this same code.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "rig/model/llama.h"
#include "rig/optim/adamw.h"
#include "rig/train/train_config.h"

namespace rig {

class DataParallel;
class Sharded;

struct TrainStepOptions {
  Checkpointing checkpointing = Checkpointing::None;
  int64_t recompute_layers = -1;
  int64_t loss_chunk_rows = StepOptions{}.loss_chunk_rows;
  float max_grad_norm = 1.0f;  // sharded: the strategy clips (the optimizer does otherwise)
  // Dropout seeds follow (seed, optimizer step, rank x accumulation + micro-batch).
  uint64_t seed = 0;
  int rank = 0;
  int64_t accumulation = 1;
};

// A built model (build_model) in the config's compute precision ("fp32" or "bf16") on `dev`.
void place_model(LlamaModel& model, const TrainConfig& cfg, Device dev,
                 const std::string& precision);
// The step options and optimizer settings a config asks for (sharded: the strategy clips).
TrainStepOptions train_step_options(const TrainConfig& cfg, int rank);
OptimizerConfig optimizer_config(const TrainConfig& cfg, bool sharded);

class TrainStep {
 public:
  // At most one of ddp and shard (neither: one rank).
  TrainStep(LlamaModel& model, AdamW& opt, DataParallel* ddp, Sharded* shard,
            const TrainStepOptions& o);

  // Zeroes the gradients and runs forward and backward over the micro-batches of optimizer step
  // `step` (from 0). trained: the global batch's trained tokens, so the gradient is the mean over
  // all of them as one big batch would give (0: each micro-batch's own mean). fault_scale
  // multiplies loss and gradients (the loss-spike fault). Returns this rank's loss sum.
  StepResult accumulate(const std::vector<TokenBatch>& micro, int64_t trained, int64_t step,
                        float fault_scale = 1.0f);
  // NaN/Inf in this rank's gradients.
  bool nonfinite_grads();
  // The global gradient norm (sharded: over every rank's shards, and clipped there).
  double grad_norm();
  // Clips with that norm and steps the optimizer (which refreshes the compute copies).
  void apply(float lr, double norm);

  // What the optimizer steps: the model's parameters, or this rank's shards.
  std::vector<Param>& params();
  std::vector<Tensor> grads();
  std::vector<Tensor> trainable_weights();

 private:
  LlamaModel& model_;
  AdamW& opt_;
  DataParallel* ddp_;
  Sharded* shard_;
  TrainStepOptions o_;
};

}  // namespace rig
