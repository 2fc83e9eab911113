#include "rig/hw/watch.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <set>
#include <thread>

#include "rig/core/error.h"

namespace rig::hw {

using json = nlohmann::json;

json Alert::to_json() const {
  return {{"time", time}, {"gpu", gpu}, {"kind", kind}, {"message", message}};
}

std::string xid_meaning(uint64_t xid) {
  switch (xid) {
    case 13:
      return "graphics engine exception (often the application: out-of-bounds access)";
    case 31:
      return "GPU memory page fault (usually the application)";
    case 43:
      return "GPU stopped processing";
    case 45:
      return "preemptive cleanup after a previous error";
    case 48:
      return "double-bit ECC error";
    case 61:
    case 62:
      return "internal micro-controller error";
    case 63:
    case 64:
      return "ECC page retirement or row remapping event";
    case 74:
      return "NVLink error";
    case 79:
      return "GPU has fallen off the bus (power, riser or PCIe slot)";
    case 92:
      return "high single-bit ECC error rate";
    case 94:
      return "contained ECC error";
    case 95:
      return "uncontained ECC error (reset the GPU)";
    case 119:
    case 120:
      return "GSP firmware error";
    default:
      return "see NVIDIA's XID catalog";
  }
}

std::vector<Alert> AlertTracker::update(const std::vector<GpuInfo>& gpus,
                                        const std::vector<GpuSample>& samples) {
  std::vector<Alert> out;
  if (st_.size() < samples.size()) st_.resize(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    const GpuSample& s = samples[i];
    const GpuInfo* g = i < gpus.size() ? &gpus[i] : nullptr;
    State& p = st_[i];
    auto add = [&](const char* kind, std::string msg) {
      out.push_back({s.time, s.index, kind, std::move(msg)});
    };
    std::string temp = s.temp_c ? fmt::format("{:.0f} C", *s.temp_c) : "n/a";

    bool thermal = s.thermal_throttle();
    if (thermal && !p.thermal)
      add("thermal_throttle",
          fmt::format(
              "thermal throttling ({}) at {}",
              fmt::join(clocks_event_names(*s.clocks_event_reasons & (kThermalReasons)), ","),
              temp));
    p.thermal = thermal;

    bool power = s.power_throttle();
    if (power && !p.power)
      add("power_throttle",
          fmt::format("power throttling ({}) at {} of {} limit",
                      fmt::join(clocks_event_names(*s.clocks_event_reasons & kPowerReasons), ","),
                      s.power_w ? fmt::format("{:.0f} W", *s.power_w) : "n/a",
                      s.power_limit_w ? fmt::format("{:.0f} W", *s.power_limit_w) : "n/a"));
    p.power = power;

    if (s.temp_c && g && g->temp_slowdown_c) {
      double slow = *g->temp_slowdown_c;
      // Hysteresis: raised at 5 C from slowdown, cleared only 2 C lower, so 83/84/83 is one alert.
      if (!p.hot && *s.temp_c >= slow - 5) {
        p.hot = true;
        add("near_slowdown", fmt::format("{} is within {:.0f} C of the {:.0f} C slowdown threshold",
                                         temp, std::max(0.0, slow - *s.temp_c), slow));
      } else if (p.hot && *s.temp_c < slow - 7) {
        p.hot = false;
      }
    }

    if (s.ecc_uncorrected && p.ecc_u && *s.ecc_uncorrected > *p.ecc_u)
      add("ecc",
          fmt::format("{} new uncorrected ECC error(s) (total {}): training state may be corrupt; "
                      "roll back to the last verified checkpoint",
                      *s.ecc_uncorrected - *p.ecc_u, *s.ecc_uncorrected));
    if (s.ecc_corrected && p.ecc_c && *s.ecc_corrected > *p.ecc_c)
      add("ecc", fmt::format("{} new corrected ECC error(s) (total {})",
                             *s.ecc_corrected - *p.ecc_c, *s.ecc_corrected));
    if (s.ecc_uncorrected) p.ecc_u = s.ecc_uncorrected;
    if (s.ecc_corrected) p.ecc_c = s.ecc_corrected;

    bool remap = s.remap_pending.value_or(false) || s.retired_pages_pending.value_or(false);
    if (remap && !p.remap)
      add("remap_pending",
          "memory row remap or page retirement pending: reset the GPU when the run ends");
    p.remap = remap;

    bool link = g && s.pcie_width && g->max_pcie_width && *s.pcie_width < *g->max_pcie_width &&
                s.util_gpu_pct.value_or(0) >= 10;
    if (link && !p.link)
      add("link",
          fmt::format("PCIe link at x{} of x{} under load", *s.pcie_width, *g->max_pcie_width));
    p.link = link;

    for (uint64_t x : s.xids) add("xid", fmt::format("XID {}: {}", x, xid_meaning(x)));
    p.seen = true;
  }
  return out;
}

// ---- Prometheus ---------------------------------------------------------------------------

namespace {

std::string escape_label(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\' || c == '"')
      o += '\\', o += c;
    else if (c == '\n')
      o += "\\n";
    else
      o += c;
  }
  return o;
}

std::string fmt_value(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{:.0f}", v);
  return fmt::format("{}", v);
}

}  // namespace

