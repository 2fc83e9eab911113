// rig train CONFIG.yaml [--set key=value ...] [--output DIR] | rig train --resume RUN_DIR
// [--nproc-per-node N ...]: the command relaunches itself as N workers, one rank each.
#include <csignal>
#include <filesystem>
#include <unistd.h>

#include "command.h"
#include "launch_flags.h"
#include "rig/dist/env.h"
#include "rig/train/trainer.h"

namespace {

std::atomic<int> g_signals{0};

// The first SIGINT/SIGTERM asks the loop to checkpoint and stop; a second one exits at once
// (every file write is atomic, so nothing is left half-written).
void on_signal(int sig) {
  if (g_signals.fetch_add(1) > 0) _exit(128 + sig);
}

struct Opts {
  std::string config, output, resume;
  std::vector<std::string> set, inject;
  bool quiet = false;
  rig::cli::LaunchFlags launch;
};

int run(const Opts& o) {
  namespace fs = std::filesystem;
  std::vector<std::string> overrides = o.set;
  std::string config = o.config;
  if (!o.resume.empty()) {
    if (!config.empty()) rig::bad_input("give either CONFIG or --resume RUN_DIR, not both");
    config = (fs::path(o.resume) / "config.yaml").string();
    if (!fs::exists(config)) rig::bad_input("{}: not a run folder (no config.yaml)", o.resume);
    overrides.push_back("output_dir=" + o.resume);
    overrides.push_back("resume=auto");
  } else if (config.empty()) {
    rig::bad_input("rig train needs a CONFIG file (or --resume RUN_DIR)");
  }
  if (!o.output.empty()) overrides.push_back("output_dir=" + o.output);
  rig::TrainConfig cfg = rig::load_train_config(config, overrides);
  // Injected faults belong to the command that asked for them: a resumed run does not replay the
  // ones its config.yaml records (a kill would kill it again), only those given now.
  if (!o.resume.empty()) cfg.inject.clear();
  cfg.inject.insert(cfg.inject.end(), o.inject.begin(), o.inject.end());
  cfg.validate();
  // The config is checked once here, before any worker starts.
  if (o.launch.wants_launch()) return o.launch.relaunch();
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  rig::TrainHooks hooks;
  hooks.should_stop = [] { return g_signals.load() > 0; };
  hooks.quiet = o.quiet;
  rig::TrainResult r = rig::train(cfg, hooks);
  if (rig::dist::env_from_process().rank != 0) return r.interrupted ? 130 : 0;  // rank 0 reports
  if (r.interrupted) {
    fmt::print(stderr, "stopped at step {}; continue with: rig train --resume {}\n", r.steps, cfg.output_dir);
    return 130;
  }
  fmt::print("trained {} steps; final loss {:.4f}", r.steps, r.final_loss);
  if (r.skipped_steps > 0 || r.rollbacks > 0)
    fmt::print(" ({} step(s) skipped, {} rollback(s); see metrics.jsonl)", r.skipped_steps,
               r.rollbacks);
  if (r.eval_loss >= 0) fmt::print(", held-out loss {:.4f}", r.eval_loss);
  fmt::print("\n");
  if (r.exact_match >= 0) {
    fmt::print("held-out exact match: {:.1f}%\n", 100 * r.exact_match);
    for (const auto& s : r.samples) fmt::print("  {}\n", s);
  }
  fmt::print("result: {}\n", r.output);
  return 0;
}

rig::cli::Registrar reg("train", "Train a model (full or LoRA) from a YAML config", [](CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("config", o->config, "training config (YAML)");
  app.add_option("--set", o->set, "override a key: --set lora.r=8 (repeatable)");
  app.add_option("--output", o->output, "run folder (overrides output_dir)");
  app.add_option("--inject", o->inject,
                 "inject a fault: KIND@STEP[:RANK], KIND one of nan-grad, bit-flip, "
                 "bit-flip-frozen, loss-spike, kill, kill-during-save, corrupt-checkpoint "
                 "(repeatable; docs/reliability.md)");
  app.add_option("--resume", o->resume, "continue the run in this folder from its last checkpoint");
  app.add_flag("--quiet", o->quiet, "no progress display");
  o->launch.add(app);
  return [o] { return run(*o); };
});

}  // namespace
