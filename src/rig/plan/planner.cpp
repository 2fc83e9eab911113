#include "rig/plan/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "rig/core/allocator.h"
#include "rig/core/error.h"

namespace rig::plan {
namespace {

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, sep)) {
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

double to_number(const std::string& s, const std::string& what) {
  try {
    size_t pos = 0;
    double v = std::stod(s, &pos);
    if (pos == s.size() && std::isfinite(v)) return v;
  } catch (...) {
  }
  bad_input("{}: '{}' is not a finite number", what, s);
}

// Library callers reach make_plan without the command line's checks: every floating input must be
// a finite number, and the fractions inside their ranges. Errors name the PlanInput field.
void check_input(const PlanInput& in) {
  const std::pair<const char*, double> fields[] = {
      {"pcie_efficiency", in.pcie_efficiency},
      {"nvlink_efficiency", in.nvlink_efficiency},
      {"efficiency", in.efficiency},
      {"overlap", in.overlap},
      {"max_memory", in.max_memory},
      {"tokens", in.tokens},
      {"job_hours", in.job_hours},
      {"system_w", in.system_w},
      {"psu_w", in.psu_w},
      {"power_limit_w", in.power_limit_w},
      {"power_perf_exponent", in.power_perf_exponent},
      {"fit_per_gb", in.fit_per_gb},
      {"other_mtbf_hours", in.other_mtbf_hours},
      {"checkpoint_write_gbs", in.checkpoint_write_gbs},
      {"checkpoint_seconds", in.checkpoint_seconds},
      {"fx", in.fx},
      {"hardware_cost", in.hardware_cost},
      {"platform_cost", in.platform_cost},
      {"kwh_price", in.kwh_price},
      {"resale_fraction", in.resale_fraction},
      {"cloud_price", in.cloud_price},
      {"cloud_job_hours", in.cloud_job_hours},
  };
  for (const auto& [name, v] : fields)
    if (!std::isfinite(v)) bad_input("plan input {}: {} is not a finite number", name, v);
  if (in.efficiency < 0 || in.efficiency > 1)
    bad_input("plan input efficiency: {} is not in (0, 1] (0: the measured one)", in.efficiency);
  if (in.overlap < 0 || in.overlap > 1)
    bad_input("plan input overlap: {} is not in [0, 1]", in.overlap);
  for (const auto& [name, v] : {std::pair{"pcie_efficiency", in.pcie_efficiency},
                                std::pair{"nvlink_efficiency", in.nvlink_efficiency}})
    if (v <= 0 || v > 1) bad_input("plan input {}: {} is not in (0, 1]", name, v);
  if (in.tokens <= 0) bad_input("plan input tokens: {} is not > 0", in.tokens);
  if (in.checkpoint_write_gbs <= 0)
    bad_input("plan input checkpoint_write_gbs: {} is not > 0", in.checkpoint_write_gbs);
  if (in.fx <= 0) bad_input("plan input fx: {} is not > 0", in.fx);
  if (in.resale_fraction < 0 || in.resale_fraction > 1)
    bad_input("plan input resale_fraction: {} is not in [0, 1]", in.resale_fraction);
  for (const auto& m : in.calibration) {
    if (!std::isfinite(m.efficiency) || m.efficiency <= 0 || m.efficiency > 1)
      bad_input("plan input calibration efficiency ({}): {} is not in (0, 1]", m.source,
                m.efficiency);
    if (!std::isfinite(m.memory_share) || m.memory_share < 0 || m.memory_share > 1)
      bad_input("plan input calibration memory_share ({}): {} is not in [0, 1]", m.source,
                m.memory_share);
  }
  if (in.efficiency > 0 && !in.calibration.empty())
    bad_input("plan input: give efficiency or a calibration, not both");
}

// Fits: the memory model at (B, T) against every card's budget.
bool fits_at(const ModelConfig& m, TrainSetup s, double budget, int64_t B, int64_t T) {
  s.micro_batch = B;
  s.seq_len = T;
  return estimate_memory(m, s).total() <= budget;
}

// Largest v in [1, cap] (multiples of `step`) with ok(v), assuming ok is monotone; 0 if none.
template <typename F>
int64_t largest(int64_t step, int64_t cap, F ok) {
  if (!ok(step)) return 0;
  int64_t lo = 1, hi = 2;  // in units of step
  while (hi * step <= cap && ok(hi * step)) lo = hi, hi *= 2;
  if (hi * step > cap) hi = cap / step + 1;
  while (hi - lo > 1) {
    int64_t mid = (lo + hi) / 2;
    (ok(mid * step) ? lo : hi) = mid;
  }
  return lo * step;
}

}  // namespace

