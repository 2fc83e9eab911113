// rig plan: memory, speed, power, reliability and cost of a fine-tuning setup, before buying or
// renting anything. The models live in src/rig/plan; this file parses flags and prints.
#include <iostream>

#include "command.h"
#include "flags.h"
#include "rig/core/allocator.h"
#include "rig/plan/from_config.h"
#include "rig/plan/models.h"
#include "rig/plan/planner.h"

namespace {

using namespace rig::plan;

struct Flags {
  std::string model = "llama3-8b", method = "qlora", targets = "q,k,v,o", ckpt = "full";
  std::string optimizer = "adamw", strategy = "data-parallel", precision = "bf16";
  std::vector<std::string> catalogs;
  std::string calibrate;  // a file of `rig bench train --json` lines
  std::string config;     // a training config whose job is planned
  bool json = false, eager = false;
  PlanInput in;
};

// Fills what the command line left unset from a training config: the job as `rig train` would
// run it (the GPUs are not in a config: --gpus, default one 4090).
void apply_config(Flags& f, const CLI::App& app) {
  const rig::TrainConfig c = rig::load_train_config(f.config);
  const TrainSetup cs = train_setup_of(c);
  auto unset = [&](const char* flag) { return app.count(flag) == 0; };
  PlanInput& in = f.in;
  TrainSetup& s = in.setup;
  if (unset("--model")) {
    in.model = model_of(c);
    f.model = c.model.empty() ? c.architecture_name : c.model;
  }
  if (unset("--method")) f.method = to_string(cs.method);
  if (unset("--rank")) s.lora_rank = cs.lora_rank;
  if (unset("--targets")) f.targets = lora_targets_string(cs.lora_targets);
  if (unset("--seq")) s.seq_len = cs.seq_len;
  if (unset("--micro-batch")) s.micro_batch = cs.micro_batch;
  if (unset("--grad-accum")) s.grad_accum = cs.grad_accum;
  if (unset("--checkpointing")) f.ckpt = to_string(cs.checkpointing);
  if (unset("--recompute-layers")) s.recompute_layers = cs.recompute_layers;
  if (unset("--optimizer")) f.optimizer = to_string(cs.optimizer);
  if (unset("--strategy")) f.strategy = to_string(cs.strategy);
  if (unset("--precision")) f.precision = to_string(cs.precision);
  s.bucket_bytes = cs.bucket_bytes;
  if (unset("--max-memory") && c.max_memory) in.max_memory = double(c.max_memory);
}

int run_plan(Flags f) {
  Catalog catalog = Catalog::builtin();
  for (const auto& c : f.catalogs) catalog.merge_file(c);
  PlanInput in = f.in;
  if (!in.model.num_layers) in.model = resolve_model(f.model);  // else from --config
  in.model_name = f.model;
  TrainSetup& s = in.setup;
  s.method = parse_method(f.method);
  s.lora_targets = parse_lora_targets(f.targets);
  s.checkpointing = parse_checkpointing(f.ckpt);
  s.optimizer = parse_optimizer(f.optimizer);
  s.strategy = parse_strategy(f.strategy);
  s.precision = parse_precision(f.precision);
  s.flash_attention = !f.eager;
  if (s.precision == Precision::fp32) s.context_bytes = s.gemm_workspace_bytes = 0;
  if (!f.calibrate.empty()) {
    // A record that names no GPU is taken as the first card of --gpus.
    const std::string first = catalog.find(parse_gpus(in.gpus).front().gpu).key;
    in.calibration = read_calibration(f.calibrate, s.method, first, catalog);
  }
  Plan p = make_plan(in, catalog);
  if (f.json)
    std::cout << p.to_json().dump(1) << "\n";
  else
    std::cout << p.to_text();
  return 0;
}

rig::cli::Registrar reg(
    "plan", "Will it fit, how fast, which PSU, what it costs: plan a fine-tuning run",
    [](CLI::App& app) {
      using namespace rig::cli;
      auto f = std::make_shared<Flags>();
      PlanInput& in = f->in;
      TrainSetup& s = in.setup;
      app.add_option("--model,-m", f->model,
                     "built-in shape (llama3-1b/3b/8b/70b, qwen2.5-7b/14b/32b/72b, mistral-7b), "
                     "config.json or model folder")
          ->capture_default_str();
      app.add_option("--method", f->method, "full, lora or qlora")->capture_default_str();
      add_number(app, "--rank,-r", s.lora_rank, "LoRA rank", in_range(1, 65536))
          ->capture_default_str();
      app.add_option("--targets", f->targets, "LoRA targets among q,k,v,o,gate,up,down (or all)")
          ->capture_default_str();
      add_number(app, "--seq,-s", s.seq_len, "sequence length", in_range(1, 1 << 24))
          ->capture_default_str();
      add_number(app, "--micro-batch,-b", s.micro_batch, "sequences per GPU per micro-step",
                 in_range(1, 1 << 16))
          ->capture_default_str();
      add_number(app, "--grad-accum", s.grad_accum, "micro-steps per optimizer step",
                 in_range(1, 1 << 20))
          ->capture_default_str();
      app.add_option("--checkpointing", f->ckpt, "activation checkpointing: none, full, selective")
          ->capture_default_str();
      add_number(app, "--recompute-layers", s.recompute_layers,
                 "with full checkpointing: layers that recompute their forward, the rest "
                 "selective (-1: all)",
                 in_range(-1, 1 << 16))
          ->capture_default_str();
      app.add_option("--optimizer", f->optimizer, "adamw (fp32 states) or adamw8bit")
          ->capture_default_str();
      app.add_option("--strategy", f->strategy, "data-parallel (ddp) or sharded (fsdp)")
          ->capture_default_str();
      app.add_option("--precision", f->precision, "bf16 (GPU engine) or fp32 (CPU engine)")
          ->capture_default_str();
      app.add_flag("--eager-attention", f->eager, "attention saves its T x T probabilities");
      add_number(app, "--loss-chunk", s.loss_chunk_tokens, "tokens per logits chunk of the loss",
                 in_range(0, 1 << 30))
          ->capture_default_str();
      app.add_option("--gpus,-g", in.gpus, "cards per node: 4x4090 or 2x4090,1x3090")
          ->capture_default_str();
      add_number(app, "--nodes", in.nodes, "nodes", in_range(1, 1 << 16))->capture_default_str();
      app.add_option("--platform", in.platform,
                     "lanes from a platform: z790, x670e, w3300, w790, epyc");
      app.add_option("--pcie", in.pcie, "links per card: gen4x8,gen4x8,gen4x4c,... (c: chipset)");
      app.add_flag("--nvlink", in.nvlink, "NVLink bridges installed (pairs of 3090/A6000)");
      app.add_option("--network", in.network, "between nodes: eth:10, roce:40, ib:200 (Gbit/s)");
      app.add_option("--catalog", f->catalogs, "YAML file adding or overriding GPUs (repeatable)");
      add_size(app, "--max-memory", in.max_memory,
               "usable memory per card, e.g. 22GiB (default: the card's)",
               SizeRule{.min = 1, .max = 0x1p50, .binary = false});
      auto* eff = add_number(app, "--efficiency", in.efficiency,
                             "achieved fraction of dense bf16 TFLOPS on every card (default: rig's "
                             "measured efficiency for the card and method, docs/plan.md)",
                             in_range(0, 1).open_low());
      app.add_option("--calibrate", f->calibrate,
                     "FILE of `rig bench train --json` lines measured on your card: their "
                     "efficiency replaces the built-in table's for --method")
          ->excludes(eff);
      add_number(app, "--overlap", in.overlap, "fraction of communication hidden by compute",
                 in_range(0, 1))
          ->capture_default_str();
      add_number(app, "--tokens", in.tokens, "training tokens of the job", positive())
          ->capture_default_str();
      add_number(app, "--hours", in.job_hours, "job duration on this hardware (overrides --tokens)",
                 at_least(0));
      add_number(app, "--psu", in.psu_w, "PSU watts per node to check", at_least(0));
      add_number(app, "--power-limit", in.power_limit_w, "per-card power limit, watts",
                 at_least(0));
      add_number(app, "--system-watts", in.system_w, "CPU, board, disks, fans per node",
                 at_least(0))
          ->capture_default_str();
      add_number(app, "--fit-per-gb", in.fit_per_gb, "bit-error rate of non-ECC memory, FIT per GB",
                 at_least(0));
      add_number(app, "--mtbf-hours", in.other_mtbf_hours,
                 "MTBF of other failures (crashes, power)", at_least(0));
      add_number(app, "--checkpoint-gbs", in.checkpoint_write_gbs, "checkpoint write speed, GB/s",
                 positive())
          ->capture_default_str();
      add_number(app, "--checkpoint-seconds", in.checkpoint_seconds, "checkpoint write time",
                 at_least(0));
      app.add_option("--currency", in.currency, "label for money")->capture_default_str();
      add_number(app, "--fx", in.fx, "currency units per USD for catalog prices", positive())
          ->capture_default_str();
      add_number(app, "--hardware-cost", in.hardware_cost, "whole machine price (default: catalog)",
                 at_least(0));
      add_number(app, "--platform-cost", in.platform_cost,
                 "non-GPU parts per node (default 2000 USD)", at_least(0));
      add_number(app, "--kwh-price", in.kwh_price, "electricity per kWh (default 0.15 USD)",
                 at_least(0));
      add_number(app, "--resale", in.resale_fraction, "fraction of hardware cost recovered",
                 in_range(0, 1))
          ->capture_default_str();
      app.add_option("--cloud-gpu", in.cloud_gpu, "cloud card to compare")->capture_default_str();
      add_number(app, "--cloud-gpus", in.cloud_count, "cloud cards (default: same count)",
                 in_range(0, 1 << 20));
      add_number(app, "--cloud-price", in.cloud_price, "cloud price per GPU-hour", at_least(0));
      add_number(app, "--cloud-hours", in.cloud_job_hours, "job duration in the cloud",
                 at_least(0));
      app.add_flag("--json", f->json, "print every number as one JSON object");
      app.add_option("--config,-c", f->config,
                     "a training config (YAML): its model, method, LoRA, sequence, batch, "
                     "checkpointing, optimizer, strategy and max_memory, where no flag says "
                     "otherwise")
          ->check(CLI::ExistingFile);
      return [f, a = &app] {
        if (!f->config.empty()) apply_config(*f, *a);
        return run_plan(*f);
      };
    });

}  // namespace
