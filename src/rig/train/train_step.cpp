#include "rig/train/train_step.h"

#include "rig/ops/ops.h"
#include "rig/train/parallel.h"

namespace rig {

namespace {

uint64_t step_seed(uint64_t seed, int64_t step, int64_t micro) {
  uint64_t x = seed + 0x9E3779B97F4A7C15ull * uint64_t(step * 1024 + micro + 1);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  return (x ^ (x >> 27)) | 1;  // never 0: 0 means "no dropout"
}

}  // namespace

void place_model(LlamaModel& model, const TrainConfig& cfg, Device dev,
                 const std::string& precision) {
  // Frozen matrices turn bf16 on the host, so the device never holds their float32 copies.
  model.set_compute_dtype(precision == "bf16" ? DType::BF16 : DType::F32);
  ops::set_deterministic(cfg.deterministic);
  model.to_device(dev);
}

TrainStepOptions train_step_options(const TrainConfig& cfg, int rank) {
  TrainStepOptions o;
  o.checkpointing = cfg.activation_checkpointing == "none"        ? Checkpointing::None
                    : cfg.activation_checkpointing == "selective" ? Checkpointing::Selective
                                                                  : Checkpointing::Full;
  o.recompute_layers = cfg.recompute_layers;
  o.max_grad_norm = float(cfg.max_grad_norm);
  o.seed = cfg.seed;
  o.rank = rank;
  o.accumulation = cfg.gradient_accumulation_steps;
  return o;
}

OptimizerConfig optimizer_config(const TrainConfig& cfg, bool sharded) {
  OptimizerConfig oc;
  oc.lr = float(cfg.optimizer.lr);
  oc.beta1 = float(cfg.optimizer.beta1);
  oc.beta2 = float(cfg.optimizer.beta2);
  oc.eps = float(cfg.optimizer.eps);
  oc.weight_decay = float(cfg.optimizer.weight_decay);
  // Sharded: the norm spans every rank's shards, so the strategy clips.
  oc.max_grad_norm = sharded ? 0.0f : float(cfg.max_grad_norm);
  oc.no_decay_on_norms_and_biases = cfg.optimizer.no_decay_on_norms_and_biases;
  oc.eight_bit = cfg.optimizer.name == "adamw8bit";
  oc.min_8bit_size = cfg.optimizer.min_8bit_size;
  return oc;
}

TrainStep::TrainStep(LlamaModel& model, AdamW& opt, DataParallel* ddp, Sharded* shard,
                     const TrainStepOptions& o)
    : model_(model), opt_(opt), ddp_(ddp), shard_(shard), o_(o) {
  RIG_CHECK(!(ddp && shard), "a step is data-parallel or sharded, not both");
}

StepResult TrainStep::accumulate(const std::vector<TokenBatch>& micro, int64_t trained,
                                 int64_t step, float fault_scale) {
  if (shard_)
    shard_->zero_grad();
  else
    model_.zero_grad();
  StepHooks* hooks = shard_ ? static_cast<StepHooks*>(shard_) : ddp_;
  StepResult sum;
  for (size_t k = 0; k < micro.size(); ++k) {
    StepOptions so;
    so.grad_scale = (trained ? 1.0f / float(trained) : 0.0f) * fault_scale;
    so.checkpointing = o_.checkpointing;
    so.recompute_layers = o_.recompute_layers;
    so.loss_chunk_rows = o_.loss_chunk_rows;
    so.dropout_seed = step_seed(o_.seed, step, int64_t(o_.rank) * o_.accumulation + int64_t(k));
    so.hooks = hooks;
    // Data-parallel: no communication until the last micro-step's backward.
    if (ddp_) ddp_->set_sync(k + 1 == micro.size());
    auto r = model_.step(micro[k], so);
    sum.loss_sum += r.loss_sum * fault_scale;
    sum.tokens += r.tokens;
  }
  if (ddp_) ddp_->finish();
  if (shard_) shard_->finish();
  return sum;
}

bool TrainStep::nonfinite_grads() {
  return ops::count_bad_values(grads()) > 0;
}

double TrainStep::grad_norm() {
  return shard_ ? shard_->clip_grad_norm(o_.max_grad_norm) : rig::grad_norm(params());
}

void TrainStep::apply(float lr, double norm) {
  opt_.clip_and_step(params(), lr, norm);
}

std::vector<Param>& TrainStep::params() {
  return shard_ ? shard_->params() : model_.params();
}

std::vector<Tensor> TrainStep::grads() {
  std::vector<Tensor> g;
  for (const auto& p : params())
    if (p.trainable && p.grad.defined()) g.push_back(p.grad);
  return g;
}

std::vector<Tensor> TrainStep::trainable_weights() {
  std::vector<Tensor> w;
  for (const auto& p : params())
    if (p.trainable) w.push_back(p.value);
  return w;
}

}  // namespace rig
