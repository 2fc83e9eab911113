#include "rig/plan/speed.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <regex>
#include <sstream>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/plan/models.h"
#include "rig/plan/planner.h"

namespace rig::plan {

// The measured table. Every efficiency is measured tokens/s × flops_per_token() of the run's
// configuration / 989.4e12 (the H200's dense bf16 peak in the catalog), every memory share the
// breakdown of the same records (memory_bound_share), averaged as said; nothing is fitted to a
// prediction. tests/unit/plan_speed_test.cpp derives each number again from the records and
// checks the table against them. The rows are bench/rig_vs_hf.sh's (docs/plan.md, "Speed").
//
// lora, H200: the mean of two configurations, each the mean of its records:
//   row 0, llama3-8b LoRA r16 q,k,v,o, seq 4096 × 2, full checkpointing on 10 of 32 layers:
//     bench/results/2026-12-04-rig-vs-hf.jsonl:1 (14,577 tokens/s), 0.6127
//     bench/results/2026-12-04-night-rig-vs-hf.jsonl:1 (14,381), 0.6044
//     bench/results/2026-12-04-night-packed-training.jsonl:3 (14,083, whole rows), 0.5919
//     mean 0.6030, memory share 0.1350
//   row 2, llama3-8b LoRA r16 all seven projections, seq 4096 × 2, selective checkpointing:
//     bench/results/2026-12-03-evening-rig-vs-hf.jsonl:2 (14,820), 0.5499
//     bench/results/2026-12-03-night-rig-vs-hf.jsonl:2 (15,130), 0.5614
//     mean 0.5557, memory share 0.2356
//   → 0.5793, memory share 0.1853
// full, H200: row 3, llama3-1b full fine-tuning, seq 2048 × 8, no checkpointing:
//     bench/results/2026-12-04-rig-vs-hf.jsonl:2 (69,015), 0.5734
//     bench/results/2026-12-04-night-rig-vs-hf.jsonl:2 (67,045), 0.5570
//     bench/results/2026-12-04-night-packed-training.jsonl:4 (66,761, whole rows), 0.5546
//   → 0.5617, memory share 0.1577
// qlora, H200: the two QLoRA runs of docs/qlora.md ("Measured", 2026-12-03; their JSON lines
// were not kept in bench/results), both LoRA r16 q,k,v,o with full checkpointing on every layer:
//     llama3-8b, seq 4096 × 2: 10,953 tokens/s, 0.5831
//     llama3-70b, seq 2048 × 1: 1,218.7 tokens/s, 0.5382
//   → 0.5607; no profiled breakdown: LoRA's memory share (0.1853)
const std::vector<MeasuredEfficiency>& builtin_efficiencies() {
  static const std::vector<MeasuredEfficiency> table = {
      {"h200", Method::lora, 0.5793, 0.1853,
       "measured: rig bench train on an H200, llama3-8b LoRA rows 0 and 2 "
       "(bench/results/2026-12-03*, 2026-12-04*)"},
      {"h200", Method::full, 0.5617, 0.1577,
       "measured: rig bench train on an H200, llama3-1b full row 3 (bench/results/2026-12-04*)"},
      {"h200", Method::qlora, 0.5607, 0.1853,
       "measured: rig bench train on an H200, llama3-8b and llama3-70b QLoRA (docs/qlora.md, "
       "2026-12-03)"},
  };
  return table;
}

double extrapolate_efficiency(const MeasuredEfficiency& ref, const GpuSpec& ref_gpu,
                              const GpuSpec& target) {
  const double s = ref.memory_share;
  double ratio = 1;  // memory time against compute time on the target, relative to the reference
  if (ref_gpu.bandwidth_gbs > 0 && target.bandwidth_gbs > 0 && ref_gpu.bf16_tflops > 0)
    ratio =
        (target.bf16_tflops / ref_gpu.bf16_tflops) * (ref_gpu.bandwidth_gbs / target.bandwidth_gbs);
  return std::min(1.0, ref.efficiency / ((1 - s) + s * ratio));
}

EfficiencyChoice choose_efficiency(const GpuSpec& gpu, Method method,
                                   const std::vector<MeasuredEfficiency>& calibration,
                                   const Catalog& catalog) {
  std::vector<const MeasuredEfficiency*> pool;
  for (const auto& m : calibration)
    if (m.method == method) pool.push_back(&m);
  const bool calibrated = !pool.empty();
  if (!calibrated)
    for (const auto& m : builtin_efficiencies())
      if (m.method == method) pool.push_back(&m);
  if (pool.empty()) bad_input("no measured efficiency for {}", to_string(method));
  // The measurements of one card, averaged: this card's when it has any, else the first card's.
  auto mean_of = [&](const std::string& key) {
    MeasuredEfficiency mean;
    mean.gpu = key;
    mean.method = method;
    int n = 0;
    for (const auto* m : pool)
      if (m->gpu == key) {
        mean.efficiency += m->efficiency;
        mean.memory_share += m->memory_share;
        mean.source += (n++ ? "; " : "") + m->source;
      }
    mean.efficiency /= n;
    mean.memory_share /= n;
    return std::make_pair(mean, n);
  };
  EfficiencyChoice c;
  auto [own, n_own] = mean_of(gpu.key);
  if (n_own > 0) {
    c.efficiency = own.efficiency;
    c.source = n_own > 1 ? fmt::format("mean of {}: {}", n_own, own.source) : own.source;
    return c;
  }
  auto [ref, n_ref] = mean_of(pool.front()->gpu);
  const GpuSpec& ref_gpu = catalog.find(ref.gpu);
  c.efficiency = extrapolate_efficiency(ref, ref_gpu, gpu);
  c.estimate = true;
  c.source = fmt::format(
      "estimate: {} not measured; {:.1f}% on {} ({}{}) carried over by peak bf16 ({:.1f} against "
      "{:.1f} TFLOPS) and memory bandwidth ({:.0f} against {:.0f} GB/s), {:.0f}% of the step "
      "memory-bound",
      gpu.key, 100 * ref.efficiency, ref.gpu, calibrated ? "calibrated" : "built-in table",
      n_ref > 1 ? fmt::format(", mean of {}", n_ref) : "", gpu.bf16_tflops, ref_gpu.bf16_tflops,
      gpu.bandwidth_gbs, ref_gpu.bandwidth_gbs, 100 * ref.memory_share);
  return c;
}

std::optional<double> memory_bound_share(const nlohmann::json& breakdown) {
  if (!breakdown.is_object() || !breakdown.contains("step_ms") || !breakdown["step_ms"].is_number())
    return std::nullopt;
  const double step = breakdown["step_ms"].get<double>();
  if (!(step > 0) || !std::isfinite(step)) return std::nullopt;
  double ms = 0;
  for (const char* k : {"elementwise_ms", "norm_ms", "loss_ms", "optimizer_ms", "other_ms"})
    if (breakdown.contains(k) && breakdown[k].is_number()) ms += breakdown[k].get<double>();
  // Products with a dimension of 64 or less (LoRA's rank-r products) move more bytes than they
  // compute: "gemm MxNxK ..." in the per-op table.
  if (breakdown.contains("ops") && breakdown["ops"].is_object()) {
    static const std::regex gemm(R"(^gemm (\d+)x(\d+)x(\d+))");
    for (const auto& [op, v] : breakdown["ops"].items()) {
      std::smatch m;
      if (!std::regex_search(op, m, gemm) || !v.is_object() || !v.contains("ms") ||
          !v["ms"].is_number())
        continue;
      const double d = std::min({std::stod(m[1]), std::stod(m[2]), std::stod(m[3])});
      if (d <= 64) ms += v["ms"].get<double>();
    }
  }
  const double share = ms / step;
  if (!std::isfinite(share) || share < 0) return std::nullopt;
  return std::min(share, 1.0);
}

namespace {

// A number field of a record: present, a JSON number, finite.
double number(const nlohmann::json& r, const char* key, const std::string& where) {
  const auto& v = r[key];
  if (!v.is_number())
    bad_input("{}: '{}' is {}, expected a number", where, key, v.is_null() ? "missing" : v.dump());
  const double x = v.get<double>();
  if (!std::isfinite(x)) bad_input("{}: '{}' is not a finite number", where, key);
  return x;
}

// Splits a name into lower-case runs of letters and digits: "NVIDIA A100-SXM4-80GB" -> nvidia,
// a100, sxm4, 80gb.
std::vector<std::string> name_tokens(const std::string& name) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : name + " ") {
    if (std::isalnum(static_cast<unsigned char>(ch))) {
      cur += char(std::tolower(static_cast<unsigned char>(ch)));
    } else if (!cur.empty()) {
      out.push_back(cur);
      cur.clear();
    }
  }
  return out;
}

