#include "rig/hw/doctor.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "rig/core/error.h"

namespace rig::hw {

using json = nlohmann::json;
namespace fs = std::filesystem;

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::ok:
      return "ok";
    case Verdict::warn:
      return "warn";
    case Verdict::fail:
      return "fail";
    case Verdict::skip:
      return "skip";
  }
  return "?";
}

json Check::to_json() const {
  json j = {{"id", id}, {"verdict", verdict_name(verdict)}, {"detail", detail}};
  if (gpu >= 0) j["gpu"] = gpu;
  return j;
}

namespace {

// A card counts as busy when it works, so a link trained down at idle is not blamed.
bool busy(const GpuSample& s) {
  if (s.util_gpu_pct && *s.util_gpu_pct >= 10) return true;
  return s.clocks_event_reasons && !(*s.clocks_event_reasons & 0x1) &&
         s.util_gpu_pct.value_or(0) > 0;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

Check link_check(const GpuInfo& g, const GpuSample& s) {
  Check c{"pcie_link", g.index, Verdict::ok, ""};
  if (!s.pcie_gen || !s.pcie_width) {
    c.verdict = Verdict::skip;
    c.detail = "link generation/width not reported";
    return c;
  }
  unsigned mg = g.max_pcie_gen.value_or(*s.pcie_gen), mw = g.max_pcie_width.value_or(*s.pcie_width);
  c.detail = fmt::format("gen{} x{} (card supports gen{} x{})", *s.pcie_gen, *s.pcie_width, mg, mw);
  std::vector<std::string> why;
  if (*s.pcie_width < mw) {
    c.verdict = Verdict::warn;
    why.push_back(
        fmt::format("running x{} of x{}: the slot, riser or BIOS bifurcation limits it, and "
                    "all-reduce over this "
                    "card will be about {}x slower (move it to a CPU-attached x16/x8 slot)",
                    *s.pcie_width, mw, mw / std::max(1u, *s.pcie_width)));
  }
  if (*s.pcie_gen < mg) {
    if (busy(s)) {
      c.verdict = Verdict::warn;
      why.push_back(fmt::format(
          "gen{} under load where gen{} is possible: check the BIOS PCIe setting, the riser "
          "(gen4 risers are often gen3-only) or a chipset slot",
          *s.pcie_gen, mg));
    } else {
      why.push_back("link trains down at idle to save power; rig watch checks it under load");
    }
  }
  if (!why.empty()) c.detail += ": " + join(why, "; ");
  return c;
}

Check power_check(const GpuInfo& g, const GpuSample& s) {
  Check c{"power_limit", g.index, Verdict::ok, ""};
  if (!s.power_limit_w) {
    c.verdict = Verdict::skip;
    c.detail = "power limit not reported";
    return c;
  }
  c.detail = fmt::format("limit {:.0f} W", *s.power_limit_w);
  if (g.power_default_limit_w) {
    c.detail += fmt::format(" (default {:.0f} W)", *g.power_default_limit_w);
    if (*s.power_limit_w + 1 < *g.power_default_limit_w) {
      c.verdict = Verdict::warn;
      c.detail += fmt::format(
          ": {:.0f}% of default, set with nvidia-smi -pl; fine if intended (it keeps a shared PSU "
          "from tripping and the card cooler) but expect lower clocks",
          100 * *s.power_limit_w / *g.power_default_limit_w);
    }
  }
  return c;
}

Check temp_check(const GpuInfo& g, const GpuSample& s) {
  Check c{"temperature", g.index, Verdict::ok, ""};
  if (!s.temp_c) {
    c.verdict = Verdict::skip;
    c.detail = "temperature not reported";
    return c;
  }
  c.detail = fmt::format("{:.0f} C", *s.temp_c);
  if (g.temp_slowdown_c) {
    c.detail += fmt::format(" (slowdown at {:.0f} C)", *g.temp_slowdown_c);
    if (*s.temp_c >= *g.temp_slowdown_c - 5) {
      c.verdict = Verdict::fail;
      c.detail += fmt::format(
          ": within {:.0f} C of hardware slowdown before training has started; improve airflow "
          "(spacing between cards, case fans, room temperature) or lower the power limit",
          std::max(0.0, *g.temp_slowdown_c - *s.temp_c));
    }
  }
  if (s.mem_temp_c && g.mem_temp_max_c && *s.mem_temp_c >= *g.mem_temp_max_c - 5) {
    c.verdict = Verdict::fail;
    c.detail += fmt::format("; memory at {:.0f} C, within 5 C of its {:.0f} C limit", *s.mem_temp_c,
                            *g.mem_temp_max_c);
  }
  return c;
}

Check ecc_check(const GpuInfo& g, const GpuSample& s) {
  Check c{"ecc", g.index, Verdict::ok, ""};
  if (!s.ecc_uncorrected && !s.ecc_corrected) {
    c.verdict = Verdict::skip;
    // What rig train's guard really does about it (docs/reliability.md), and what it cannot.
    c.detail =
        "no ECC on this card, so bit flips go unreported; rig train skips NaN/Inf steps, rolls "
        "back to a verified checkpoint on loss/gradient spikes and corrupted weights (replica "
        "hashes, frozen-weight hashes, implausible values), and verifies checkpoints before use "
        "(docs/reliability.md); a flip that changes a value only slightly on one GPU goes "
        "unnoticed";
    return c;
  }
  uint64_t unc = s.ecc_uncorrected.value_or(0), cor = s.ecc_corrected.value_or(0);
  c.detail = fmt::format("{} corrected, {} uncorrected since boot", cor, unc);
  std::vector<std::string> bad;
  if (unc > 0) bad.push_back("uncorrected errors corrupt training state silently");
  if (s.retired_pages_pending.value_or(false))
    bad.push_back("a page retirement is pending (reset the GPU)");
  if (s.remap_pending.value_or(false))
    bad.push_back("a row remap is pending (reset the GPU or reboot)");
  if (s.remap_failure.value_or(false))
    bad.push_back("row remapping failed: the card needs service");
  if (s.remapped_rows_unc)
    c.detail += fmt::format(", {} rows remapped", *s.remapped_rows_corr + *s.remapped_rows_unc);
  if (!bad.empty()) {
    c.verdict = Verdict::fail;
    c.detail += ": " + join(bad, "; ");
  } else if (cor > 0) {
    c.verdict = Verdict::warn;
    c.detail += ": corrected errors are harmless alone, watch whether they grow";
  }
  return c;
}

Check throttle_check(const GpuInfo& g, const GpuSample& s) {
  Check c{"throttle", g.index, Verdict::ok, ""};
  if (!s.clocks_event_reasons) {
    c.verdict = Verdict::skip;
    c.detail = "clock event reasons not reported";
    return c;
  }
  uint64_t r = *s.clocks_event_reasons;
  auto names = clocks_event_names(r);
  if (names.empty()) {
    c.detail = (r & 0x1) ? "none (idle)" : "none";
    return c;
  }
  c.detail = join(names, ", ");
  if (r & (kThermalReasons | 0x80)) {
    c.verdict = Verdict::fail;
    c.detail += (r & 0x80)
                    ? ": the power brake is asserted (PSU or power cable cannot deliver; check "
                      "the 12VHPWR connector and PSU capacity)"
                    : ": the card is slowing itself to cool down";
  } else {
    c.verdict = Verdict::warn;
    c.detail += ": clocks held by the power limit (normal under full load, not at idle)";
  }
  return c;
}

}  // namespace

std::vector<Check> check_gpu(const GpuInfo& g, const GpuSample& s) {
  return {temp_check(g, s), throttle_check(g, s), power_check(g, s), link_check(g, s),
          ecc_check(g, s)};
}

std::vector<std::string> list_infiniband(const std::string& sysfs_root) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(fs::path(sysfs_root) / "class/infiniband", ec))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> list_net_interfaces(const std::string& sysfs_root) {
  static const char* virt[] = {"lo",  "docker", "veth", "virbr",     "br-", "cni",   "flannel",
                               "tun", "tap",    "wg",   "tailscale", "zt",  "vxlan", "kube"};
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(fs::path(sysfs_root) / "class/net", ec)) {
    std::string name = e.path().filename().string();
    if (std::any_of(std::begin(virt), std::end(virt),
                    [&](const char* p) { return name.rfind(p, 0) == 0; }))
      continue;
    std::ifstream f(e.path() / "operstate");
    std::string state;
    f >> state;
    if (state == "up") out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Advice> nccl_advice(const AdviceInputs& in) {
  std::vector<Advice> out;
  if (in.gpus.size() < 2) return out;  // one GPU: NCCL is not in the way
  bool all_geforce =
      std::all_of(in.gpus.begin(), in.gpus.end(), [](const GpuInfo& g) { return g.geforce(); });
  if (in.p2p.measured ? in.p2p.any_denied() : all_geforce) {
    out.push_back(
        {"NCCL_P2P_DISABLE", "1",
         in.p2p.measured
             ? "cudaDeviceCanAccessPeer says no for some pairs: NCCL goes through host shared "
               "memory anyway, and saying so skips the P2P probe"
             : "GeForce drivers disable PCIe peer-to-peer; some driver versions still "
               "advertise it and NCCL then hangs or corrupts data (RTX 40-series), so force the "
               "shared-memory path"});
  }
  if (in.ib_devices.empty())
    out.push_back(
        {"NCCL_IB_DISABLE", "1",
         "no InfiniBand/RoCE device in /sys/class/infiniband: stops NCCL looking for one"});
  if (!in.net_interfaces.empty())
    out.push_back(
        {"NCCL_SOCKET_IFNAME", in.net_interfaces.front(),
         fmt::format("the interface for NCCL's bootstrap and socket transport (found: {}); "
                     "naming it keeps NCCL off docker0 and VPN links",
                     join(in.net_interfaces, ", "))});
  else
    out.push_back({"NCCL_SOCKET_IFNAME", "lo",
                   "no physical interface is up: single-node runs bootstrap over loopback"});
  return out;
}

std::vector<Check> DoctorReport::failing() const {
  std::vector<Check> out;
  for (const auto& c : checks)
    if (c.verdict == Verdict::fail || (strict && c.verdict == Verdict::warn)) out.push_back(c);
  return out;
}

namespace {

// The CUDA libraries found (NCCL, the runtime against the driver, cuDNN) as checks.
void check_libraries(DoctorReport& r) {
  for (const auto& l : r.libraries) {
    bool multi = r.gpus.size() > 1;
    if (l.name == "nccl") {
      if (l.found)
        r.checks.push_back({"nccl", -1, Verdict::ok, l.version + " (" + l.library + ")"});
      else
        r.checks.push_back({"nccl", -1, multi ? Verdict::warn : Verdict::skip,
                            "not found (" + l.error + ")" +
                                (multi ? ": multi-GPU training needs libnccl.so.2" : "")});
    } else if (l.name == "cudart") {
      if (!l.found) {
        r.checks.push_back(
            {"cuda_runtime", -1, Verdict::skip, "libcudart not found (" + l.error + ")"});
      } else if (r.cuda_driver_version && l.raw / 1000 > r.cuda_driver_version / 1000) {
        r.checks.push_back(
            {"cuda_runtime", -1, Verdict::fail,
             fmt::format("CUDA runtime {} needs a newer driver (this one supports CUDA {}): "
                         "update the NVIDIA driver",
                         l.version, cuda_version_string(r.cuda_driver_version))});
      } else if (r.cuda_driver_version && l.raw > r.cuda_driver_version) {
        // Minor-version compatibility: it runs, but PTX newer than the driver cannot be
        // JIT-compiled.
        r.checks.push_back(
            {"cuda_runtime", -1, Verdict::warn,
             fmt::format("CUDA runtime {} is newer than the driver's CUDA {}: runs under "
                         "minor-version compatibility, but kernels shipped only as PTX fail",
                         l.version, cuda_version_string(r.cuda_driver_version))});
      } else {
        r.checks.push_back({"cuda_runtime", -1, Verdict::ok, l.version + " (" + l.library + ")"});
      }
    } else if (l.name == "cudnn") {
      r.checks.push_back({"cudnn", -1, l.found ? Verdict::ok : Verdict::skip,
                          l.found ? l.version + " (" + l.library + ")" : "not found (optional)"});
    }
  }
}

// hwloc's view of the machine, and whether the GPUs hang off more than one NUMA node.
void check_topology(DoctorReport& r, const std::vector<std::string>& bus_ids,
                    const DoctorOptions& opt) {
  r.topology = probe_topology(bus_ids, opt.topology_xml);
  if (!r.topology.ok) {
    r.checks.push_back({"topology", -1, Verdict::skip, "hwloc: " + r.topology.error});
  } else {
    std::string d = fmt::format("{} package(s), {} NUMA node(s), {} cores", r.topology.packages,
                                r.topology.numa_nodes, r.topology.cores);
    int unplaced = int(std::count_if(r.topology.gpus.begin(), r.topology.gpus.end(),
                                     [](const GpuPlacement& p) { return !p.found; }));
    if (unplaced) d += fmt::format("; {} GPU(s) not in hwloc's PCI tree", unplaced);
    if (r.topology.spans_numa_nodes()) {
      r.checks.push_back(
          {"topology", -1, Verdict::warn,
           d + ": GPUs hang off different NUMA nodes; traffic between them crosses the "
               "CPU interconnect, so bind each rank to its GPU's node (numactl "
               "--cpunodebind) and prefer pairs on one node"});
    } else {
      r.checks.push_back({"topology", -1, Verdict::ok, d});
    }
  }
}

// Peer-to-peer access between the GPUs, measured unless --no-p2p or one GPU.
void check_p2p(DoctorReport& r, const std::vector<std::string>& bus_ids, const DoctorOptions& opt) {
  if (opt.measure_p2p && r.gpus.size() > 1) {
    r.p2p = measure_p2p(bus_ids);
  } else {
    r.p2p.note = r.gpus.size() > 1 ? "not measured (--no-p2p)" : "not measured (one GPU)";
    r.p2p.can_access.assign(r.gpus.size(), std::vector<int>(r.gpus.size(), -1));
    r.p2p.gbps.assign(r.gpus.size(), std::vector<double>(r.gpus.size(), 0.0));
  }
  if (r.gpus.size() > 1)
    r.checks.push_back({"p2p", -1, r.p2p.measured ? Verdict::ok : Verdict::skip,
                        r.p2p.measured
                            ? (r.p2p.any_denied() ? "peer access denied for some pairs (expected "
                                                    "on GeForce): NCCL uses host memory"
                                                  : "peer access available")
                            : r.p2p.note});
}

}  // namespace

DoctorReport run_doctor(const DoctorOptions& opt) {
  DoctorReport r;
  r.strict = opt.strict;
  r.libraries = probe_libraries();
  std::optional<Telemetry> tel;
  try {
    tel.emplace(Telemetry::open(opt.nvml_library));
  } catch (const Error& e) {
    r.checks.push_back({"nvml", -1, Verdict::fail, e.what()});
  }
  if (tel) {
    r.nvml_ok = true;
    r.nvml_library = tel->library();
    r.driver_version = tel->driver_version();
    r.cuda_driver_version = tel->cuda_driver_version();
    r.gpus = tel->gpus();
    r.samples = tel->sample();
    r.checks.push_back({"nvml", -1, Verdict::ok,
                        fmt::format("driver {}, CUDA {} ({})", r.driver_version,
                                    cuda_version_string(r.cuda_driver_version), r.nvml_library)});
    if (r.gpus.empty()) {
      r.checks.push_back({"gpus", -1, Verdict::fail, "NVML sees no GPU"});
    } else {
      std::set<std::string> names;
      for (auto& g : r.gpus) names.insert(g.name);
      if (names.size() == 1)
        r.checks.push_back(
            {"gpus", -1, Verdict::ok, fmt::format("{} x {}", r.gpus.size(), *names.begin())});
      else
        r.checks.push_back(
            {"gpus", -1, Verdict::warn,
             fmt::format("mixed GPUs ({}): data-parallel steps run at the slowest card's "
                         "pace and memory limits follow the smallest",
                         join({names.begin(), names.end()}, ", "))});
    }
  }
  check_libraries(r);
  for (size_t i = 0; i < r.gpus.size() && i < r.samples.size(); ++i)
    for (auto& c : check_gpu(r.gpus[i], r.samples[i])) r.checks.push_back(c);

  std::vector<std::string> bus_ids;
  for (auto& g : r.gpus) bus_ids.push_back(g.pci_bus_id);
  check_topology(r, bus_ids, opt);
  check_p2p(r, bus_ids, opt);
  AdviceInputs in{r.gpus, r.p2p, list_net_interfaces(opt.sysfs_root),
                  list_infiniband(opt.sysfs_root)};
  r.advice = nccl_advice(in);
  return r;
}

json DoctorReport::to_json() const {
  json j;
  j["ready"] = ready();
  j["strict"] = strict;
  j["versions"] = {
      {"driver", driver_version.empty() ? json(nullptr) : json(driver_version)},
      {"cuda_driver",
       cuda_driver_version ? json(cuda_version_string(cuda_driver_version)) : json(nullptr)},
      {"nvml_library", nvml_library}};
  for (auto& l : libraries) j["versions"][l.name] = l.to_json();
  j["gpus"] = json::array();
  for (size_t i = 0; i < gpus.size(); ++i) {
    json g = gpus[i].to_json();
    if (i < samples.size()) g["sample"] = samples[i].to_json();
    g["checks"] = json::array();
    for (auto& c : checks)
      if (c.gpu == int(i)) g["checks"].push_back(c.to_json());
    j["gpus"].push_back(g);
  }
  j["checks"] = json::array();
  for (auto& c : checks) j["checks"].push_back(c.to_json());
  j["failing"] = json::array();
  for (auto& c : failing()) j["failing"].push_back(c.to_json());
  j["topology"] = topology.to_json();
  j["p2p"] = p2p.to_json();
  j["advice"] = json::array();
  for (auto& a : advice)
    j["advice"].push_back({{"var", a.var}, {"value", a.value}, {"why", a.why}, {"line", a.line()}});
  return j;
}

namespace {

std::string tag(Verdict v, bool color) {
  const char* t = v == Verdict::ok     ? " ok "
                  : v == Verdict::warn ? "WARN"
                  : v == Verdict::fail ? "FAIL"
                                       : "skip";
  if (!color) return fmt::format("[{}]", t);
  const char* c = v == Verdict::ok     ? "32"
                  : v == Verdict::warn ? "33"
                  : v == Verdict::fail ? "31"
                                       : "90";
  return fmt::format("[\033[{}m{}\033[0m]", c, t);
}

std::string num(const std::optional<double>& v, const char* unit, const char* f = "{:.0f}") {
  return v ? fmt::format(fmt::runtime(f), *v) + unit : "n/a";
}

}  // namespace

std::string DoctorReport::to_text(bool color) const {
  // Long on purpose: the report's lines, in the order they are printed.
  std::string o;
  auto line = [&](const std::string& s) { o += s + "\n"; };
  line("Versions");
  line(fmt::format("  {:<16}{}", "NVIDIA driver", driver_version.empty() ? "n/a" : driver_version));
  line(fmt::format("  {:<16}{}", "CUDA (driver)",
                   cuda_driver_version ? cuda_version_string(cuda_driver_version) : "n/a"));
  for (auto& l : libraries) {
    const char* label = l.name == "nccl" ? "NCCL" : l.name == "cudnn" ? "cuDNN" : "CUDA runtime";
    line(fmt::format("  {:<16}{}", label,
                     l.found ? l.version + " (" + l.library + ")" : "not found"));
  }
  for (auto& c : checks)
    if (c.gpu < 0 && (c.id == "nvml" || c.id == "gpus" || c.id == "cuda_runtime" || c.id == "nccl"))
      line(fmt::format("  {} {:<13}{}", tag(c.verdict, color), c.id, c.detail));
  for (size_t i = 0; i < gpus.size(); ++i) {
    const auto& g = gpus[i];
    line("");
    line(fmt::format("GPU {}  {}  {}  {}", g.index, g.name, g.pci_bus_id, g.uuid));
    if (i < samples.size()) {
      const auto& s = samples[i];
      line(fmt::format("  temp {} (slowdown {}, shutdown {})  power {} / {} (default {})  fan {}",
                       num(s.temp_c, " C"), num(g.temp_slowdown_c, " C"),
                       num(g.temp_shutdown_c, " C"), num(s.power_w, " W"),
                       num(s.power_limit_w, " W"), num(g.power_default_limit_w, " W"),
                       num(s.fan_pct, "%")));
      std::optional<double> used, total;
      if (s.fb_used) used = double(*s.fb_used) / (1 << 30);
      if (s.fb_total) total = double(*s.fb_total) / (1 << 30);
      line(fmt::format("  util {}  memory {} / {}  SM {}  mem clock {}", num(s.util_gpu_pct, "%"),
                       num(used, "", "{:.1f}"), num(total, " GiB", "{:.1f}"),
                       num(s.sm_clock_mhz, " MHz"), num(s.mem_clock_mhz, " MHz")));
    }
    for (auto& c : checks)
      if (c.gpu == int(i))
        line(fmt::format("  {} {:<13}{}", tag(c.verdict, color), c.id, c.detail));
  }
  line("");
  line("Topology");
  for (auto& c : checks)
    if (c.id == "topology") line(fmt::format("  {} {}", tag(c.verdict, color), c.detail));
  for (auto& p : topology.gpus)
    line(p.found ? fmt::format("  GPU{}  NUMA {}  CPUs {}  link {}", p.gpu, p.numa_node, p.cpus,
                               p.link_gbps ? fmt::format("{:.1f} GB/s", *p.link_gbps) : "n/a")
                 : fmt::format("  GPU{}  {} not found by hwloc", p.gpu, p.bus_id));
  if (topology.paths.size() > 1) {
    std::string h = "        ";
    for (size_t j = 0; j < topology.paths.size(); ++j)
      h += fmt::format("{:<6}", fmt::format("GPU{}", j));
    line(h);
    for (size_t i = 0; i < topology.paths.size(); ++i) {
      std::string row = fmt::format("  GPU{:<2}", i);
      for (auto& cell : topology.paths[i]) row += fmt::format("{:<6}", cell);
      line(row);
    }
  }
  if (gpus.size() > 1) {
    line("");
    line("Peer-to-peer");
    if (!p2p.measured) {
      line("  " + p2p.note);
    } else {
      line("  " + p2p.note + "; cell: peer access (P/-) and copy GB/s");
      for (size_t i = 0; i < p2p.gbps.size(); ++i) {
        std::string row = fmt::format("  GPU{:<2}", i);
        for (size_t j = 0; j < p2p.gbps[i].size(); ++j)
          row += i == j ? fmt::format("{:>10}", "X")
                        : fmt::format("{:>10}", fmt::format("{} {:.1f}",
                                                            p2p.can_access[i][j] == 1 ? "P" : "-",
                                                            p2p.gbps[i][j]));
        line(row);
      }
    }
  }
  line("");
  if (advice.empty()) {
    line("NCCL advice: none (one GPU)");
  } else {
    line("NCCL advice (paste into the shell that starts training)");
    for (auto& a : advice) {
      line("  # " + a.why);
      line("  " + a.line());
    }
  }
  line("");
  auto bad = failing();
  if (bad.empty()) {
    line(fmt::format("Result: READY{}", strict ? " (strict)" : ""));
  } else {
    line(fmt::format("Result: NOT READY, {} failing check(s){}:", bad.size(),
                     strict ? " (strict: warnings count)" : ""));
    for (auto& c : bad)
      line(fmt::format("  {}{}: {}", c.gpu >= 0 ? fmt::format("gpu{} ", c.gpu) : "", c.id,
                       c.detail));
  }
  return o;
}

}  // namespace rig::hw
