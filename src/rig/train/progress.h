// Progress of a run on the console. On a terminal: one line redrawn in place (step/total, a bar,
// loss, tokens/s, ETA). Piped to a file or a job log: a plain line now and then, since carriage
// returns make logs unreadable.
#pragma once
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "rig/train/metrics.h"

namespace rig {

struct ProgressOptions {
  std::optional<bool> tty;     // default: isatty(fileno(out))
  double redraw_s = 0.1;       // terminal: at most this often
  double plain_every_s = 30;   // otherwise: a line at least this far apart...
  int64_t plain_every_steps = 0;  // ...or every this many steps (0: time only)
  int width = 0;               // terminal columns; 0: ask the terminal (80 if it won't say)
};

class Progress {
 public:
  // `first_step`: where the run starts (a resumed run starts past 0; ETA counts from there).
  Progress(int64_t total_steps, int64_t first_step = 0, std::FILE* out = stderr,
           ProgressOptions opt = {});
  ~Progress();  // ends a redrawn line with a newline

  void update(const StepMetrics& m);
  void update_at(const StepMetrics& m, double now_s);  // with an explicit clock (tests)
  // A line of its own ("saved checkpoint ...") without garbling the redrawn bar.
  void message(const std::string& text);
  void finish();

  bool is_tty() const { return tty_; }
  // The status text for `m` with `elapsed_s` since the first step (no bar, no escapes).
  std::string status(const StepMetrics& m, double elapsed_s) const;

 private:
  double now() const;
  int64_t total_, first_;
  std::FILE* out_;
  ProgressOptions opt_;
  bool tty_ = false, drawn_ = false;
  double start_ = -1, last_draw_ = -1e30;
  int64_t last_plain_step_ = -1;
  double t0_ = 0;
};

// "45s", "3m12s", "2h05m", "3d04h".
std::string format_duration(double seconds);
// 12345.6 -> "12.3k", 1234567 -> "1.23M".
std::string format_count(double v);

}  // namespace rig