// The catalog card of a name as the driver gives it ("NVIDIA H100 80GB HBM3", "NVIDIA GeForce
// RTX 4090", "NVIDIA A100-SXM4-80GB"): a key or alias the catalog finds as it is, else the key
// or alias all of whose parts are parts of the name, the one with the most parts ("a100-80gb"
// before "a100"). Throws InputError when none is.
const GpuSpec& card_named(const std::string& name, const Catalog& catalog,
                          const std::string& where) {
  try {
    return catalog.find(name);
  } catch (const InputError&) {
  }
  const auto have = name_tokens(name);
  const GpuSpec* best = nullptr;
  size_t best_parts = 0;
  for (const auto& [key, g] : catalog.gpus()) {
    std::vector<std::string> names = g.aliases;
    names.push_back(key);
    for (const auto& n : names) {
      auto parts = name_tokens(n);
      // "rtx4090" is one part; the device name says "rtx 4090".
      for (auto& p : parts)
        if (p.starts_with("rtx") && p.size() > 3) p = p.substr(3);
      bool all = !parts.empty();
      for (const auto& p : parts) all = all && std::find(have.begin(), have.end(), p) != have.end();
      if (all && parts.size() > best_parts) best = &g, best_parts = parts.size();
    }
  }
  if (!best)
    bad_input("{}: GPU '{}' is not in the catalog; add it with --catalog FILE", where, name);
  return *best;
}

