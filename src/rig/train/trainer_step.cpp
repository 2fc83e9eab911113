// One optimizer step of the trainer and the guard's decisions around it (docs/reliability.md):
// every rank reaches the same decision.
#include <cmath>
#include <csignal>
#include <cstdio>

#include "rig/core/allocator.h"
#include "rig/dist/communicator.h"
#include "rig/ops/ops.h"
#include "rig/train/trainer_impl.h"

namespace rig {

using json = nlohmann::json;

namespace {

int64_t real_tokens(const Batch& b) {
  int64_t n = 0;
  const int64_t* s = b.segment_ids.data<int64_t>();
  for (int64_t i = 0; i < b.segment_ids.numel(); ++i) n += s[i] != 0;
  return n;
}

// The loss-spike fault's factor on one step's loss and gradients.
constexpr float kLossSpikeFactor = 1000.0f;

// The weight a bit-flip fault hits: the first trainable matrix of a layer (every token reads it),
// else the first trainable tensor.
Tensor flip_target(std::vector<Param>& params) {
  for (auto& p : params)
    if (p.trainable && p.value.ndim() == 2 && p.name.find("layers.") != std::string::npos)
      return p.value;
  for (auto& p : params)
    if (p.trainable && p.name.rfind("layer.", 0) == 0) return p.value;  // a sharded unit
  for (auto& p : params)
    if (p.trainable) return p.value;
  fail("bit-flip: no trainable parameter to flip");
}

// What bit-flip-frozen hits: the first frozen matrix of a layer (a LoRA base weight), or this
// rank's shard of the first frozen layer unit.
Tensor frozen_flip_target(LlamaModel& model, const Sharded* shard) {
  if (shard) {
    // A layer's 4-bit unit when there is one (QLoRA: the bulk of the frozen bytes), else its
    // frozen float unit.
    auto shards = shard->frozen_shards();
    for (const char* kind : {".frozen_4bit", ".frozen"}) {
      size_t k = 0;
      for (const auto& u : shard->units()) {
        if (u.trainable) continue;
        if (u.name.rfind("layer.", 0) == 0 && u.name.ends_with(kind)) return shards[k];
        ++k;
      }
    }
  } else {
    for (auto& p : model.params()) {
      if (p.trainable || p.name.find("layers.") == std::string::npos) continue;
      if (p.quant) return p.quant->packed;  // QLoRA: the packed 4-bit codes
      if (p.value.ndim() == 2) return p.value;
    }
  }
  bad_input("bit-flip-frozen: the model has no frozen layer weights (use method: lora)");
}

// Sums a few floats over the ranks (on the communicator's device).
void sum_over_ranks(dist::Communicator& comm, std::vector<float>& v) {
  Tensor t = Tensor::from_f32(v, {int64_t(v.size())});
  if (comm.device().is_cpu()) {
    comm.all_reduce(t, dist::ReduceOp::Sum);
  } else {
    Tensor d = t.to(comm.device(), "counts");
    comm.all_reduce(d, dist::ReduceOp::Sum);
    t = d.to(Device::cpu(), "counts");
  }
  std::copy(t.f32(), t.f32() + v.size(), v.begin());
}

}  // namespace

[[noreturn]] void kill_self() {
  std::fflush(nullptr);
  std::raise(SIGKILL);
  std::abort();  // not reached
}

namespace {

// A parameter's stored bytes: its value, or for a 4-bit weight (QLoRA's base, whose value is not
// kept) the packed codes and scales.
void add_weight(const Param& p, std::vector<Tensor>& w) {
  if (!p.quant) {
    w.push_back(p.value);
    return;
  }
  w.push_back(p.quant->packed);
  w.push_back(p.quant->absmax);
  if (p.quant->nested_absmax.defined()) w.push_back(p.quant->nested_absmax);
}

}  // namespace

// Every parameter a rank holds (frozen ones too: a flipped bit in a frozen base weight makes a
// replica's gradients differ): what the guard hashes and scans.
std::vector<Tensor> Trainer::weights() {
  std::vector<Tensor> w;
  if (shard_) {
    for (const auto& p : shard_->params()) w.push_back(p.value);
    for (const auto& t : shard_->frozen_shards()) w.push_back(t);
  } else {
    for (const auto& p : model_->params()) add_weight(p, w);
  }
  return w;
}

// Nothing writes frozen weights (LoRA's base) after start, so their hash must never move; a
// checkpoint does not hold them, so a rollback after they changed reloads them.
std::vector<Tensor> Trainer::frozen_weights() {
  if (shard_) return shard_->frozen_shards();
  std::vector<Tensor> w;
  for (const auto& p : model_->params())
    if (!p.trainable) add_weight(p, w);
  return w;
}

Trainer::Attempt Trainer::step_once() {
  const bool stop = hooks_.should_stop && hooks_.should_stop();
  if (stop && !comm_) {
    save_if_healthy();
    result_.interrupted = true;
    return Attempt::Stopped;
  }
  const double t0 = now_s();
  const float lr = float(cfg_.schedule.lr_at(step_, total_, cfg_.optimizer.lr));
  const LoaderState at = loader_->state();
  const int64_t next = step_ + 1;  // the step this attempt computes
  if (hooks_.discard_batches) {
    const int64_t n = hooks_.discard_batches(next);
    for (int64_t k = 0; k < n * accum_; ++k) loader_->next();
    batches_drawn_ += n;
  }
  // Sharded: the shards at the start of a checked step, compared again before the update.
  const bool shard_check = shard_ && check_due(next);
  const uint64_t shard_ref = shard_check ? ops::hash64(stepper_->trainable_weights()) : 0;
  inject_weight_faults(next);
  const bool spike_fault = take_fault(FaultKind::LossSpike, next),
             nan_fault = take_fault(FaultKind::NanGrad, next),
             kill_fault = take_fault(FaultKind::Kill, next);
  GlobalBatch b;
  if (!draw_global_batch(stop, at, b)) return Attempt::Stopped;
  // loss-spike: this rank's loss and gradients multiplied, before they are summed over ranks.
  StepResult r =
      stepper_->accumulate(b.micro, b.trained, step_, spike_fault ? kLossSpikeFactor : 1.0f);
  if (nan_fault) poison_first_element(stepper_->grads());
  if (kill_fault) kill_self();
  // The guard reads the gradients once, before anything is updated: NaN/Inf anywhere (on any
  // rank: the flag rides on the loss's all-reduce). On one rank the gradient norm below finds
  // them as well (a NaN or Inf makes the sum of squares NaN or Inf), so no separate pass.
  bool bad_grads = comm_ && stepper_->nonfinite_grads();
  if (comm_) {
    std::vector<float> v(5);
    v[0] = float(r.loss_sum);
    encode_count(r.tokens, &v[1]);
    v[4] = bad_grads ? 1.0f : 0.0f;
    sum_over_ranks(*comm_, v);
    r.loss_sum = v[0];
    r.tokens = decode_count(&v[1]);
    bad_grads = v[4] > 0;
  }
  const double loss = r.tokens ? r.loss_sum / double(r.tokens) : 0;
  bool nonfinite = bad_grads || !std::isfinite(loss);
  double norm = std::nan("");
  std::optional<Spike> spike;
  if (!nonfinite) {
    norm = stepper_->grad_norm();
    nonfinite = !std::isfinite(norm);
    if (!nonfinite && cfg_.guard.rollback_on_spike) spike = spikes_.check(loss, norm);
  }
  if (nonfinite && !cfg_.guard.skip_nonfinite)
    fail(
        "step {}: the loss or the gradients are not finite (loss {}, gradient norm {}) and "
        "guard.skip_nonfinite is off; {}",
        next, loss, norm, last_checkpoint_words());
  if (!guard_allows_update(next, nonfinite, spike, shard_check, shard_ref)) return Attempt::Retried;
  skips_in_row_ = 0;
  // Sharded: clipped above already (the optimizer's max_grad_norm is 0 there).
  stepper_->apply(lr, norm);
  spikes_.record(loss, norm);
  ++step_;
  log_step(loss, lr, norm, double(b.tokens) / std::max(1e-9, now_s() - t0), b.trained);
  // The weights at rest, now and then and before every checkpoint (the final one included), so
  // a checkpoint never holds a corrupted replica. (Sharded ranks checked theirs before the
  // update.)
  if (!shard_ && check_due(step_))
    if (auto bad = check_weights()) {
      report_verdict(*bad, step_, "check at rest");
      if (!rollback(step_, bad->rule, {{"ranks", bad->ranks}}, false))
        fail("step {}: {}; there is no verified checkpoint to roll back to, so the run stops",
             step_, bad->detail);
      return Attempt::Retried;
    }
  return Attempt::Stepped;
}

bool Trainer::take_fault(FaultKind k, int64_t next) {
  std::optional<Injection> i = injector_.take(k, next);
  if (i) log_fault(*i, next);
  return i && i->rank == rank_;
}

void Trainer::inject_weight_faults(int64_t next) {
  if (take_fault(FaultKind::BitFlip, next)) {
    Tensor target = flip_target(stepper_->params());
    auto [was, is] = flip_high_exponent_bit(target);
    if (!shard_) model_->refresh_compute_weights();
    note(fmt::format("rank {}: flipped a weight from {:g} to {:g}", rank_, was, is));
  }
  if (take_fault(FaultKind::BitFlipFrozen, next)) {
    Tensor target = frozen_flip_target(*model_, shard_.get());
    auto [was, is] = flip_high_exponent_bit(target);
    note(fmt::format(
        "rank {}: flipped {} from {:g} to {:g}", rank_,
        target.dtype() == DType::U8 ? "a byte of frozen 4-bit weights" : "a frozen weight", was,
        is));
  }
}

bool Trainer::draw_global_batch(bool stop, const LoaderState& at, GlobalBatch& b) {
  for (int64_t k = 0; k < accum_; ++k) {
    Batch m = loader_->next();
    b.trained += m.trained_tokens;
    b.tokens += real_tokens(m);
    b.micro.push_back(to_token_batch(m));
  }
  ++batches_drawn_;
  if (!comm_) return true;
  // The whole global batch's trained tokens scale every rank's gradients; a stop request on any
  // rank stops all of them at the same step.
  std::vector<float> v(7);
  v[0] = stop ? 1.0f : 0.0f;
  encode_count(b.trained, &v[1]);
  encode_count(b.tokens, &v[4]);
  sum_over_ranks(*comm_, v);
  b.trained = decode_count(&v[1]);
  b.tokens = decode_count(&v[4]);
  if (v[0] == 0) return true;
  loader_->restore(at);
  --batches_drawn_;
  save_if_healthy();
  result_.interrupted = true;
  return false;
}

bool Trainer::guard_allows_update(int64_t next, bool nonfinite, const std::optional<Spike>& spike,
                                  bool shard_check, uint64_t shard_ref) {
  // Sharded: a shard that changed between the start of this step and now.
  std::optional<HealthVerdict> verdict;
  if (shard_check) {
    RankHealth mine;
    mine.changed = ops::hash64(stepper_->trainable_weights()) != shard_ref ||
                   ops::hash64(frozen_weights()) != frozen_ref_;
    HealthVerdict v = judge_health(gather_health(comm_, mine), false, "shard");
    if (!v.ok) verdict = v;
  }
  std::string found_by = "shard check";
  // After a NaN/Inf or a spike: is the model itself damaged (a replica that differs, a weight
  // that no training produces), or was it the batch?
  if (!verdict && (nonfinite || spike)) {
    verdict = check_weights();
    found_by = nonfinite ? "NaN/Inf" : "spike";
  }
  if (verdict) {
    // The model is damaged, not the data: back to the last verified state, same batches.
    report_verdict(*verdict, next, found_by);
    if (!rollback(next, verdict->rule, {{"ranks", verdict->ranks}}, false))
      fail("step {}: {}; there is no verified checkpoint to roll back to, so the run stops", next,
           verdict->detail);
    return false;
  }
  if (spike) {
    if (rollback(next, spike->metric, spike->to_json(), true)) return false;
    // No checkpoint yet: the step is skipped instead.
    nonfinite = true;
  }
  if (!nonfinite) return true;
  ++skips_in_row_;
  ++skipped_total_;
  if (ddp_) ddp_->reset_compression();
  const std::string why =
      spike
          ? fmt::format("{} {:.4g} spikes above {:.4g} and there is no checkpoint to roll back to",
                        spike->metric, spike->value, spike->threshold)
          : std::string("NaN/Inf in the loss or the gradients");
  event("skipped_step", next, {{"reason", why}, {"in_a_row", skips_in_row_}},
        fmt::format("step {}: skipped ({}); weights, optimizer and schedule unchanged, batch "
                    "consumed ({} in a row)",
                    next, why, skips_in_row_));
  if (skips_in_row_ >= cfg_.guard.max_skips_in_row)
    fail(
        "step {}: {} optimizer steps in a row were skipped ({}; guard.max_skips_in_row is {}): "
        "stopping. Look at the data and the learning rate around this step; {}",
        next, skips_in_row_, why, cfg_.guard.max_skips_in_row, last_checkpoint_words());
  return false;
}

void Trainer::log_step(double loss, float lr, double norm, double tokens_per_s, int64_t trained) {
  StepMetrics m;
  m.step = step_;
  m.loss = loss;
  m.lr = lr;
  m.grad_norm = norm;
  m.tokens_per_s = tokens_per_s;
  m.peak_memory_bytes = alloc_->peak();
  m.extra["trained_tokens"] = trained;
  watch_gpus(m);
  if (metrics_) metrics_->log(m);
  if (progress_) progress_->update(m);
  result_.final_loss = loss;
}

// The check of the weights at rest (not sharded; every replica_check_every steps and before every
// checkpoint), and after a NaN/Inf or a spike: data-parallel replicas compare parameter hashes
// (one all-gather), and every rank scans its weights for implausible values and its frozen
// weights for any change.
std::optional<HealthVerdict> Trainer::check_weights() {
  RankHealth mine;
  if (ddp_) mine.hash = ops::hash64(weights());
  mine.implausible = ops::count_bad_values(weights(), kImplausibleWeight);
  mine.changed = ops::hash64(frozen_weights()) != frozen_ref_;
  HealthVerdict v = judge_health(gather_health(comm_, mine), ddp_ != nullptr, "frozen");
  if (v.ok) return std::nullopt;
  return v;
}

// found_by: what made the guard look ("check at rest", "shard check", "NaN/Inf", "spike").
void Trainer::report_verdict(const HealthVerdict& v, int64_t s, const std::string& found_by) {
  json fields = {{"ranks", v.ranks}, {"detail", v.detail}, {"found_by", found_by}};
  if (!v.hashes.empty()) {
    json h = json::array();
    for (uint64_t x : v.hashes) h.push_back(fmt::format("{:016x}", x));
    fields["hashes"] = h;
  }
  event(v.rule == "replica"   ? "replica_mismatch"
        : v.rule == "weights" ? "bad_weights"
                              : v.rule + "_mismatch",
        s, fields, fmt::format("step {}: {}", s, v.detail));
}

// Back to the newest verified checkpoint: weights, optimizer, data position, guard history.
// skip_window: the data is suspect, so the batches drawn since that checkpoint are skipped.
// Returns false when there is no checkpoint to go back to.
bool Trainer::rollback(int64_t at, const std::string& rule, json details, bool skip_window) {
  if (rollbacks_ >= cfg_.guard.max_rollbacks)
    fail(
        "step {}: the guard wants to roll back ({}), but the run has rolled back {} time(s), "
        "as many as guard.max_rollbacks allows; stopping for a human to look (metrics.jsonl "
        "lists every event); {}",
        at, rule, rollbacks_, last_checkpoint_words());
  const LoaderState after = loader_->state();
  const int64_t drawn = batches_drawn_;
  auto dir = choose_checkpoint();
  report_rejected();
  if (!dir) return false;
  LoadedCheckpoint back = load_checkpoint(*dir);
  restore(back);
  const bool reload = ops::hash64(frozen_weights()) != frozen_ref_;
  if (reload) reload_frozen();
  ++rollbacks_;
  if (ddp_) ddp_->reset_compression();
  int64_t skipped = 0;
  if (skip_window) {
    loader_->restore(after);
    skipped = drawn - batches_drawn_;
    batches_drawn_ = drawn;
  }
  skips_in_row_ = 0;
  if (metrics_) metrics_->rewind(step_);
  details["to_step"] = step_;
  details["rule"] = rule;
  details["skipped_batches"] = skipped;
  details["rollbacks"] = rollbacks_;
  if (reload) details["reloaded_frozen_weights"] = true;
  event("rollback", at, details,
        fmt::format("step {}: rolled back to step {} ({}){}; rollback {} of at most {}", at, step_,
                    rule,
                    skip_window ? fmt::format(", skipping the {} batch(es) drawn since", skipped)
                                : std::string(", replaying the same batches"),
                    rollbacks_, cfg_.guard.max_rollbacks));
  return true;
}

bool Trainer::check_due(int64_t s) const {
  const int64_t n = cfg_.guard.replica_check_every;
  return n > 0 && (s % n == 0 || (cfg_.save.every > 0 && s % cfg_.save.every == 0) || s == total_);
}

// Stopping on a signal: a checkpoint only from weights that pass the check at rest (every rank
// takes part: they agreed to stop at this step).
void Trainer::save_if_healthy() {
  if (!shard_ && cfg_.guard.replica_check_every > 0)
    if (auto bad = check_weights()) {
      report_verdict(*bad, step_, "check at rest");
      say(fmt::format("not saving a checkpoint from these weights; {}", last_checkpoint_words()));
      return;
    }
  save(step_);
}

std::string Trainer::last_checkpoint_words() const {
  auto l = latest_checkpoint(run_);
  return l ? fmt::format("the last checkpoint ({}) is intact; continue with rig train --resume {}",
                         l->dir, run_)
           : std::string("there is no checkpoint yet");
}

}  // namespace rig