double pcie_lane_gbs(int gen) {
  switch (gen) {
    case 1:
      return 0.25;
    case 2:
      return 0.5;
    case 3:
      return 0.985;
    case 4:
      return 1.969;
    case 5:
      return 3.938;
    case 6:
      return 7.563;
  }
  bad_input("PCIe generation {}: expected 1..6", gen);
}

double allreduce_seconds(double bytes, int n, double busbw_gbs) {
  return n <= 1 ? 0 : bytes * 2 * (n - 1) / n / (busbw_gbs * 1e9);
}
double allgather_seconds(double bytes, int n, double busbw_gbs) {
  return n <= 1 ? 0 : bytes * (n - 1) / n / (busbw_gbs * 1e9);
}

std::string PcieLink::str() const {
  return fmt::format("gen{} x{}{}", gen, width, via_chipset ? " (chipset)" : "");
}

std::vector<PcieLink> platform_links(const std::string& platform, int n, double* uplink) {
  std::vector<PcieLink> out;
  *uplink = 0;
  auto room = [&](int max) {
    if (n > max) bad_input("platform {}: room for at most {} GPUs, asked for {}", platform, max, n);
  };
  if (platform == "z790" || platform == "z690" || platform == "b760") {
    // Intel LGA1700: 16 gen5 CPU lanes (x16 or x8/x8) + 4 gen4 for M.2; extra GPUs hang off
    // chipset gen4 x4 slots sharing DMI 4.0 x8.
    room(4);
    *uplink = 8 * pcie_lane_gbs(4);
    if (n == 1) return {{5, 16, false}};
    out = {{5, 8, false}, {5, 8, false}};
    for (int i = 2; i < n; ++i) out.push_back({4, 4, true});
  } else if (platform == "x670e" || platform == "x870e") {
    // AMD AM5: 24 usable gen5 lanes: x16 or x8/x8, and two x4 (M.2) via adapters.
    room(4);
    if (n == 1) return {{5, 16, false}};
    out = {{5, 8, false}, {5, 8, false}};
    for (int i = 2; i < n; ++i) out.push_back({5, 4, false});
  } else if (platform == "w3300") {
    room(4);  // Xeon W-3300: 64 gen4 lanes
    out.assign(n, {4, 16, false});
  } else if (platform == "w790") {
    room(7);  // Xeon W-2400/3400: 112 gen5 lanes
    out.assign(n, {5, 16, false});
  } else if (platform == "epyc" || platform == "server") {
    room(8);
    out.assign(n, {5, 16, false});
  } else {
    bad_input("platform '{}': expected z790, x670e, w3300, w790 or epyc (or give --pcie)",
              platform);
  }
  return out;
}

std::vector<PcieLink> parse_pcie(const std::string& text, int n) {
  std::vector<PcieLink> out;
  for (const auto& item : split(text, ',')) {
    PcieLink l;
    int gen = 0, width = 0;
    char tail[16] = {0};
    if (std::sscanf(item.c_str(), "gen%dx%d%15s", &gen, &width, tail) < 2 ||
        (tail[0] && std::string(tail) != "c"))
      bad_input("--pcie '{}': expected entries like gen4x16 or gen4x4c (c: behind the chipset)",
                item);
    if (width != 1 && width != 2 && width != 4 && width != 8 && width != 16)
      bad_input("--pcie '{}': width must be 1, 2, 4, 8 or 16", item);
    pcie_lane_gbs(gen);
    l.gen = gen;
    l.width = width;
    l.via_chipset = tail[0] == 'c';
    out.push_back(l);
  }
  if (out.size() == 1) out.assign(n, out[0]);
  if (int(out.size()) != n)
    bad_input("--pcie '{}': {} links for {} GPUs per node", text, out.size(), n);
  return out;
}

