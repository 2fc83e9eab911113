// train(): a Trainer's setup, its loop of optimizer steps with evaluations and checkpoints, and
// the final output; plus the run's log (metrics.jsonl, train.log, the console) and GPU telemetry.
#include "rig/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "rig/core/allocator.h"
#include "rig/plan/from_config.h"
#include "rig/train/trainer_impl.h"

namespace rig {

using json = nlohmann::json;

namespace {

// How often a paused run looks at the temperature again (RIG_THERMAL_POLL_MS for tests).
int cfg_pause_poll_ms() {
  const char* v = std::getenv("RIG_THERMAL_POLL_MS");
  return v ? std::max(1, std::atoi(v)) : 1000;
}

}  // namespace

TrainResult train(const TrainConfig& cfg, const TrainHooks& hooks) {
  Trainer t(cfg, hooks);
  return t.run();
}

TrainResult Trainer::run() {
  setup_peak_reserved_ = alloc_->peak_reserved();
  alloc_->reset_peak();
  if (!resumed_ && cfg_.eval.every > 0) run_eval(0, false);  // the starting point of the curve
  while (step_ < total_) {
    const Attempt a = step_once();
    if (a == Attempt::Stopped) break;
    if (a == Attempt::Retried) continue;
    if (cfg_.eval.every > 0 && step_ % cfg_.eval.every == 0 && step_ < total_)
      run_eval(step_, false);
    if (cfg_.save.every > 0 && step_ % cfg_.save.every == 0 && step_ < total_) save(step_);
  }
  result_.steps = step_;
  result_.skipped_steps = skipped_total_;
  result_.rollbacks = rollbacks_;
  if (progress_) progress_->finish();
  report_rank_memory();
  if (result_.interrupted) return result_;
  save(step_);
  write_final();
  return result_;
}

// Only rank 0 writes the run folder and shows progress.
void Trainer::open_run_log() {
  if (lead_) metrics_ = std::make_unique<MetricsWriter>(run_, ckpt_ ? step_ : -1);
  note(fmt::format("device {}, {} compute", dev_.str(), precision_));
  if (comm_)
    note(fmt::format("{} ranks, {}: global batch {} x {} x {} rows", world_, strategy_name_,
                     cfg_.micro_batch_size, cfg_.gradient_accumulation_steps, world_));
  if (!placement_.empty()) note(placement_);
  note(fmt::format(
      "{} {} steps {} of {}: {} parameters ({} trainable), {} training samples "
      "({} tokens), {} held out",
      ckpt_ ? "resuming" : "starting", cfg_.method, step_, total_, n_params_, n_trainable_,
      data_.train->size(), data_.train->num_tokens(), data_.eval ? data_.eval->size() : 0));
  for (const auto& t : data_.templates) note("chat template of " + t);
  note_planned_memory();
  if (!hooks_.quiet && lead_) progress_ = std::make_unique<Progress>(total_, step_);
  report_rejected();
  if (ckpt_) {
    event("resumed", step_, {{"from", ckpt_->dir}},
          fmt::format("resumed from {} at step {}", ckpt_->dir, step_));
    ckpt_.reset();  // drops the mapping of its files
  }
}

// What `rig plan` predicts for this job per rank, beside max_memory: a job that cannot fit is
// told so before its first step, not by an out-of-memory stop minutes later.
void Trainer::note_planned_memory() {
  plan::TrainSetup s = plan::train_setup_of(cfg_);
  s.world_size = world_;
  s.precision = plan::parse_precision(precision_);
  if (!dev_.is_cuda()) s.context_bytes = s.gemm_workspace_bytes = 0;  // the CPU engine's pool
  double peak = 0;
  try {
    peak = plan::estimate_memory(model_->config(), s).allocator_peak();
  } catch (const std::exception& e) {
    note(fmt::format("rig plan cannot predict this job's memory: {}", e.what()));
    return;
  }
  const double budget = double(max_memory_);
  if (!max_memory_) {
    note(fmt::format("rig plan predicts a peak of {} per rank", format_bytes(peak)));
  } else if (peak <= budget) {
    note(fmt::format("rig plan predicts a peak of {} per rank, within max_memory {}",
                     format_bytes(peak), format_bytes(budget)));
  } else {
    say(
        fmt::format("warning: rig plan predicts a peak of {} per rank, over max_memory {}: "
                    "expect an out-of-memory stop (activation_checkpointing: full, a smaller "
                    "micro_batch_size or sequence_len; `rig plan --config` shows what fits)",
                    format_bytes(peak), format_bytes(budget)));
  }
}

void Trainer::report_rank_memory() {
  if (!dev_.is_cuda()) return;
  constexpr double kGiB = double(1 << 30);
  const std::vector<float> mine = {
      float(double(std::max(setup_peak_reserved_, alloc_->peak_reserved())) / kGiB),
      float(double(alloc_->peak()) / kGiB)};
  std::vector<float> all = mine;
  if (comm_) {
    Tensor in = Tensor::from_f32(mine, {2});
    Tensor out = Tensor::empty({2 * world_}, DType::F32, comm_->device(), "memory");
    comm_->all_gather(in.to(comm_->device(), "memory"), out);
    Tensor h = out.to(Device::cpu(), "memory");
    all.assign(h.f32(), h.f32() + h.numel());
  }
  json reserved = json::array(), used = json::array();
  std::string words;
  for (size_t r = 0; r < all.size() / 2; ++r) {
    reserved.push_back(std::round(all[2 * r] * 1000) / 1000);
    used.push_back(std::round(all[2 * r + 1] * 1000) / 1000);
    words += fmt::format("{}{:.2f}", r ? ", " : "", all[2 * r]);
  }
  json fields = {{"peak_reserved_gib", reserved}, {"peak_in_use_gib", used}};
  std::string budget;
  if (max_memory_) {
    fields["budget_gib"] = double(max_memory_) / kGiB;
    budget = fmt::format(" (max_memory {:.2f} GiB)", double(max_memory_) / kGiB);
  }
  event("memory", step_, fields,
        fmt::format("peak reserved device memory per rank: {} GiB{}", words, budget));
}

void Trainer::note(const std::string& s) {
  if (metrics_) metrics_->note(s);
}

void Trainer::say(const std::string& s) {
  note(s);
  if (progress_) progress_->message(s);
}

// An event line in metrics.jsonl, the same in words in train.log and on the console.
void Trainer::event(const std::string& name, int64_t s, const json& fields,
                    const std::string& text) {
  if (metrics_) metrics_->event(name, s, fields, text);
  if (progress_) progress_->message(text);
}

void Trainer::report_rejected() {
  for (const auto& r : rejected_)
    event("checkpoint_rejected", r.step, {{"moved_to", r.dir}, {"problems", r.problems}},
          fmt::format("checkpoint step-{} fails verification ({}); set aside as {}", r.step,
                      r.problems.front(), r.dir));
  rejected_.clear();
}

void Trainer::log_fault(const Injection& i, int64_t s) {
  event("inject", s, {{"kind", fault_name(i.kind)}, {"rank", i.rank}, {"spec", i.spec}},
        fmt::format("injecting fault {} (rank {}) at step {}", fault_name(i.kind), i.rank, s));
}

// GPU telemetry in every metrics line, and the thermal pause, wherever NVML answers.
void Trainer::open_telemetry() {
  try {
    telemetry_.emplace(hw::Telemetry::open());
  } catch (const Error& e) {
    note(fmt::format("no GPU telemetry: {}", e.what()));
  }
  if (telemetry_ && cfg_.thermal.pause_above_c > 0)
    thermal_.emplace(cfg_.thermal.pause_above_c, cfg_.thermal.resume_below_c > 0
                                                     ? cfg_.thermal.resume_below_c
                                                     : cfg_.thermal.pause_above_c - 8);
}

void Trainer::watch_gpus(StepMetrics& m) {
  if (!telemetry_) return;
  hw::StepSummary g = hw::Telemetry::summarize(telemetry_->sample());
  m.extra["gpu"] = g.to_json();
  // Sustained thermal throttling: say so once per streak.
  throttled_steps_ = g.thermal_throttle ? throttled_steps_ + 1 : 0;
  if (throttled_steps_ == 10)
    say(fmt::format(
        "warning: GPU {} has been thermally throttled for 10 steps ({:.0f} C); check cooling and "
        "fan curves",
        g.hottest_gpu, g.max_temp_c.value_or(0)));
  if (!thermal_ || !thermal_->update(g)) return;
  say(fmt::format("pausing: GPU {} at {:.0f} C is above {:.0f} C; resuming below {:.0f} C",
                  g.hottest_gpu, g.max_temp_c.value_or(0), thermal_->pause_at(),
                  thermal_->resume_below()));
  while (thermal_->update(g) && !(hooks_.should_stop && hooks_.should_stop())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(cfg_pause_poll_ms()));
    g = hw::Telemetry::summarize(telemetry_->sample());
  }
  say(fmt::format("resuming at {:.0f} C", g.max_temp_c.value_or(0)));
}

}  // namespace rig
