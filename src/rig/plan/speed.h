// How fast rig itself trains: the planner's tokens/s come from rig's measured efficiency per GPU
// and method, not from a guessed fraction of peak.
//
// Efficiency = measured tokens/s × FLOPs per token (flops_per_token(), the planner's own count,
// recompute included) / (the card's dense bf16 peak). The built-in table (speed.cpp) holds the
// values derived that way from `rig bench train` records (bench/results/*.jsonl, docs/qlora.md),
// each with where it came from; `rig plan --calibrate FILE` derives the same from a user's own
// `rig bench train --json` lines. A card that was not measured gets an estimate extrapolated from
// a measured one by peak bf16 FLOPs and memory bandwidth (extrapolate_efficiency). docs/plan.md
// has the table, the derivation and the plan-against-bench check.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "rig/model/config.h"
#include "rig/plan/catalog.h"
#include "rig/plan/memory.h"

namespace rig::plan {

// rig's efficiency on one kind of card for one method.
struct MeasuredEfficiency {
  std::string gpu;  // catalog key of the card it ran on
  Method method = Method::lora;
  double efficiency = 0;  // measured tokens/s × FLOPs per token / (bf16_tflops × 1e12)
  // Share of the step spent in memory-bound work (element-wise ops, norms, loss, optimizer,
  // products with a dimension ≤ 64 such as LoRA's, time between ops), from the record's
  // profiled breakdown; what scales with memory bandwidth instead of peak FLOPs when the
  // efficiency is carried to another card.
  double memory_share = 0;
  std::string source;  // where the number comes from: file:line, date, GPU, configuration
};

// The built-in table: one entry per measured card and method (speed.cpp lists the records).
const std::vector<MeasuredEfficiency>& builtin_efficiencies();

// The efficiency on `target` of a measurement `ref` taken on `ref_gpu`: the compute-bound part of
// the step, (1 − memory_share), scales with peak bf16 FLOPs, the memory-bound part with memory
// bandwidth:
//   e_target = e_ref / ((1 − s) + s · (peak_target / peak_ref) · (bw_ref / bw_target)).
// An estimate: it assumes the products and attention reach the same fraction of peak on both
// cards. A card without a bandwidth in the catalog keeps e_ref. Capped at 1.
double extrapolate_efficiency(const MeasuredEfficiency& ref, const GpuSpec& ref_gpu,
                              const GpuSpec& target);

struct EfficiencyChoice {
  double efficiency = 0;
  std::string source;     // "measured ...", "calibrated ...", "estimate: ..."
  bool estimate = false;  // extrapolated from another card
};

// The efficiency a card gets for a method: the mean of the measurements on this card (the
// calibration's when it has any for the method, else the built-in table's), else an
// extrapolation from the first measured card (extrapolate_efficiency).
EfficiencyChoice choose_efficiency(const GpuSpec& gpu, Method method,
                                   const std::vector<MeasuredEfficiency>& calibration,
                                   const Catalog& catalog);

// Memory-bound share of a `rig bench train --profile` breakdown (see MeasuredEfficiency); none
// when the breakdown lacks the step time.
std::optional<double> memory_bound_share(const nlohmann::json& breakdown);

// One `rig bench train --json` record read back as a measurement. `where` ("file:line") starts
// every error message. The record must be a bench train record (tokens_per_s, method, seq,
// batch, parameters, trainable_parameters, checkpointing) of `method`, from a GPU in bf16. The
// model shape is the record's "config", else the built-in shape whose parameter count it has;
// the GPU its "gpu" (the card's name) looked up in the catalog, else `default_gpu`. Records
// without a profiled breakdown take the memory share of the built-in table's entry for the
// method.
MeasuredEfficiency efficiency_from_record(const nlohmann::json& record, const std::string& where,
                                          Method method, const std::string& default_gpu,
                                          const Catalog& catalog);

// Every non-blank line of a file of such records (what `rig bench train --json` prints, or
// appended lines of several runs). Throws InputError naming the file and line for a missing
// file, a line that is not JSON, a line that is not a bench train record, or a record of another
// method; and naming the file when it holds no record.
std::vector<MeasuredEfficiency> read_calibration(const std::string& path, Method method,
                                                 const std::string& default_gpu,
                                                 const Catalog& catalog);

}  // namespace rig::plan