std::vector<GpuCount> parse_gpus(const std::string& text) {
  std::vector<GpuCount> out;
  for (const auto& item : split(text, ',')) {
    GpuCount g;
    auto x = item.find_first_of("x×");
    if (x != std::string::npos && x > 0 && std::isdigit(static_cast<unsigned char>(item[0]))) {
      double c = to_number(item.substr(0, x), "--gpus '" + text + "'");
      if (c < 1 || c != std::floor(c))
        bad_input("--gpus '{}': count must be a whole number >= 1", text);
      g.count = int(c);
      g.gpu = item.substr(x + 1);
    } else {
      g.count = 1;
      g.gpu = item;
    }
    out.push_back(g);
  }
  if (out.empty()) bad_input("--gpus '{}': expected e.g. 4x4090 or 2x4090,1x3090", text);
  return out;
}

Network parse_network(const std::string& text) {
  Network n;
  if (text.empty() || text == "none") return n;
  auto parts = split(text, ':');
  if (parts.size() != 2) bad_input("--network '{}': expected KIND:GBPS such as roce:40", text);
  n.kind = parts[0];
  n.gbps = to_number(parts[1], "--network '" + text + "'");
  // RDMA reaches ~90% of line rate; TCP over Ethernet less.
  if (n.kind == "ib" || n.kind == "roce")
    n.efficiency = 0.9;
  else if (n.kind == "eth" || n.kind == "tcp")
    n.efficiency = 0.8;
  else
    bad_input("--network '{}': kind must be eth, roce or ib", text);
  if (n.gbps <= 0) bad_input("--network '{}': speed must be > 0 Gbit/s", text);
  return n;
}

Flops flops_per_token(const ModelConfig& m, const TrainSetup& s) {
  return flops_per_token(m, s, double(count_params(m, s).lora_total()), double(s.seq_len));
}

Flops flops_per_token(const ModelConfig& m, const TrainSetup& s, double lora_params,
                      double attention_span) {
  ParamCounts c = count_params(m, s);
  const double n_layers = double(c.layers * c.linear_per_layer);
  const double n = n_layers + double(m.vocab_size * m.hidden_size);  // LM head matmul, tied or not
  const double attn_fwd = 4.0 * double(m.num_layers) * double(m.q_dim()) * attention_span;
  Flops f;
  f.matmul = (s.method == Method::full ? 6.0 : 4.0) * n;
  f.lora = 6.0 * lora_params;
  f.attention = 3 * attn_fwd;
  if (s.checkpointing == Checkpointing::full) {
    // Only the layers that recompute (selective recomputes element-wise work: no FLOPs here).
    const double L = double(m.num_layers);
    const double frac =
        s.recompute_layers < 0 ? 1.0 : std::min(L, double(s.recompute_layers)) / std::max(L, 1.0);
    f.recompute = frac * (2.0 * n_layers + 2.0 * lora_params + attn_fwd);
  }
  return f;
}

