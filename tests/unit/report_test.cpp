// Metrics files, console progress and the HTML report (opened in headless Chromium when present).
#include "rig/train/report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "rig/train/progress.h"
#include "rig/train/train_config.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

rig::StepMetrics step_metrics(int64_t s) {
  rig::StepMetrics m;
  m.step = s;
  m.loss = 3.0 * std::exp(-0.05 * double(s)) + 0.5;
  m.lr = 1e-3 * std::min(1.0, double(s) / 5.0);
  m.grad_norm = 1.0 / double(s);
  m.tokens_per_s = 1000 + 10 * double(s);
  m.peak_memory_bytes = (1ull << 30) + uint64_t(s) * (1 << 20);
  m.time = 1.7e9 + double(s);
  return m;
}

// A run of 50 steps: step 25's loss is NaN, an evaluation every 10 steps, a custom metric.
std::string make_run(const std::string& name) {
  std::string run = rig::test::temp_dir(name);
  rig::MetricsWriter w(run);
  for (int64_t s = 1; s <= 50; ++s) {
    rig::StepMetrics m = step_metrics(s);
    if (s == 25) m.loss = std::nan("");
    m.extra = {{"loss_scale", 1.0}, {"phase", "train"}};
    w.log(m);
    if (s % 10 == 0) w.log_eval(s, 2.0 - 0.01 * double(s));
  }
  w.note("done");
  return run;
}

