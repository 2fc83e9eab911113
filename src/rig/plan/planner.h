// `rig plan`: will a training setup fit, how fast will it run, which PSU, what it costs against
// the cloud, and how often to checkpoint. Every model is a closed-form formula documented in
// docs/plan.md; each number is in the JSON so it can be checked.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rig/model/config.h"
#include "rig/plan/catalog.h"
#include "rig/plan/memory.h"
#include "rig/plan/speed.h"

namespace rig::plan {

// GB/s per lane and direction after line encoding: gen3 0.985, gen4 1.969, gen5 3.938.
double pcie_lane_gbs(int gen);

struct PcieLink {
  int gen = 4, width = 16;
  bool via_chipset = false;  // behind the chipset's shared uplink
  std::string str() const;   // "gen4 x8 (chipset)"
};

// Slots a platform gives `n` cards, from its CPU lanes first: z790 (16 gen5 CPU lanes → x16, or
// x8/x8; more cards on gen4 x4 chipset slots behind DMI 4.0 x8), x670e, w3300 (Xeon W-3300, 64
// gen4 lanes), w790, epyc. Throws InputError when the platform has no room for n cards.
std::vector<PcieLink> platform_links(const std::string& platform, int n,
                                     double* chipset_uplink_gbs);
// "gen4x8,gen4x8,gen4x4" (one per card) or one entry for all cards.
std::vector<PcieLink> parse_pcie(const std::string& text, int n);

// Seconds for NCCL collectives of `bytes` (the buffer size, nccl-tests' "size") over n ranks at a
// bus bandwidth in GB/s: all-reduce busbw = algbw·2(n−1)/n; all-gather and reduce-scatter
// busbw = algbw·(n−1)/n.
double allreduce_seconds(double bytes, int n, double busbw_gbs);
double allgather_seconds(double bytes, int n, double busbw_gbs);

struct GpuCount {
  std::string gpu;
  int count = 0;
};
// "4x4090", "2x4090,1x3090", "4090" (one card).
std::vector<GpuCount> parse_gpus(const std::string& text);

struct Network {
  std::string kind = "none";  // eth (TCP), roce, ib
  double gbps = 0;            // line rate, Gbit/s
  double efficiency = 0;      // achievable fraction of line rate
};
Network parse_network(const std::string& text);  // "roce:40", "ib:200", "eth:10"

struct PlanInput {
  ModelConfig model;
  std::string model_name;
  TrainSetup setup;  // world_size is set from gpus × nodes
  std::string gpus = "1x4090";
  int nodes = 1;
  std::string platform;             // empty: every card at x16 of its own generation
  std::string pcie;                 // overrides platform
  bool nvlink = false;              // NVLink bridges installed (2 cards per node)
  std::string network;              // between nodes
  double pcie_efficiency = 0.75;    // bus bandwidth / raw link rate for NCCL over PCIe
  double nvlink_efficiency = 0.80;  // same over NVLink
  // Achieved / peak dense bf16 TFLOPS for every card; 0: rig's measured efficiency for each card
  // and the method (speed.h: the calibration's, else the built-in table's, else an estimate).
  double efficiency = 0;
  std::vector<MeasuredEfficiency> calibration;  // `rig plan --calibrate`: read_calibration()
  double overlap = 0.0;                         // fraction of communication hidden behind compute
  double max_memory = 0;                        // bytes usable per card; 0: the card's memory
  double tokens = 1e9;                          // training tokens of the job
  double job_hours = 0;                         // override the computed job time (0: from tokens)
  // power
  double system_w = 300;             // CPU, board, disks, fans per node
  double psu_w = 0;                  // 0: not checked
  double power_limit_w = 0;          // per card; 0: TDP
  double power_perf_exponent = 0.2;  // throughput ∝ (limit/TDP)^exponent
  // reliability
  double fit_per_gb = -1;             // <0: the catalog's, for cards without ECC
  double other_mtbf_hours = 0;        // other failures of the whole system; 0: none counted
  double checkpoint_write_gbs = 2.0;  // disk write speed
  double checkpoint_seconds = 0;      // override the computed write time
  // cost (money in `currency`; catalog USD × fx)
  std::string currency = "USD";
  double fx = 1.0;
  double hardware_cost = -1;  // <0: GPUs from the catalog + platform_cost
  double platform_cost = -1;  // <0: 2000 USD × fx per node
  double kwh_price = -1;      // <0: 0.15 USD × fx
  double resale_fraction = 0.5;
  std::string cloud_gpu = "a100-80gb";
  int cloud_count = 0;         // 0: same number of GPUs
  double cloud_price = -1;     // per GPU-hour; <0: catalog × fx
  double cloud_job_hours = 0;  // override (0: from tokens and the cloud card's speed)
};

struct Flops {
  double matmul = 0, lora = 0, attention = 0, recompute = 0;
  double per_token() const { return matmul + lora + attention + recompute; }
};
// FLOPs per trained token: full 6N, LoRA/QLoRA 4N (frozen weights get no weight gradient) + 6 per
// LoRA parameter, attention 12·layers·q_dim·seq, full checkpointing one more forward of the layers
// that recompute.
// N counts the matmul weights: the decoder layers' linears and the LM head (not the lookup).
Flops flops_per_token(const ModelConfig& m, const TrainSetup& s);
// The same with the LoRA parameter count and the span a token attends over given (a row packed
// with documents attends over each document, not the row): what a `rig bench train` record ran.
Flops flops_per_token(const ModelConfig& m, const TrainSetup& s, double lora_params,
                      double attention_span);

struct GroupPlan {  // one kind of card
  const GpuSpec* gpu = nullptr;
  int count = 0;
  std::vector<PcieLink> links;
  double budget = 0;  // bytes usable
  bool fits = false;
  double efficiency = 0;             // achieved / peak dense bf16 on this card
  std::string efficiency_source;     // measured, calibrated, --efficiency or an estimate
  bool efficiency_estimate = false;  // extrapolated from another card
  double tflops = 0;                 // effective, after efficiency and power limit
  double tokens_per_s = 0;           // per card, compute only
};

struct Plan {
  PlanInput in;
  int world = 1;
  MemoryEstimate memory;
  std::vector<GroupPlan> groups;
  bool fits = false;
  int64_t max_micro_batch = 0, max_seq_len = 0;  // at the given seq_len / micro_batch
  Flops flops;
  // speed
  double step_compute_s = 0, comm_bytes = 0, busbw_gbs = 0, comm_s = 0, comm_share = 0;
  double step_s = 0, tokens_per_step = 0, tokens_per_s = 0, job_hours = 0;
  std::string comm_kind, comm_path;
  // power, per node
  double sustained_w = 0, transient_w = 0, psu_recommended_w = 0, power_saving_w = 0;
  int full_load_cards = -1;
  // reliability
  double fit_total = 0, mtbf_hours = 0, expected_bit_errors = 0, p_bit_error = 0;
  double checkpoint_bytes = 0, checkpoint_s = 0, failure_mtbf_hours = 0, young_daly_s = 0;
  // cost
  double hardware = 0, resale = 0, energy_kwh = 0, electricity = 0, buy_total = 0;
  double cloud_tokens_per_s = 0, cloud_hours = 0, cloud_price = 0, cloud_total = 0;
  double break_even_hours = -1;  // hours of own-hardware work where buying gets cheaper
  std::vector<std::string> warnings;

  nlohmann::json to_json() const;
  std::string to_text() const;
};

Plan make_plan(const PlanInput& in, const Catalog& catalog);

}  // namespace rig::plan