namespace {

// The cards of --gpus, one group per kind, and the world they make with --nodes (sharded falls
// back to data parallel on one GPU). Returns the GPUs per node.
int plan_groups(Plan& p, const Catalog& catalog) {
  PlanInput& in = p.in;
  int per_node = 0;
  for (const auto& gc : parse_gpus(in.gpus)) {
    GroupPlan g;
    g.gpu = &catalog.find(gc.gpu);
    g.count = gc.count;
    per_node += gc.count;
    bool merged = false;
    for (auto& e : p.groups)
      if (e.gpu == g.gpu) e.count += g.count, merged = true;
    if (!merged) p.groups.push_back(g);
  }
  p.world = per_node * in.nodes;
  in.setup.world_size = p.world;
  if (p.world == 1 && in.setup.strategy == Strategy::sharded)
    in.setup.strategy = Strategy::data_parallel;
  return per_node;
}

// Memory per GPU against every card's budget, and the largest micro-batch and sequence that fit.
void plan_memory(Plan& p) {
  const PlanInput& in = p.in;
  const ModelConfig& m = in.model;
  const TrainSetup& s = in.setup;
  p.memory = estimate_memory(m, s);
  p.fits = true;
  double budget = 1e300;
  for (auto& g : p.groups) {
    g.budget = g.gpu->memory_bytes();
    if (in.max_memory > 0) g.budget = std::min(g.budget, in.max_memory);
    g.fits = p.memory.total() <= g.budget;
    p.fits = p.fits && g.fits;
    budget = std::min(budget, g.budget);
    if (!g.fits)
      p.warnings.push_back(fmt::format("does not fit on {}: needs {} per GPU, {} usable",
                                       g.gpu->key, format_bytes(p.memory.total()),
                                       format_bytes(g.budget)));
  }
  p.max_micro_batch =
      largest(1, 1 << 16, [&](int64_t b) { return fits_at(m, s, budget, b, s.seq_len); });
  p.max_seq_len =
      largest(128, 1 << 22, [&](int64_t t) { return fits_at(m, s, budget, s.micro_batch, t); });
}

// Every GPU's PCIe link (from --pcie, --platform or the card's own); returns the chipset uplink.
double plan_links(Plan& p, int per_node) {
  const PlanInput& in = p.in;
  std::vector<PcieLink> links;
  double uplink = 0;
  if (!in.pcie.empty())
    links = parse_pcie(in.pcie, per_node);
  else if (!in.platform.empty())
    links = platform_links(in.platform, per_node, &uplink);
  {
    size_t i = 0;
    for (auto& g : p.groups)
      for (int k = 0; k < g.count; ++k, ++i)
        g.links.push_back(links.empty() ? PcieLink{g.gpu->pcie_gen, 16, false} : links[i]);
  }
  return uplink;
}

// Compute: tokens per second of every group at its efficiency (--efficiency, else rig's measured
// one for the card and method, speed.h) and --power-limit; the slowest sets the step.
void plan_compute(Plan& p, const Catalog& catalog) {
  const PlanInput& in = p.in;
  const ModelConfig& m = in.model;
  const TrainSetup& s = in.setup;
  p.flops = flops_per_token(m, s);
  const double fpt = p.flops.per_token();
  p.tokens_per_step = double(p.world) * double(s.micro_batch * s.seq_len * s.grad_accum);
  for (auto& g : p.groups) {
    double factor = 1.0;
    if (in.power_limit_w > 0 && in.power_limit_w < g.gpu->tdp_w)
      factor = std::pow(in.power_limit_w / g.gpu->tdp_w, in.power_perf_exponent);
    if (in.efficiency > 0) {
      g.efficiency = in.efficiency;
      g.efficiency_source = "--efficiency";
    } else {
      EfficiencyChoice e = choose_efficiency(*g.gpu, s.method, in.calibration, catalog);
      g.efficiency = e.efficiency;
      g.efficiency_source = e.source;
      g.efficiency_estimate = e.estimate;
    }
    g.tflops = g.gpu->bf16_tflops * g.efficiency * factor;
    g.tokens_per_s = g.tflops * 1e12 / fpt;
    // Ranks step together: the slowest card sets the pace.
    p.step_compute_s = std::max(p.step_compute_s,
                                double(s.micro_batch * s.seq_len * s.grad_accum) / g.tokens_per_s);
  }
  for (auto& g : p.groups)
    if (g.efficiency_estimate)
      p.warnings.push_back(fmt::format(
          "speed on {} is an estimate (rig was not measured on this card, see Speed): measure "
          "with `rig bench train --json` on it and pass the line to --calibrate",
          g.gpu->key));
  if (p.groups.size() > 1)
    p.warnings.push_back(
        "mixed cards: every rank gets the same batch, so the slowest card sets the step time and "
        "the smallest card the memory limit");
}

// Communication per step over the slowest link of the ring (NVLink, PCIe, the network).
void plan_comm(Plan& p, int per_node, double uplink) {
  const PlanInput& in = p.in;
  const TrainSetup& s = in.setup;
  if (p.world > 1) {
    // Bus bandwidth: the slowest link of the ring.
    double intra = 1e300;
    bool all_sxm = true, all_p2p = true;
    for (auto& g : p.groups) {
      all_sxm = all_sxm && g.gpu->nvlink == NvLink::sxm;
      all_p2p = all_p2p && g.gpu->p2p;
    }
    bool bridges = in.nvlink && per_node == 2 && p.groups.size() == 1 &&
                   p.groups[0].gpu->nvlink == NvLink::bridge;
    if (per_node == 1) {
      intra = 1e300;
      p.comm_path = "one GPU per node";
    } else if (all_sxm || bridges) {
      for (auto& g : p.groups) intra = std::min(intra, g.gpu->nvlink_gbs * in.nvlink_efficiency);
      p.comm_path = "NVLink";
    } else {
      int chipset = 0;
      for (auto& g : p.groups)
        for (auto& l : g.links) chipset += l.via_chipset;
      for (auto& g : p.groups)
        for (auto& l : g.links) {
          double raw = pcie_lane_gbs(std::min(l.gen, g.gpu->pcie_gen)) * l.width;
          if (l.via_chipset && uplink > 0) raw = std::min(raw, uplink / chipset);
          intra = std::min(intra, raw * in.pcie_efficiency);
        }
      p.comm_path = all_p2p ? "PCIe peer-to-peer" : "PCIe through host memory (no P2P)";
      if (!all_p2p && in.nvlink)
        p.warnings.push_back(
            "--nvlink ignored: bridges link only two cards of a kind that has them");
    }
    p.busbw_gbs = intra;
    if (in.nodes > 1) {
      Network net = parse_network(in.network);
      if (net.kind == "none")
        bad_input("--nodes {} needs --network (e.g. roce:40, ib:200, eth:10)", in.nodes);
      p.busbw_gbs = std::min(intra, net.gbps / 8 * net.efficiency);
      p.comm_path += fmt::format(" + {} {} Gbit/s between nodes", net.kind, net.gbps);
    }
    const double n = p.world;
    const double trainable =
        s.trains_base() ? double(p.memory.params.total()) : double(p.memory.params.lora_total());
    const double grad_bytes = trainable * s.param_bytes();
    if (s.strategy == Strategy::data_parallel) {
      // One all-reduce of the gradients per optimizer step; busbw = algbw·2(n−1)/n.
      p.comm_kind = "all-reduce";
      p.comm_bytes = grad_bytes;
      p.comm_s = allreduce_seconds(grad_bytes, p.world, p.busbw_gbs);
    } else {
      // Per micro-batch: all-gather the weights for forward and again for backward, reduce-scatter
      // the gradients; busbw = algbw·(n−1)/n for both.
      p.comm_kind = "all-gather + reduce-scatter";
      const double w_full = p.memory.weights * n + p.memory.lora * n;
      p.comm_bytes = double(s.grad_accum) * (2 * w_full + grad_bytes);
      p.comm_s = allgather_seconds(p.comm_bytes, p.world, p.busbw_gbs);
    }
  }
}

// Power per node: sustained and transient draw, the PSU it needs, what --power-limit saves.
void plan_power(Plan& p) {
  const PlanInput& in = p.in;
  double tdp_sum = 0, transient_sum = 0;
  for (auto& g : p.groups) {
    double w = in.power_limit_w > 0 ? std::min(in.power_limit_w, g.gpu->tdp_w) : g.gpu->tdp_w;
    tdp_sum += g.count * w;
    transient_sum += g.count * w * g.gpu->transient;
    if (in.power_limit_w > 0) p.power_saving_w += g.count * std::max(0.0, g.gpu->tdp_w - w);
  }
  p.sustained_w = tdp_sum + in.system_w;
  p.transient_w = transient_sum + in.system_w;
  // 30% headroom on sustained load; an ATX 3.x supply rides out 200% for 100 µs.
  p.psu_recommended_w = std::max(p.sustained_w * 1.3, p.transient_w / 2);
  if (in.psu_w > 0) {
    if (p.groups.size() == 1) {
      double w = p.groups[0].gpu->tdp_w;
      if (in.power_limit_w > 0) w = std::min(w, in.power_limit_w);
      p.full_load_cards = std::max(0, int(std::floor((in.psu_w - in.system_w) / w)));
      p.full_load_cards = std::min(p.full_load_cards, p.groups[0].count);
    }
    if (in.psu_w < p.sustained_w)
      p.warnings.push_back(fmt::format(
          "PSU {:.0f} W cannot carry full load {:.0f} W{}; set --power-limit, add a second PSU or "
          "fewer cards",
          in.psu_w, p.sustained_w,
          p.full_load_cards >= 0
              ? fmt::format(" (it carries {} cards at full load)", p.full_load_cards)
              : ""));
    else if (in.psu_w < p.psu_recommended_w)
      p.warnings.push_back(fmt::format(
          "PSU {:.0f} W is under the recommended {:.0f} W (30% headroom, transients to {:.0f} W)",
          in.psu_w, p.psu_recommended_w, p.transient_w));
  }
}

// Reliability: silent bit errors without ECC, and the checkpoint interval (Young/Daly).
void plan_reliability(Plan& p) {
  const PlanInput& in = p.in;
  const TrainSetup& s = in.setup;
  for (auto& g : p.groups) {
    if (g.gpu->ecc) continue;
    double fit = in.fit_per_gb >= 0 ? in.fit_per_gb : g.gpu->fit_per_gb;
    p.fit_total += fit * g.gpu->memory_gb * g.count * in.nodes;
  }
  p.mtbf_hours = p.fit_total > 0 ? 1e9 / p.fit_total : 0;
  p.expected_bit_errors = p.fit_total * p.job_hours / 1e9;
  p.p_bit_error = 1 - std::exp(-p.expected_bit_errors);
  if (p.expected_bit_errors > 0.01)
    p.warnings.push_back(
        fmt::format("no ECC: {:.2f} expected silent bit errors over the run ({:.0f}% chance of at "
                    "least one); keep checksummed checkpoints",
                    p.expected_bit_errors, 100 * p.p_bit_error));
  {
    const double trainable =
        s.trains_base() ? double(p.memory.params.total()) : double(p.memory.params.lora_total());
    const double opt = s.optimizer == Optimizer::adamw ? 8.0 : 2.0;
    p.checkpoint_bytes = trainable * (s.param_bytes() + s.master_bytes() + opt);
    p.checkpoint_s = in.checkpoint_seconds > 0
                         ? in.checkpoint_seconds
                         : p.checkpoint_bytes / (in.checkpoint_write_gbs * 1e9);
    double rate = p.fit_total / 1e9 + (in.other_mtbf_hours > 0 ? 1 / in.other_mtbf_hours : 0);
    p.failure_mtbf_hours = rate > 0 ? 1 / rate : 0;
    if (rate > 0) p.young_daly_s = std::sqrt(2 * p.checkpoint_s * p.failure_mtbf_hours * 3600);
  }
}

// Cost: buying (hardware, resale, electricity) against renting the cloud cards for the same job.
void plan_cost(Plan& p, const Catalog& catalog) {
  const PlanInput& in = p.in;
  const double platform = in.platform_cost >= 0 ? in.platform_cost : 2000 * in.fx;
  if (in.hardware_cost >= 0) {
    p.hardware = in.hardware_cost;
  } else {
    for (auto& g : p.groups) p.hardware += g.count * g.gpu->price_usd * in.fx;
    p.hardware = (p.hardware + platform) * in.nodes;
  }
  p.resale = p.hardware * in.resale_fraction;
  const double kwh = in.kwh_price >= 0 ? in.kwh_price : 0.15 * in.fx;
  p.energy_kwh = p.sustained_w * in.nodes / 1000 * p.job_hours;
  p.electricity = p.energy_kwh * kwh;
  p.buy_total = p.hardware - p.resale + p.electricity;
  {
    const GpuSpec& cg = catalog.find(in.cloud_gpu);
    PlanInput cin = in;
    int count = in.cloud_count > 0 ? in.cloud_count : p.world;
    cin.gpus = fmt::format("{}x{}", count, cg.key);
    cin.nodes = 1;
    cin.platform.clear();
    cin.pcie.clear();
    cin.power_limit_w = 0;
    p.cloud_price = in.cloud_price >= 0 ? in.cloud_price : cg.cloud_usd_hour * in.fx;
    if (in.cloud_job_hours > 0) {
      p.cloud_hours = in.cloud_job_hours;
      p.cloud_tokens_per_s = p.tokens_per_s * p.job_hours / p.cloud_hours;
    } else {
      // The same job on the cloud cards, by the same speed model (no cost or cloud recursion).
      cin.job_hours = 0;
      cin.cloud_job_hours = 1;
      cin.psu_w = 0;
      Plan cp = make_plan(cin, catalog);
      p.cloud_tokens_per_s = cp.tokens_per_s;
      p.cloud_hours = in.tokens / cp.tokens_per_s / 3600;
      if (in.job_hours > 0) p.cloud_hours = p.job_hours * p.tokens_per_s / cp.tokens_per_s;
    }
    p.cloud_total = p.cloud_hours * count * p.cloud_price;
    // Own hardware pays off after H hours of its own work when the cloud bill for the same work
    // exceeds net hardware + electricity: H·(cloud per own-hour − electricity per hour) = net.
    double cloud_per_own_hour = p.cloud_total / p.job_hours;
    double elec_per_hour = p.sustained_w * in.nodes / 1000 * kwh;
    double margin = cloud_per_own_hour - elec_per_hour;
    p.break_even_hours = margin > 0 ? (p.hardware - p.resale) / margin : -1;
  }
}

}  // namespace