TEST(Metrics, LinesAreJsonAndFlushed) {
  std::string run = make_run("metrics_lines");
  // Read while nothing is closed: every line is already on disk.
  rig::MetricsFile f = rig::read_metrics(run + "/metrics.jsonl");
  ASSERT_EQ(f.rows.size(), 55u);
  EXPECT_EQ(f.skipped, 0u);
  const json& r = f.rows[0];
  for (const char* k :
       {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes", "time"})
    EXPECT_TRUE(r.contains(k)) << k;
  EXPECT_EQ(r["phase"], "train");
  EXPECT_EQ(f.rows[26]["step"], 25);          // after the eval lines of steps 10 and 20
  EXPECT_TRUE(f.rows[26]["loss"].is_null());  // NaN is written as null
  EXPECT_NEAR(f.rows[10]["eval_loss"].get<double>(), 1.9, 1e-12);
  std::string log = rig::read_file(run + "/train.log");
  EXPECT_NE(log.find("step 3 loss"), std::string::npos) << log;
  EXPECT_NE(log.find("eval_loss 1.9000"), std::string::npos);
  EXPECT_NE(log.find("done"), std::string::npos);
}

TEST(Metrics, ResumeDropsLaterStepsAndTornLines) {
  std::string run = rig::test::temp_dir("metrics_resume");
  {
    rig::MetricsWriter w(run);
    for (int64_t s = 1; s <= 10; ++s) w.log(step_metrics(s));
  }
  // A writer killed mid-line leaves a torn tail.
  { std::ofstream(run + "/metrics.jsonl", std::ios::app) << "{\"step\": 11, \"lo"; }
  EXPECT_EQ(rig::read_metrics(run + "/metrics.jsonl").skipped, 1u);
  {
    rig::MetricsWriter w(run, 6);  // resumed from the checkpoint of step 6
    w.log(step_metrics(7));
  }
  rig::MetricsFile f = rig::read_metrics(run + "/metrics.jsonl");
  EXPECT_EQ(f.skipped, 0u);
  ASSERT_EQ(f.rows.size(), 7u);
  EXPECT_EQ(f.rows.back()["step"], 7);
  EXPECT_NE(rig::read_file(run + "/train.log").find("resuming after step 6"), std::string::npos);

  // Without a resume step, a torn line gets its newline so the next line is whole.
  { std::ofstream(run + "/metrics.jsonl", std::ios::app) << "{\"step\": 8, \"lo"; }
  {
    rig::MetricsWriter w(run);
    w.log(step_metrics(8));
  }
  f = rig::read_metrics(run + "/metrics.jsonl");
  EXPECT_EQ(f.skipped, 1u);
  EXPECT_EQ(f.rows.back()["step"], 8);
}

TEST(Progress, PlainLinesWhenNotATerminal) {
  std::string path = rig::test::temp_dir("progress_plain") + "/out.txt";
  std::FILE* f = std::fopen(path.c_str(), "w");
  {
    rig::ProgressOptions o;
    o.plain_every_steps = 25;
    o.plain_every_s = 0;
    rig::Progress p(100, 0, f, o);
    EXPECT_FALSE(p.is_tty());
    for (int64_t s = 1; s <= 100; ++s) p.update_at(step_metrics(s), 0.5 * double(s));
    p.message("saved checkpoint step-100");
  }
  std::fclose(f);
  std::string out = rig::read_file(path);
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_EQ(out.find("\033"), std::string::npos);
  // Steps 1, 26, 51, 76 and the last one, then the message.
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 6) << out;
  EXPECT_NE(out.find("step 1/100 loss"), std::string::npos) << out;
  EXPECT_NE(out.find("step 100/100"), std::string::npos) << out;
  EXPECT_NE(out.find("saved checkpoint"), std::string::npos);
}

TEST(Progress, RedrawnBarOnATerminal) {
  std::string path = rig::test::temp_dir("progress_tty") + "/out.txt";
  std::FILE* f = std::fopen(path.c_str(), "w");
  {
    rig::ProgressOptions o;
    o.tty = true;
    o.width = 120;
    o.redraw_s = 1.0;
    rig::Progress p(10, 0, f, o);
    for (int64_t s = 1; s <= 10; ++s) p.update_at(step_metrics(s), 0.25 * double(s));
  }
  std::fclose(f);
  std::string out = rig::read_file(path);
  // Redrawn at most once a second of the 2.5 s, plus the final step; one newline at the end.
  size_t draws = 0;
  for (size_t p = 0; (p = out.find("\r\033[K", p)) != std::string::npos; ++p) ++draws;
  EXPECT_GE(draws, 2u);
  EXPECT_LE(draws, 4u);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  EXPECT_NE(out.find("[####################] 100% step 10/10"), std::string::npos) << out;
  EXPECT_NE(out.find("tok/s"), std::string::npos);

  rig::StepMetrics m = step_metrics(40);
  rig::Progress p(100, 20, nullptr);
  // 20 steps in 100 s from step 20: 60 steps left -> 300 s.
  EXPECT_NE(p.status(m, 100).find("ETA 5m00s"), std::string::npos) << p.status(m, 100);
  EXPECT_EQ(rig::format_duration(7322), "2h02m");
  EXPECT_EQ(rig::format_count(12345), "12.3k");
}

// The page after Chromium ran its scripts, or "" when there is no Chromium.
std::string rendered_dom(const std::string& html_path, std::string* why) {
  std::string browser;
  for (const char* b : {"chromium", "chromium-browser", "google-chrome"}) {
    std::string cmd = std::string("command -v ") + b + " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) {
      browser = b;
      break;
    }
  }
  if (browser.empty()) {
    *why = "no chromium on PATH (scripts/setup.sh installs it)";
    return "";
  }
  // A profile per page: ctest -j runs these tests at once, and a shared one was wiped under
  // the other browser.
  std::string profile = rig::test::temp_dir("chromium-profile-" +
                                            fs::path(html_path).parent_path().filename().string());
  std::string out = fs::path(html_path).parent_path().string() + "/dom.html";
  std::string cmd = "timeout 120 " + browser +
                    " --headless --no-sandbox --disable-gpu --disable-background-networking "
                    "--disable-component-update --no-first-run --user-data-dir=" +
                    profile + " --dump-dom file://" + fs::absolute(html_path).string() + " > " +
                    out + " 2>/dev/null";
  int rc = std::system(cmd.c_str());
  if (rc != 0) {
    *why = "chromium failed: " + std::to_string(rc);
    return "";
  }
  return rig::read_file(out);
}

// data-points of the <path> of series `key`, or -1.
int points_of(const std::string& dom, const std::string& key) {
  std::smatch m;
  std::regex re("<path[^>]*class=\"series series-" + key + "\"[^>]*data-points=\"(\\d+)\"");
  if (!std::regex_search(dom, m, re)) return -1;
  return std::stoi(m[1]);
}

