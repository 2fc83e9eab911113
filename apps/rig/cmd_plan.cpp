// rig plan: memory, speed, power, reliability and cost of a fine-tuning setup, before buying or
// renting anything. The models live in src/rig/plan; this file parses flags and prints.
#include <iostream>

#include "command.h"
#include "rig/core/allocator.h"
#include "rig/plan/models.h"
#include "rig/plan/planner.h"

namespace {

using namespace rig::plan;

struct Flags {
  std::string model = "llama3-8b", method = "qlora", targets = "q,k,v,o", ckpt = "full";
  std::string optimizer = "adamw", strategy = "data-parallel", precision = "bf16";
  std::string max_memory;
  std::vector<std::string> catalogs;
  bool json = false, eager = false;
  PlanInput in;
};

int run_plan(Flags f) {
  Catalog catalog = Catalog::builtin();
  for (const auto& c : f.catalogs) catalog.merge_file(c);
  PlanInput in = f.in;
  in.model = resolve_model(f.model);
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
  if (!f.max_memory.empty()) in.max_memory = double(rig::parse_bytes(f.max_memory, "--max-memory"));
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
      auto f = std::make_shared<Flags>();
      PlanInput& in = f->in;
      TrainSetup& s = in.setup;
      app.add_option("--model,-m", f->model,
                     "built-in shape (llama3-1b/3b/8b/70b, qwen2.5-7b/14b/32b/72b, mistral-7b), "
                     "config.json or model folder")
          ->capture_default_str();
      app.add_option("--method", f->method, "full, lora or qlora")->capture_default_str();
      app.add_option("--rank,-r", s.lora_rank, "LoRA rank")->capture_default_str();
      app.add_option("--targets", f->targets, "LoRA targets among q,k,v,o,gate,up,down (or all)")
          ->capture_default_str();
      app.add_option("--seq,-s", s.seq_len, "sequence length")->capture_default_str();
      app.add_option("--micro-batch,-b", s.micro_batch, "sequences per GPU per micro-step")
          ->capture_default_str();
      app.add_option("--grad-accum", s.grad_accum, "micro-steps per optimizer step")
          ->capture_default_str();
      app.add_option("--checkpointing", f->ckpt, "activation checkpointing: none, full, selective")
          ->capture_default_str();
      app.add_option("--recompute-layers", s.recompute_layers,
                     "with full checkpointing: layers that recompute their forward, the rest "
                     "selective (-1: all)")
          ->capture_default_str();
      app.add_option("--optimizer", f->optimizer, "adamw (fp32 states) or adamw8bit")
          ->capture_default_str();
      app.add_option("--strategy", f->strategy, "data-parallel (ddp) or sharded (fsdp)")
          ->capture_default_str();
      app.add_option("--precision", f->precision, "bf16 (GPU engine) or fp32 (CPU engine)")
          ->capture_default_str();
      app.add_flag("--eager-attention", f->eager, "attention saves its T x T probabilities");
      app.add_option("--loss-chunk", s.loss_chunk_tokens, "tokens per logits chunk of the loss")
          ->capture_default_str();
      app.add_option("--gpus,-g", in.gpus, "cards per node: 4x4090 or 2x4090,1x3090")
          ->capture_default_str();
      app.add_option("--nodes", in.nodes, "nodes")->capture_default_str();
      app.add_option("--platform", in.platform,
                     "lanes from a platform: z790, x670e, w3300, w790, epyc");
      app.add_option("--pcie", in.pcie, "links per card: gen4x8,gen4x8,gen4x4c,... (c: chipset)");
      app.add_flag("--nvlink", in.nvlink, "NVLink bridges installed (pairs of 3090/A6000)");
      app.add_option("--network", in.network, "between nodes: eth:10, roce:40, ib:200 (Gbit/s)");
      app.add_option("--catalog", f->catalogs, "YAML file adding or overriding GPUs (repeatable)");
      app.add_option("--max-memory", f->max_memory, "usable memory per card, e.g. 22GiB");
      app.add_option("--efficiency", in.efficiency, "achieved fraction of dense bf16 TFLOPS")
          ->capture_default_str();
      app.add_option("--overlap", in.overlap, "fraction of communication hidden by compute")
          ->capture_default_str();
      app.add_option("--tokens", in.tokens, "training tokens of the job")->capture_default_str();
      app.add_option("--hours", in.job_hours, "job duration on this hardware (overrides --tokens)");
      app.add_option("--psu", in.psu_w, "PSU watts per node to check");
      app.add_option("--power-limit", in.power_limit_w, "per-card power limit, watts");
      app.add_option("--system-watts", in.system_w, "CPU, board, disks, fans per node")
          ->capture_default_str();
      app.add_option("--fit-per-gb", in.fit_per_gb, "bit-error rate of non-ECC memory, FIT per GB");
      app.add_option("--mtbf-hours", in.other_mtbf_hours,
                     "MTBF of other failures (crashes, power)");
      app.add_option("--checkpoint-gbs", in.checkpoint_write_gbs, "checkpoint write speed, GB/s")
          ->capture_default_str();
      app.add_option("--checkpoint-seconds", in.checkpoint_seconds, "checkpoint write time");
      app.add_option("--currency", in.currency, "label for money")->capture_default_str();
      app.add_option("--fx", in.fx, "currency units per USD for catalog prices")
          ->capture_default_str();
      app.add_option("--hardware-cost", in.hardware_cost, "whole machine price (default: catalog)");
      app.add_option("--platform-cost", in.platform_cost,
                     "non-GPU parts per node (default 2000 USD)");
      app.add_option("--kwh-price", in.kwh_price, "electricity per kWh (default 0.15 USD)");
      app.add_option("--resale", in.resale_fraction, "fraction of hardware cost recovered")
          ->capture_default_str();
      app.add_option("--cloud-gpu", in.cloud_gpu, "cloud card to compare")->capture_default_str();
      app.add_option("--cloud-gpus", in.cloud_count, "cloud cards (default: same count)");
      app.add_option("--cloud-price", in.cloud_price, "cloud price per GPU-hour");
      app.add_option("--cloud-hours", in.cloud_job_hours, "job duration in the cloud");
      app.add_flag("--json", f->json, "print every number as one JSON object");
      return [f] { return run_plan(*f); };
    });

}  // namespace
