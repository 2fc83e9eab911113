#include "rig/train/metrics.h"

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <sstream>

#include "rig/core/allocator.h"
#include "rig/core/error.h"
#include "rig/io/atomic_file.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string timestamp() {
  auto t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

// NaN and Inf are not JSON: they are written as null (the report shows a gap and says so).
json num(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

std::FILE* open_append(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (!f) fail("{}: cannot open for appending: {}", path, std::strerror(errno));
  return f;
}

}  // namespace

json StepMetrics::to_json() const {
  json j = {{"step", step},
            {"loss", num(loss)},
            {"lr", num(lr)},
            {"grad_norm", num(grad_norm)},
            {"tokens_per_s", num(tokens_per_s)},
            {"peak_memory_bytes", peak_memory_bytes}};
  if (eval_loss) j["eval_loss"] = num(*eval_loss);
  if (time > 0) j["time"] = time;
  if (extra.is_object())
    for (auto& [k, v] : extra.items()) j[k] = v;
  return j;
}

MetricsWriter::MetricsWriter(const std::string& run_dir, int64_t resume_step) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) fail("{}: cannot create: {}", run_dir, ec.message());
  metrics_path_ = (fs::path(run_dir) / "metrics.jsonl").string();
  log_path_ = (fs::path(run_dir) / "train.log").string();
  size_t dropped = 0;
  if (resume_step >= 0 && fs::exists(metrics_path_))
    dropped = truncate_metrics_after(metrics_path_, resume_step);
  // A line torn by a killed writer gets its newline, so the next line stays whole.
  bool torn = false;
  if (auto size = fs::file_size(metrics_path_, ec); !ec && size > 0) {
    std::FILE* f = std::fopen(metrics_path_.c_str(), "rb");
    if (f && std::fseek(f, -1, SEEK_END) == 0) torn = std::fgetc(f) != '\n';
    if (f) std::fclose(f);
  }
  metrics_ = open_append(metrics_path_);
  if (torn) std::fputc('\n', metrics_);
  log_ = open_append(log_path_);
  if (resume_step >= 0)
    note(fmt::format("resuming after step {}{}", resume_step,
                     dropped ? fmt::format(" ({} later metrics lines dropped)", dropped) : ""));
}

MetricsWriter::~MetricsWriter() {
  if (metrics_) std::fclose(metrics_);
  if (log_) std::fclose(log_);
}

void MetricsWriter::write_line(const json& j) {
  std::string s = j.dump() + "\n";
  if (std::fwrite(s.data(), 1, s.size(), metrics_) != s.size() || std::fflush(metrics_) != 0)
    fail("{}: write failed: {}", metrics_path_, std::strerror(errno));
}

void MetricsWriter::log(const StepMetrics& m) {
  StepMetrics t = m;
  if (t.time <= 0) t.time = unix_now();
  write_line(t.to_json());
  std::string line = fmt::format("step {} loss {:.4f} lr {:.3e} grad_norm {:.3f} tok/s {:.0f} peak {}",
                                 m.step, m.loss, m.lr, m.grad_norm, m.tokens_per_s,
                                 format_bytes(double(m.peak_memory_bytes)));
  if (m.eval_loss) line += fmt::format(" eval_loss {:.4f}", *m.eval_loss);
  note(line);
}

void MetricsWriter::log_eval(int64_t step, double eval_loss, const json& extra) {
  json j = {{"step", step}, {"eval_loss", num(eval_loss)}, {"time", unix_now()}};
  if (extra.is_object())
    for (auto& [k, v] : extra.items()) j[k] = v;
  write_line(j);
  note(fmt::format("step {} eval_loss {:.4f}", step, eval_loss));
}

void MetricsWriter::event(const std::string& name, int64_t step, const json& fields,
                          const std::string& text) {
  json j = {{"event", name}, {"step", step}};
  if (fields.is_object())
    for (auto& [k, v] : fields.items()) j[k] = v;
  j["time"] = unix_now();
  write_line(j);
  note(text);
}

size_t MetricsWriter::rewind(int64_t step) {
  std::fclose(metrics_);
  metrics_ = nullptr;
  const size_t dropped = truncate_metrics_after(metrics_path_, step);
  metrics_ = open_append(metrics_path_);
  return dropped;
}

void MetricsWriter::note(const std::string& text) {
  std::string s = fmt::format("[{}] {}\n", timestamp(), text);
  if (std::fwrite(s.data(), 1, s.size(), log_) != s.size() || std::fflush(log_) != 0)
    fail("{}: write failed: {}", log_path_, std::strerror(errno));
}

MetricsFile read_metrics(const std::string& path) {
  std::string text = read_file(path);
  MetricsFile out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      ++out.skipped;
      continue;
    }
    out.rows.push_back(std::move(j));
  }
  return out;
}

size_t truncate_metrics_after(const std::string& path, int64_t step) {
  std::string text = read_file(path);
  std::string kept;
  size_t dropped = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, false);
    bool later = !j.is_discarded() && j.is_object() && j.contains("step") &&
                 j["step"].is_number() && j["step"].get<double>() > double(step) &&
                 !j.contains("event");
    // A torn line is dropped too: it would otherwise glue onto the next line written.
    if (later || j.is_discarded()) {
      dropped += line.find_first_not_of(" \t\r") != std::string::npos;
      continue;
    }
    kept += line + "\n";
  }
  if (dropped) write_file_atomic(path, kept);
  return dropped;
}

}  // namespace rig