std::string prometheus_text(const std::vector<GpuInfo>& gpus, const std::vector<GpuSample>& samples,
                            const std::vector<uint64_t>& last_xid, const PromLabels& labels) {
  // Long on purpose: a table of metric families, one row each.
  using Get = std::function<std::optional<double>(const GpuSample&, size_t)>;
  auto u = [](auto v) -> std::optional<double> {
    return v ? std::optional<double>(double(*v)) : std::nullopt;
  };
  auto mib = [](std::optional<uint64_t> v) -> std::optional<double> {
    return v ? std::optional<double>(double(*v) / (1 << 20)) : std::nullopt;
  };
  struct Family {
    const char* name;
    const char* type;
    const char* help;
    Get get;
  };
  const Family fams[] = {
      {"DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).",
       [&](auto& s, size_t) { return s.sm_clock_mhz; }},
      {"DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).",
       [&](auto& s, size_t) { return s.mem_clock_mhz; }},
      {"DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).",
       [&](auto& s, size_t) { return s.mem_temp_c; }},
      {"DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
       [&](auto& s, size_t) { return s.temp_c; }},
      {"DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).",
       [&](auto& s, size_t) { return s.power_w; }},
      {"DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W).",
       [&](auto& s, size_t) { return s.power_limit_w; }},
      {"DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
       [&](auto& s, size_t) { return s.util_gpu_pct; }},
      {"DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
       [&](auto& s, size_t) { return s.util_mem_pct; }},
      {"DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
       [&](auto& s, size_t) { return mib(s.fb_free); }},
      {"DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
       [&](auto& s, size_t) { return mib(s.fb_used); }},
      {"DCGM_FI_DEV_FAN_SPEED", "gauge", "Fan speed (in %).",
       [&](auto& s, size_t) { return s.fan_pct; }},
      {"DCGM_FI_DEV_PCIE_LINK_GEN", "gauge", "PCIe current link generation.",
       [&](auto& s, size_t) { return u(s.pcie_gen); }},
      {"DCGM_FI_DEV_PCIE_LINK_WIDTH", "gauge", "PCIe current link width.",
       [&](auto& s, size_t) { return u(s.pcie_width); }},
      {"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock throttle reasons (bitmask).",
       [&](auto& s, size_t) { return u(s.clocks_event_reasons); }},
      {"DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
       [&](auto&, size_t i) {
         return std::optional<double>(i < last_xid.size() ? double(last_xid[i]) : 0.0);
       }},
      {"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
       "Total number of single-bit volatile ECC errors.",
       [&](auto& s, size_t) { return u(s.ecc_corrected); }},
      {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
       "Total number of double-bit volatile ECC errors.",
       [&](auto& s, size_t) { return u(s.ecc_uncorrected); }},
      {"DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
       "Number of remapped rows for correctable errors",
       [&](auto& s, size_t) { return u(s.remapped_rows_corr); }},
      {"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
       "Number of remapped rows for uncorrectable errors",
       [&](auto& s, size_t) { return u(s.remapped_rows_unc); }},
      {"DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
       [&](auto& s, size_t) { return u(s.remap_failure); }},
  };
  std::string o;
  for (const auto& f : fams) {
    std::string body;
    for (size_t i = 0; i < samples.size(); ++i) {
      auto v = f.get(samples[i], i);
      if (!v) continue;
      const GpuInfo* g = i < gpus.size() ? &gpus[i] : nullptr;
      body += fmt::format(
          "{}{{gpu=\"{}\",UUID=\"{}\",pci_bus_id=\"{}\",device=\"nvidia{}\",modelName=\"{}\","
          "Hostname=\"{}\","
          "DCGM_FI_DRIVER_VERSION=\"{}\"}} {}\n",
          f.name, samples[i].index, escape_label(g ? g->uuid : ""),
          escape_label(g ? g->pci_bus_id : ""), samples[i].index, escape_label(g ? g->name : ""),
          escape_label(labels.hostname), escape_label(labels.driver), fmt_value(*v));
    }
    if (body.empty()) continue;  // a field no GPU reports is left out, as dcgm-exporter does
    o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f.name, f.help, f.name, f.type);
    o += body;
  }
  return o;
}

