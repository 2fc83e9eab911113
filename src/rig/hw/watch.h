// `rig watch`: samples every GPU each interval, shows a gpustat-like table, raises alerts on the
// events that ruin a long run (thermal or power throttling, a card near its slowdown
// temperature, new ECC or XID errors, a pending row remap), logs samples as CSV or JSONL, and
// serves them as Prometheus metrics (dcgm-exporter's names, so existing Grafana boards work) and
// as a self-contained web dashboard (the training box is often offline: no CDN).
#pragma once
#include <atomic>
#include <deque>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rig/hw/telemetry.h"

namespace rig::hw {

struct Alert {
  double time = 0;
  int gpu = -1;
  std::string
      kind;  // thermal_throttle, power_throttle, near_slowdown, ecc, xid, remap_pending, link
  std::string message;
  nlohmann::json to_json() const;
};

// Turns a stream of samples into alerts on rising edges, so a card that stays hot is reported
// once, not every second.
class AlertTracker {
 public:
  std::vector<Alert> update(const std::vector<GpuInfo>& gpus,
                            const std::vector<GpuSample>& samples);

 private:
  struct State {
    bool seen = false, thermal = false, power = false, hot = false, remap = false, link = false;
    std::optional<uint64_t> ecc_c, ecc_u;
  };
  std::vector<State> st_;
};

std::string xid_meaning(uint64_t xid);

struct PromLabels {
  std::string hostname, driver;
};
// Prometheus text exposition, one family per DCGM field. `last_xid[i]`: GPU i's last XID (0 none).
std::string prometheus_text(const std::vector<GpuInfo>& gpus, const std::vector<GpuSample>& samples,
                            const std::vector<uint64_t>& last_xid, const PromLabels& labels);

// A sample log: CSV or JSONL, chosen by the extension (.csv, .jsonl/.ndjson). Appends; flushed
// after every batch so `tail -f` and a crash both see whole lines.
class SampleLog {
 public:
  explicit SampleLog(const std::string& path);
  ~SampleLog();
  void write(const std::vector<GpuInfo>& gpus, const std::vector<GpuSample>& samples);
  bool csv() const { return csv_; }

 private:
  std::FILE* f_ = nullptr;
  bool csv_ = false;
  std::string path_;
};
std::vector<std::string> csv_columns();

// The terminal table, one line per GPU.
std::string render_table(const std::vector<GpuInfo>& gpus, const std::vector<GpuSample>& samples,
                         bool color = false);

// Reads DIR/metrics.jsonl (one JSON object per line with step, loss, lr, tokens_per_s...) into
// {"path", "keys", "points"}; keeps numeric fields; thins to at most `max_points`.
nlohmann::json read_run_metrics(const std::string& run_dir, size_t max_points = 2000);

// The dashboard page with the first state embedded (so it renders before its first poll).
std::string dashboard_html(const nlohmann::json& initial_state);

struct WatchOptions {
  std::string nvml_library;
  double interval_s = 1.0;
  long iterations = 0;    // 0: no limit
  double duration_s = 0;  // 0: no limit
  std::string log_path;
  int prometheus_port = -1;  // -1: off; 0: any free port
  int http_port = -1;
  std::string bind = "127.0.0.1";
  std::string run_dir;
  bool clear_screen =
      false;  // redraw in place (a terminal); otherwise print frames one after another
  bool color = false;
  size_t history = 600;  // points kept per GPU for the dashboard
};

// Called once the servers listen, with their ports (-1 when off).
using WatchReady = std::function<void(int prometheus_port, int http_port)>;

// Runs until the iteration or duration limit, or until *stop turns true. Returns the number of
// alerts raised. Throws rig::Error when NVML cannot be loaded or a port cannot be bound.
int run_watch(const WatchOptions& opt, std::ostream& out, const std::atomic<bool>* stop = nullptr,
              WatchReady ready = nullptr);

}  // namespace rig::hw
