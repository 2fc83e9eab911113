#include "rig/train/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "rig/core/error.h"

namespace rig {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = int64_t(std::llround(s));
  if (t < 60) return fmt::format("{}s", t);
  if (t < 3600) return fmt::format("{}m{:02}s", t / 60, t % 60);
  if (t < 86400) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
  return fmt::format("{}d{:02}h", t / 86400, (t % 86400) / 3600);
}

std::string format_count(double v) {
  double a = std::fabs(v);
  if (a >= 1e9) return fmt::format("{:.3g}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:.3g}M", v / 1e6);
  if (a >= 1e3) return fmt::format("{:.3g}k", v / 1e3);
  return fmt::format("{:.3g}", v);
}

Progress::Progress(int64_t total, int64_t first, std::FILE* out, ProgressOptions opt)
    : total_(total), first_(first), out_(out), opt_(opt) {
  tty_ = opt_.tty ? *opt_.tty : (out_ && ::isatty(::fileno(out_)));
  if (tty_ && opt_.width <= 0) {
    struct winsize w {};
    opt_.width = (::ioctl(::fileno(out_), TIOCGWINSZ, &w) == 0 && w.ws_col > 0) ? w.ws_col : 80;
  }
  if (opt_.width <= 0) opt_.width = 80;
  t0_ = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Progress::~Progress() { finish(); }

double Progress::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
             .count() -
         t0_;
}

std::string Progress::status(const StepMetrics& m, double elapsed) const {
  std::string s = total_ > 0 ? fmt::format("step {}/{}", m.step, total_) : fmt::format("step {}", m.step);
  s += fmt::format(" loss {:.4f}", m.loss);
  if (m.eval_loss) s += fmt::format(" eval {:.4f}", *m.eval_loss);
  s += fmt::format(" lr {:.2e} {} tok/s", m.lr, format_count(m.tokens_per_s));
  int64_t done = m.step - first_;
  if (total_ > 0 && done > 0 && elapsed > 0) {
    double eta = elapsed / double(done) * double(std::max<int64_t>(0, total_ - m.step));
    s += " ETA " + format_duration(eta);
  }
  return s;
}

void Progress::update(const StepMetrics& m) { update_at(m, now()); }

void Progress::update_at(const StepMetrics& m, double t) {
  if (!out_) return;
  // The first update marks the start; ETA is measured from there (excluding start-up).
  if (start_ < 0) start_ = t - 1e-9;
  bool last = total_ > 0 && m.step >= total_;
  double elapsed = t - start_;
  if (tty_) {
    if (!last && t - last_draw_ < opt_.redraw_s) return;
    last_draw_ = t;
    std::string st = status(m, elapsed);
    std::string bar;
    if (total_ > 0) {
      int w = 20;
      double frac = std::clamp(double(m.step) / double(total_), 0.0, 1.0);
      int full = int(frac * w);
      bar = fmt::format("[{}{}] {:3.0f}% ", std::string(size_t(full), '#'),
                        std::string(size_t(w - full), '-'), frac * 100);
    }
    std::string line = bar + st;
    if (int(line.size()) >= opt_.width) line.resize(size_t(std::max(0, opt_.width - 1)));
    std::fprintf(out_, "\r\033[K%s", line.c_str());
    std::fflush(out_);
    drawn_ = true;
    return;
  }
  bool due = last_plain_step_ < 0 || last ||
             (opt_.plain_every_steps > 0 && m.step - last_plain_step_ >= opt_.plain_every_steps) ||
             (opt_.plain_every_s > 0 && t - last_draw_ >= opt_.plain_every_s);
  if (!due || m.step == last_plain_step_) return;
  last_draw_ = t;
  last_plain_step_ = m.step;
  std::fprintf(out_, "%s\n", status(m, elapsed).c_str());
  std::fflush(out_);
}

void Progress::message(const std::string& text) {
  if (!out_) return;
  if (tty_ && drawn_) std::fputs("\r\033[K", out_);
  std::fprintf(out_, "%s\n", text.c_str());
  if (tty_) last_draw_ = -1e30;  // redraw the bar on the next update
  std::fflush(out_);
}

void Progress::finish() {
  if (out_ && tty_ && drawn_) std::fputc('\n', out_);
  drawn_ = false;
  if (out_) std::fflush(out_);
}

}  // namespace rig