// ---- log ------------------------------------------------------------------------------------

std::vector<std::string> csv_columns() {
  return {"time",         "gpu",           "uuid",          "temp_c",          "mem_temp_c",
          "power_w",      "power_limit_w", "sm_clock_mhz",  "mem_clock_mhz",   "util_gpu_pct",
          "util_mem_pct", "fb_used_mib",   "fb_free_mib",   "fan_pct",         "pcie_gen",
          "pcie_width",   "throttle",      "ecc_corrected", "ecc_uncorrected", "xids"};
}

SampleLog::SampleLog(const std::string& path) : path_(path) {
  std::string ext = std::filesystem::path(path).extension().string();
  if (ext == ".csv")
    csv_ = true;
  else if (ext != ".jsonl" && ext != ".ndjson")
    bad_input("--log {}: use a .csv or .jsonl file name (the extension picks the format)", path);
  bool fresh = !std::filesystem::exists(path) || std::filesystem::file_size(path) == 0;
  f_ = std::fopen(path.c_str(), "a");
  if (!f_) bad_input("--log {}: cannot open for writing", path);
  if (csv_ && fresh) {
    auto cols = csv_columns();
    std::fprintf(f_, "%s\n", fmt::format("{}", fmt::join(cols, ",")).c_str());
    std::fflush(f_);
  }
}

SampleLog::~SampleLog() {
  if (f_) std::fclose(f_);
}

void SampleLog::write(const std::vector<GpuInfo>& gpus, const std::vector<GpuSample>& samples) {
  for (const auto& s : samples) {
    const GpuInfo* g = size_t(s.index) < gpus.size() ? &gpus[s.index] : nullptr;
    if (!csv_) {
      json j = s.to_json();
      if (g) j["uuid"] = g->uuid;
      std::fprintf(f_, "%s\n", j.dump().c_str());
      continue;
    }
    auto o = [](const auto& v, const char* f = "{}") {
      return v ? fmt::format(fmt::runtime(f), *v) : std::string();
    };
    std::optional<double> used, fr;
    if (s.fb_used) used = double(*s.fb_used) / (1 << 20);
    if (s.fb_free) fr = double(*s.fb_free) / (1 << 20);
    std::string xids = fmt::format("{}", fmt::join(s.xids, ";"));
    std::vector<std::string> cells = {
        fmt::format("{:.3f}", s.time),
        std::to_string(s.index),
        g ? g->uuid : "",
        o(s.temp_c, "{:.0f}"),
        o(s.mem_temp_c, "{:.0f}"),
        o(s.power_w, "{:.1f}"),
        o(s.power_limit_w, "{:.0f}"),
        o(s.sm_clock_mhz, "{:.0f}"),
        o(s.mem_clock_mhz, "{:.0f}"),
        o(s.util_gpu_pct, "{:.0f}"),
        o(s.util_mem_pct, "{:.0f}"),
        o(used, "{:.0f}"),
        o(fr, "{:.0f}"),
        o(s.fan_pct, "{:.0f}"),
        o(s.pcie_gen),
        o(s.pcie_width),
        fmt::format("{}", fmt::join(clocks_event_names(s.clocks_event_reasons.value_or(0)), ";")),
        o(s.ecc_corrected),
        o(s.ecc_uncorrected),
        xids};
    std::fprintf(f_, "%s\n", fmt::format("{}", fmt::join(cells, ",")).c_str());
  }
  std::fflush(f_);
}