Plan make_plan(const PlanInput& input, const Catalog& catalog) {
  Plan p;
  p.in = input;
  PlanInput& in = p.in;
  if (in.nodes < 1) bad_input("--nodes {}: expected >= 1", in.nodes);
  check_input(in);
  if (in.setup.grad_accum < 1) bad_input("--grad-accum must be >= 1");

  const int per_node = plan_groups(p, catalog);
  plan_memory(p);
  const double uplink = plan_links(p, per_node);
  plan_compute(p, catalog);
  plan_comm(p, per_node, uplink);
  p.step_s = p.step_compute_s + (1 - in.overlap) * p.comm_s;
  p.comm_share = p.step_s > 0 ? (1 - in.overlap) * p.comm_s / p.step_s : 0;
  p.tokens_per_s = p.tokens_per_step / p.step_s;
  p.job_hours = in.job_hours > 0 ? in.job_hours : in.tokens / p.tokens_per_s / 3600;
  if (p.comm_share > 0.2)
    p.warnings.push_back(
        fmt::format("communication is {:.0f}% of the step: raise --grad-accum or use faster links",
                    100 * p.comm_share));
  bool host_staged = p.comm_path.find("host memory") != std::string::npos;
  if (host_staged)
    p.warnings.push_back(
        "no peer-to-peer on these cards: NCCL stages every transfer through host memory");

  plan_power(p);
  plan_reliability(p);
  plan_cost(p, catalog);
  return p;
}

}  // namespace rig::plan