TEST(Report, SelfContainedPageWithData) {
  std::string run = make_run("report_page");
  rig::TrainConfig c = rig::parse_train_config(
      "model: m\ndatasets: [d.jsonl]\nmax_steps: 50\noutput_dir: runs/<x>\n", "cfg.yaml");
  rig::save_run_config(c, run);
  rig::save_checkpoint(run, 50, {{"w", rig::Tensor::from_f32({1, 2}, {2})}}, json::object());

  auto r = rig::test::run_rig("report " + run);
  ASSERT_EQ(r.code, 0) << r.out;
  std::string path = run + "/report.html";
  EXPECT_NE(r.out.find(path), std::string::npos) << r.out;
  std::string html = rig::read_file(path);
  // No network: nothing loaded from elsewhere.
  EXPECT_EQ(html.find("src=\"http"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find("@import"), std::string::npos);
  EXPECT_NE(html.find("runs/&lt;x&gt;"), std::string::npos);  // the config, escaped
  EXPECT_NE(html.find("step-50"), std::string::npos);
  EXPECT_NE(html.find("id=\"nonfinite\""), std::string::npos);
  EXPECT_NE(html.find("chart-x-loss_scale"), std::string::npos);  // extra numeric metric
  EXPECT_EQ(html.find("chart-x-phase"), std::string::npos);       // strings are not charted
  std::string last_loss = fmt::format("{:.4f}", step_metrics(50).loss);
  EXPECT_NE(html.find("<td class=\"num\">" + last_loss + "</td>"), std::string::npos) << last_loss;

  auto out = rig::test::run_rig("report " + run + " --out " + run + "/other.html");
  EXPECT_EQ(out.code, 0);
  EXPECT_TRUE(fs::exists(run + "/other.html"));
}

TEST(Report, GuardEventsAreListedNotCharted) {
  std::string run = rig::test::temp_dir("report_events");
  {
    rig::MetricsWriter w(run);
    for (int64_t s = 1; s <= 6; ++s) w.log(step_metrics(s));
    w.event("rollback", 6, {{"rule", "loss"}, {"value", 87.5}, {"to_step", 4}}, "rolled back");
  }
  // A rollback's rewind keeps the event, as a resume's truncation does.
  EXPECT_EQ(rig::truncate_metrics_after(run + "/metrics.jsonl", 4), 2u);
  std::string html = rig::render_report_html(run);
  EXPECT_NE(html.find("<h2>Guard events</h2>"), std::string::npos);
  EXPECT_NE(html.find("<td>rollback</td><td>rule loss; to_step 4; value 87.5</td>"),
            std::string::npos)
      << html;
  EXPECT_EQ(html.find("chart-x-value"), std::string::npos);  // its numbers are not a curve
  EXPECT_EQ(html.find("chart-x-to_step"), std::string::npos);
}

TEST(Report, ChromiumDrawsTheCharts) {
  std::string run = make_run("report_chromium");
  std::string path = rig::write_report(run);
  std::string why;
  std::string dom = rendered_dom(path, &why);
  if (dom.empty()) RIG_MISSING_TOOL(why);
  EXPECT_NE(dom.find("data-rendered=\"6\""), std::string::npos) << dom.substr(0, 2000);
  EXPECT_EQ(points_of(dom, "loss"), 49);  // 50 steps, one NaN...
  std::smatch m;                          // ...which breaks the line in two: a second move-to
  ASSERT_TRUE(std::regex_search(dom, m, std::regex("<path d=\"([^\"]*)\"[^>]*series-loss\"")));
  EXPECT_EQ(std::count(m[1].first, m[1].second, 'M'), 2) << m[1];
  EXPECT_EQ(points_of(dom, "eval_loss"), 5);
  EXPECT_EQ(points_of(dom, "lr"), 50);
  EXPECT_EQ(points_of(dom, "tokens_per_s"), 50);
  EXPECT_EQ(points_of(dom, "peak_memory_bytes"), 50);
  EXPECT_EQ(points_of(dom, "grad_norm"), 50);
  EXPECT_EQ(points_of(dom, "loss_scale"), 50);
  // Markers for the sparse eval series, axis labels drawn.
  size_t dots = 0;
  for (size_t p = 0; (p = dom.find("dot dot-eval_loss", p)) != std::string::npos; ++p) ++dots;
  EXPECT_EQ(dots, 5u);
  EXPECT_NE(dom.find(">step</text>"), std::string::npos);
}

TEST(Report, EmptyMetricsStillRender) {
  std::string run = rig::test::temp_dir("report_empty");
  { std::ofstream(run + "/metrics.jsonl") << ""; }
  std::string path = rig::write_report(run);
  std::string why;
  std::string dom = rendered_dom(path, &why);
  if (dom.empty()) RIG_MISSING_TOOL(why);
  EXPECT_NE(dom.find("no data"), std::string::npos);
  EXPECT_EQ(dom.find("class=\"series"), std::string::npos);
}

TEST(Report, BadRunFolder) {
  std::string run = rig::test::temp_dir("report_bad");
  EXPECT_THROW(rig::render_report_html(run), rig::InputError);
  EXPECT_THROW(rig::render_report_html(run + "/nope"), rig::InputError);
  auto r = rig::test::run_rig("report " + run);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("no metrics.jsonl"), std::string::npos) << r.out;
}

}  // namespace