// ---- terminal -------------------------------------------------------------------------------

std::string render_table(const std::vector<GpuInfo>& gpus, const std::vector<GpuSample>& samples,
                         bool color) {
  std::string o;
  for (const auto& s : samples) {
    const GpuInfo* g = size_t(s.index) < gpus.size() ? &gpus[s.index] : nullptr;
    auto n = [](const std::optional<double>& v, const char* f) {
      return v ? fmt::format(fmt::runtime(f), *v) : "n/a";
    };
    std::string temp = n(s.temp_c, "{:.0f}C");
    bool hot = s.temp_c && g && g->temp_slowdown_c && *s.temp_c >= *g->temp_slowdown_c - 5;
    if (color) temp = fmt::format("\033[{}m{}\033[0m", hot ? "1;31" : "33", temp);
    std::optional<double> used, total;
    if (s.fb_used) used = double(*s.fb_used) / (1 << 20);
    if (s.fb_total) total = double(*s.fb_total) / (1 << 20);
    auto thr = clocks_event_names(s.clocks_event_reasons.value_or(0));
    std::string link =
        s.pcie_gen && s.pcie_width ? fmt::format("gen{} x{}", *s.pcie_gen, *s.pcie_width) : "n/a";
    o += fmt::format(
        "[{}] {:<24} | {:>4} {:>4} | {:>4} | {:>6} / {:>6} MiB | {:>4} / {:>4} W | {:>5} MHz | "
        "{:<8} | {}\n",
        s.index, g ? g->name.substr(0, 24) : "?", temp, n(s.fan_pct, "{:.0f}%"),
        n(s.util_gpu_pct, "{:.0f}%"), n(used, "{:.0f}"), n(total, "{:.0f}"), n(s.power_w, "{:.0f}"),
        n(s.power_limit_w, "{:.0f}"), n(s.sm_clock_mhz, "{:.0f}"), link,
        thr.empty() ? "-" : fmt::format("{}", fmt::join(thr, ",")));
  }
  return o;
}

// ---- run metrics ----------------------------------------------------------------------------

json read_run_metrics(const std::string& run_dir, size_t max_points) {
  std::string path = (std::filesystem::path(run_dir) / "metrics.jsonl").string();
  json out = {{"path", path}, {"keys", json::array()}, {"points", json::array()}};
  std::ifstream f(path);
  if (!f) {
    out["error"] = "no metrics.jsonl yet";
    return out;
  }
  std::vector<json> pts;
  std::set<std::string> keys;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;  // a line being written right now
    if (j.contains("event")) continue;                 // the guard's events are not curves
    json p = json::object();
    for (auto& [k, v] : j.items())
      if (v.is_number()) {
        p[k] = v;
        if (k != "step") keys.insert(k);
      }
    if (p.contains("step")) pts.push_back(std::move(p));
  }
  size_t stride = pts.size() > max_points ? (pts.size() + max_points - 1) / max_points : 1;
  for (size_t i = 0; i < pts.size(); i += stride) out["points"].push_back(pts[i]);
  if (!pts.empty() && (pts.size() - 1) % stride)
    out["points"].push_back(pts.back());  // keep the latest
  out["keys"] = keys;
  return out;
}

// ---- the loop -------------------------------------------------------------------------------

namespace {

struct Shared {
  std::mutex mu;
  std::vector<GpuInfo> gpus;
  std::vector<GpuSample> latest;
  std::vector<std::deque<json>> history;
  std::deque<json> alerts;
  std::vector<uint64_t> last_xid;
  PromLabels labels;
  std::string run_dir;