// The built-in shape with `params` parameters (the base model's, LoRA not counted).
std::optional<std::pair<std::string, ModelConfig>> shape_with(int64_t params) {
  TrainSetup full;
  full.method = Method::full;
  for (const auto& name : builtin_model_names()) {
    ModelConfig m = builtin_model(name);
    if (count_params(m, full).total() == params) return std::make_pair(name, m);
  }
  return std::nullopt;
}

}  // namespace

MeasuredEfficiency efficiency_from_record(const nlohmann::json& r, const std::string& where,
                                          Method method, const std::string& default_gpu,
                                          const Catalog& catalog) {
  if (!r.is_object()) bad_input("{}: expected a JSON object, got {}", where, r.type_name());
  for (const char* k : {"tokens_per_s", "method", "seq", "batch", "parameters",
                        "trainable_parameters", "checkpointing"})
    if (!r.contains(k))
      bad_input(
          "{}: not a `rig bench train --json` record (no '{}'); calibrate with the line that "
          "command prints",
          where, k);
  if (r.contains("rc") && r["rc"].is_number() && r["rc"].get<double>() != 0)
    bad_input("{}: the run failed (rc {}), its tokens/s measure nothing", where, r["rc"].dump());
  if (!r["method"].is_string()) bad_input("{}: 'method' is not a string", where);
  const std::string rmethod = r["method"].get<std::string>();
  Method m_rec;
  try {
    m_rec = parse_method(rmethod);
  } catch (const InputError&) {
    bad_input("{}: method '{}' is not full, lora or qlora", where, rmethod);
  }
  if (m_rec != method)
    bad_input(
        "{}: a {} record; this plan is for --method {}: calibrate with a `rig bench train "
        "--method {} --json` line",
        where, rmethod, to_string(method), to_string(method));
  if (r.contains("device") && r["device"].is_string() &&
      r["device"].get<std::string>().starts_with("cpu"))
    bad_input("{}: measured on the CPU; calibrate with a record from a GPU (--device cuda)", where);
  if (r.contains("precision") && r["precision"] != "bf16")
    bad_input("{}: precision {}; the plan's speed is bf16 training (--precision bf16)", where,
              r["precision"].dump());

  const double tokens_per_s = number(r, "tokens_per_s", where);
  if (tokens_per_s <= 0) bad_input("{}: 'tokens_per_s' is {}, expected > 0", where, tokens_per_s);
  const double seq = number(r, "seq", where), batch = number(r, "batch", where);
  const double params = number(r, "parameters", where);
  const double trainable = number(r, "trainable_parameters", where);
  if (seq < 1 || batch < 1 || params < 1 || trainable < 0 || seq != std::floor(seq) ||
      batch != std::floor(batch))
    bad_input("{}: seq {}, batch {}, parameters {}: expected whole numbers >= 1", where, seq, batch,
              params);

  TrainSetup s;
  s.method = method;
  s.seq_len = int64_t(seq);
  s.micro_batch = int64_t(batch);
  const auto& ck = r["checkpointing"];
  if (ck.is_boolean())  // records before the selective mode: true meant full
    s.checkpointing = ck.get<bool>() ? Checkpointing::full : Checkpointing::none;
  else if (ck.is_string())
    try {
      s.checkpointing = parse_checkpointing(ck.get<std::string>());
    } catch (const InputError&) {
      bad_input("{}: checkpointing {} is not none, selective or full", where, ck.dump());
    }
  else
    bad_input("{}: checkpointing {} is not none, selective or full", where, ck.dump());
  if (r.contains("recompute_layers"))
    s.recompute_layers = int64_t(number(r, "recompute_layers", where));

  // The model shape: the record's config, or the built-in shape with its parameter count.
  ModelConfig model;
  std::string shape;
  if (r.contains("config")) {
    try {
      model = ModelConfig::from_json(r["config"], where + " config");
    } catch (const Error& e) {
      bad_input("{}", e.what());
    }
    shape = "shape from its config";
  } else {
    const double base = method == Method::full ? params : params - trainable;
    auto found = shape_with(int64_t(base));
    if (!found)
      bad_input(
          "{}: the record has no 'config' (rig bench train writes it since the plan reads it) "
          "and its {} base parameters match no built-in shape",
          where, int64_t(base));
    shape = found->first + " by its parameter count";
    model = found->second;
  }
  const double span = r.contains("attention_len") ? number(r, "attention_len", where) : seq;
  const Flops f =
      flops_per_token(model, s, method == Method::full ? 0.0 : trainable, span > 0 ? span : seq);

  // The card: the record's "gpu" (its name as the driver gives it), else the plan's.
  std::string gpu = default_gpu, gpu_note;
  if (r.contains("gpu") && r["gpu"].is_string() && !r["gpu"].get<std::string>().empty()) {
    gpu = card_named(r["gpu"].get<std::string>(), catalog, where).key;
  } else {
    gpu_note = fmt::format(", the record names no GPU: taken as {}", default_gpu);
  }
  const GpuSpec& card = catalog.find(gpu);

  MeasuredEfficiency out;
  out.gpu = card.key;
  out.method = method;
  out.efficiency = tokens_per_s * f.per_token() / (card.bf16_tflops * 1e12);
  if (!(out.efficiency > 0) || !std::isfinite(out.efficiency))
    bad_input("{}: efficiency {} is not a positive number", where, out.efficiency);
  if (out.efficiency > 1)
    bad_input(
        "{}: {:.0f} tokens/s is {:.0f}% of {}'s dense bf16 peak; is the record from another "
        "GPU?{}",
        where, tokens_per_s, 100 * out.efficiency, card.key,
        gpu_note.empty() ? "" : " (it names none: give its card first in --gpus)");
  std::optional<double> share;
  if (r.contains("breakdown")) share = memory_bound_share(r["breakdown"]);
  if (!share)
    for (const auto& b : builtin_efficiencies())
      if (b.method == method) {
        share = b.memory_share;
        break;
      }
  out.memory_share = share.value_or(0);
  out.source =
      fmt::format("calibrated: {} ({}, {}, seq {} x {}, {:.0f} tokens/s on {}{})", where, rmethod,
                  shape, int64_t(seq), int64_t(batch), tokens_per_s, card.key, gpu_note);
  return out;
}

std::vector<MeasuredEfficiency> read_calibration(const std::string& path, Method method,
                                                 const std::string& default_gpu,
                                                 const Catalog& catalog) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    bad_input("calibration file {}: no such file", path);
  std::istringstream in(read_file(path));
  std::vector<MeasuredEfficiency> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path, n);
    nlohmann::json r;
    try {
      r = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      // nlohmann's message starts "[json.exception.parse_error.101] parse error at ...".
      std::string what = e.what();
      const auto p = what.find("] ");
      bad_input("{}: not a JSON line: {}", where,
                p == std::string::npos ? what : what.substr(p + 2));
    }
    out.push_back(efficiency_from_record(r, where, method, default_gpu, catalog));
  }
  if (out.empty()) bad_input("calibration file {}: no records (it is empty)", path);
  return out;
}

}  // namespace rig::plan
