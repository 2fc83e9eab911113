// A run's measurements: RUN_DIR/metrics.jsonl, one JSON object per line, flushed as written (a
// killed run keeps every finished step), read by `rig report` and anything else (pandas, jq);
// and RUN_DIR/train.log, the same in words with timestamps, plus notes.
#pragma once
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace rig {

struct StepMetrics {
  int64_t step = 0;                // optimizer steps done
  double loss = 0;                 // mean training loss over the step's micro-batches
  double lr = 0;
  double grad_norm = 0;            // before clipping
  double tokens_per_s = 0;
  uint64_t peak_memory_bytes = 0;  // the device allocator's peak
  std::optional<double> eval_loss;
  nlohmann::json extra = nlohmann::json::object();  // any further fields, written as given
  nlohmann::json to_json() const;  // includes "time" (Unix seconds) when `time` > 0
  double time = 0;
};

class MetricsWriter {
 public:
  // Opens RUN_DIR/metrics.jsonl and RUN_DIR/train.log for appending, creating RUN_DIR. When
  // resuming from a checkpoint at `resume_step`, the lines of later steps (written after that
  // checkpoint by the run that died) are dropped first, so every step appears once.
  explicit MetricsWriter(const std::string& run_dir, int64_t resume_step = -1);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void log(const StepMetrics& m);
  // An evaluation on its own line: {"step", "eval_loss", ...extra}.
  void log_eval(int64_t step, double eval_loss, const nlohmann::json& extra = nlohmann::json::object());
  // A line of text in train.log only ("saved checkpoint step-100", "rolled back to step 80").
  void note(const std::string& text);
  // What the guard saw or did: {"event": name, "step": step, ...fields, "time"} in metrics.jsonl
  // and `text` in train.log. Event lines outlive truncate_metrics_after: they are the run's
  // history, not its curve.
  void event(const std::string& name, int64_t step, const nlohmann::json& fields,
             const std::string& text);
  // After a rollback to `step`: drops the step lines past it (events stay), as a resume does.
  size_t rewind(int64_t step);

  const std::string& metrics_path() const { return metrics_path_; }
  const std::string& log_path() const { return log_path_; }

 private:
  void write_line(const nlohmann::json& j);
  std::string metrics_path_, log_path_;
  std::FILE* metrics_ = nullptr;
  std::FILE* log_ = nullptr;
};

struct MetricsFile {
  std::vector<nlohmann::json> rows;  // in file order
  size_t skipped = 0;                // lines that were not JSON objects (a torn last line)
};
// Reads a metrics.jsonl, tolerating a torn line from a killed writer (counted in `skipped`).
// Throws InputError when the file cannot be read.
MetricsFile read_metrics(const std::string& path);

// Drops lines whose "step" is above `step` (atomically rewritten), except event lines (those
// with an "event" field); returns how many went.
size_t truncate_metrics_after(const std::string& path, int64_t step);

}  // namespace rig