  // A sample's readings into the dashboard's history (keeping `keep` points per GPU), and
  // the new alerts (the last 100).
  void record(const std::vector<GpuSample>& samples, const std::vector<Alert>& fresh, size_t keep) {
    std::lock_guard lock(mu);
    latest = samples;
    for (auto& s : samples) {
      auto& h = history[s.index];
      h.push_back({{"t", s.time},
                   {"temp", s.temp_c ? json(*s.temp_c) : json(nullptr)},
                   {"power", s.power_w ? json(*s.power_w) : json(nullptr)},
                   {"util", s.util_gpu_pct ? json(*s.util_gpu_pct) : json(nullptr)},
                   {"sm", s.sm_clock_mhz ? json(*s.sm_clock_mhz) : json(nullptr)},
                   {"fb_used", s.fb_used ? json(double(*s.fb_used) / (1 << 20)) : json(nullptr)}});
      while (h.size() > keep) h.pop_front();
      if (!s.xids.empty()) last_xid[s.index] = s.xids.back();
    }
    for (auto& a : fresh) {
      alerts.push_back(a.to_json());
      while (alerts.size() > 100) alerts.pop_front();
    }
  }

  json state() {
    std::lock_guard lock(mu);
    json j;
    j["hostname"] = labels.hostname;
    j["driver"] = labels.driver;
    j["gpus"] = json::array();
    for (size_t i = 0; i < gpus.size(); ++i) {
      json g = gpus[i].to_json();
      if (i < latest.size()) g["sample"] = latest[i].to_json();
      g["history"] = i < history.size() ? json(history[i]) : json::array();
      g["last_xid"] = i < last_xid.size() ? last_xid[i] : 0;
      j["gpus"].push_back(g);
    }
    j["alerts"] = alerts;
    j["run"] = run_dir.empty() ? json(nullptr) : json(run_dir);
    return j;
  }
  std::string metrics() {
    std::lock_guard lock(mu);
    return prometheus_text(gpus, latest, last_xid, labels);
  }
};

struct Server {
  httplib::Server svr;
  std::thread th;
  std::atomic<bool> ended{false};
  int port = -1;
  void start(const std::string& host, int want, const char* what) {
    port = want == 0 ? svr.bind_to_any_port(host) : (svr.bind_to_port(host, want) ? want : -1);
    if (port <= 0) fail("{}: cannot listen on {}:{} (port in use?)", what, host, want);
    th = std::thread([this] {
      svr.listen_after_bind();
      ended = true;
    });
  }
  ~Server() {
    if (th.joinable()) {
      // stop() does nothing before the accept loop runs (`watch -n 1 --http 0` ends that soon),
      // and the loop would then never end: wait until it runs, or has ended on its own.
      while (!svr.is_running() && !ended) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      svr.stop();
      th.join();
    }
  }
};

std::string hostname() {
  char buf[256] = {};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

std::string clock_string(double t) {
  std::time_t tt = std::time_t(t);
  std::tm tm{};
  localtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

// --prometheus PORT: /metrics for Prometheus to scrape; none without the option.
std::unique_ptr<Server> serve_prometheus(const std::shared_ptr<Shared>& sh, const WatchOptions& opt,
                                         std::ostream& out) {
  if (opt.prometheus_port < 0) return nullptr;
  auto prom = std::make_unique<Server>();
  prom->svr.Get("/metrics", [sh](const httplib::Request&, httplib::Response& res) {
    res.set_content(sh->metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  prom->start(opt.bind, opt.prometheus_port, "--prometheus");
  out << fmt::format("prometheus: http://{}:{}/metrics\n", opt.bind, prom->port);
  return prom;
}

// --http PORT: the dashboard, its JSON state and the run's metrics, and /metrics; none without
// the option.
std::unique_ptr<Server> serve_dashboard(const std::shared_ptr<Shared>& sh, const WatchOptions& opt,
                                        std::ostream& out) {
  if (opt.http_port < 0) return nullptr;
  auto http = std::make_unique<Server>();
  http->svr.Get("/", [sh](const httplib::Request&, httplib::Response& res) {
    res.set_content(dashboard_html(sh->state()), "text/html; charset=utf-8");
  });
  http->svr.Get("/api/state", [sh](const httplib::Request&, httplib::Response& res) {
    res.set_content(sh->state().dump(), "application/json");
  });
  http->svr.Get("/api/run", [sh](const httplib::Request&, httplib::Response& res) {
    json j =
        sh->run_dir.empty() ? json{{"error", "no --run DIR given"}} : read_run_metrics(sh->run_dir);
    res.set_content(j.dump(), "application/json");
  });
  http->svr.Get("/metrics", [sh](const httplib::Request&, httplib::Response& res) {
    res.set_content(sh->metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http->start(opt.bind, opt.http_port, "--http");
  out << fmt::format("dashboard: http://{}:{}/\n", opt.bind, http->port);
  return http;
}

}  // namespace

int run_watch(const WatchOptions& opt, std::ostream& out, const std::atomic<bool>* stop,
              WatchReady ready) {
  // The CLI checks these as it parses; callers of the library get the same answer here.
  if (!std::isfinite(opt.interval_s) || opt.interval_s <= 0)
    bad_input("--interval must be a finite number > 0, got {}", opt.interval_s);
  if (!std::isfinite(opt.duration_s) || opt.duration_s < 0)
    bad_input("--duration must be a finite number >= 0, got {}", opt.duration_s);
  std::unique_ptr<SampleLog> log;
  if (!opt.log_path.empty()) log = std::make_unique<SampleLog>(opt.log_path);
  Telemetry tel = Telemetry::open(opt.nvml_library);
  auto sh = std::make_shared<Shared>();
  sh->gpus = tel.gpus();
  sh->labels = {hostname(), tel.driver_version()};
  sh->history.resize(sh->gpus.size());
  sh->last_xid.assign(sh->gpus.size(), 0);
  sh->run_dir = opt.run_dir;
  if (sh->gpus.empty()) out << "rig watch: NVML sees no GPU\n";

  AlertTracker tracker;
  int alerts = 0;
  auto take_sample = [&] {
    auto samples = tel.sample();
    auto fresh = tracker.update(sh->gpus, samples);
    sh->record(samples, fresh, opt.history);
    if (log) log->write(sh->gpus, samples);
    alerts += int(fresh.size());
    return std::make_pair(samples, fresh);
  };

  auto first = take_sample();
  std::unique_ptr<Server> prom = serve_prometheus(sh, opt, out);
  std::unique_ptr<Server> http = serve_dashboard(sh, opt, out);
  out.flush();
  if (ready) ready(prom ? prom->port : -1, http ? http->port : -1);

  auto t0 = std::chrono::steady_clock::now();
  std::deque<std::string> recent;  // alert lines kept on screen when redrawing
  for (long it = 1;; ++it) {
    auto& [samples, fresh] = first;
    std::string ts = clock_string(samples.empty() ? 0 : samples[0].time);
    for (auto& a : fresh) {
      std::string line = fmt::format("[{}] ALERT gpu{} {}: {}", ts, a.gpu, a.kind, a.message);
      recent.push_back(line);
      if (recent.size() > 8) recent.pop_front();
      if (!opt.clear_screen) out << line << "\n";
    }
    if (opt.clear_screen) {
      out << "\033[H\033[2J"
          << fmt::format("rig watch  {}  {}  driver {}\n", sh->labels.hostname, ts,
                         sh->labels.driver)
          << render_table(sh->gpus, samples, opt.color);
      for (auto& l : recent) out << (opt.color ? "\033[1;31m" + l + "\033[0m" : l) << "\n";
    } else {
      out << "--- " << ts << "\n" << render_table(sh->gpus, samples, false);
    }
    out.flush();
    if (opt.iterations > 0 && it >= opt.iterations) break;
    // Sleep in short slices so a stop request or the duration limit ends the wait promptly.
    auto next = t0 + std::chrono::duration<double>(opt.interval_s * double(it));
    bool done = false;
    while (std::chrono::steady_clock::now() < next) {
      if ((stop && *stop) ||
          (opt.duration_s > 0 && std::chrono::steady_clock::now() - t0 >=
                                     std::chrono::duration<double>(opt.duration_s))) {
        done = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (done || (stop && *stop)) break;
    if (opt.duration_s > 0 &&
        std::chrono::steady_clock::now() - t0 >= std::chrono::duration<double>(opt.duration_s))
      break;
    first = take_sample();
  }
  return alerts;
}

}  // namespace rig::hw
