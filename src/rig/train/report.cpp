#include "rig/train/report.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "rig/core/allocator.h"
#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "rig/train/progress.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string html_escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&#39;"; break;
      default: o += c;
    }
  }
  return o;
}

// JSON inside <script>: "</" would end the element early.
std::string script_safe(std::string s) {
  for (size_t p = 0; (p = s.find("</", p)) != std::string::npos; p += 3) s.replace(p, 2, "<\\/");
  return s;
}

const char* kStyle = R"CSS(
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1d2330;background:#fafbfc}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 8px}
.sub{color:#667;margin-bottom:16px}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #dde;padding:4px 10px;text-align:left}
th{background:#f0f2f6;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:16px}
figure.chart{margin:0;background:#fff;border:1px solid #dde;border-radius:6px;padding:8px 8px 4px}
figure.chart figcaption{font-weight:600;margin:0 0 4px 6px}
figure.chart.empty{color:#889;min-width:200px}
svg.plot text{font-size:11px;fill:#556} svg.plot .grid{stroke:#eceef3} svg.plot .axis{stroke:#99a}
pre{background:#fff;border:1px solid #dde;padding:10px;overflow:auto;max-height:480px}
.warn{color:#a33}
)CSS";

// Draws every <figure class="chart" data-series="a,b"> as an SVG line chart of metrics rows.
const char* kScript = R"JS(
(function () {
  var rows = JSON.parse(document.getElementById('metrics').textContent);
  var NS = 'http://www.w3.org/2000/svg';
  var W = 520, H = 270, L = 62, R = 14, T = 28, B = 34, MAXPTS = 4000;
  var COLORS = ['#2f6fdb', '#e2572b', '#1f9d55', '#8a4fd3', '#c28a00'];
  function el(tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function niceTicks(lo, hi, n) {
    var span = hi - lo, step0 = span / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
    var err = step0 / mag, step = (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1) * mag;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
    return out;
  }
  function fmt(v) {
    var a = Math.abs(v);
    if (a === 0) return '0';
    if (a >= 1e5 || a < 1e-2) return v.toExponential(1);
    return String(+v.toPrecision(4));
  }
  // Points [step, value]; a null value (NaN or Inf when logged) marks a gap in the line.
  function series(key, scale) {
    var pts = [], gap = false;
    rows.forEach(function (r) {
      var v = r[key];
      if (v === null && pts.length) gap = true;
      if (typeof v !== 'number' || !isFinite(v) || typeof r.step !== 'number') return;
      var p = [r.step, v / scale];
      if (gap) p.gap = true;
      gap = false;
      pts.push(p);
    });
    return pts;
  }
  function thin(pts) {
    if (pts.length <= MAXPTS) return pts;
    var k = Math.ceil(pts.length / MAXPTS), out = pts.filter(function (p, i) { return i % k === 0 || p.gap; });
    if (out[out.length - 1] !== pts[pts.length - 1]) out.push(pts[pts.length - 1]);
    return out;
  }
  function draw(fig) {
    var keys = fig.getAttribute('data-series').split(','), scale = +(fig.getAttribute('data-scale') || 1);
    var all = [];
    keys.forEach(function (k, i) {
      var p = series(k, scale);
      if (p.length) all.push({key: k, total: p.length, pts: thin(p), color: COLORS[i % COLORS.length]});
    });
    if (!all.length) {
      fig.classList.add('empty');
      fig.appendChild(document.createTextNode('no data'));
      return;
    }
    var x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    all.forEach(function (s) {
      s.pts.forEach(function (p) {
        x0 = Math.min(x0, p[0]); x1 = Math.max(x1, p[0]);
        y0 = Math.min(y0, p[1]); y1 = Math.max(y1, p[1]);
      });
    });
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { var d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    var dataMin = y0, pad = (y1 - y0) * 0.05;
    y0 -= pad; y1 += pad;
    if (dataMin >= 0 && y0 < 0) y0 = 0;  // non-negative quantities keep a zero floor
    function X(v) { return L + (v - x0) / (x1 - x0) * (W - L - R); }
    function Y(v) { return H - B - (v - y0) / (y1 - y0) * (H - T - B); }
    var svg = el('svg', {viewBox: '0 0 ' + W + ' ' + H, width: W, height: H, 'class': 'plot'}, fig);
    niceTicks(y0, y1, 5).forEach(function (v) {
      el('line', {x1: L, x2: W - R, y1: Y(v), y2: Y(v), 'class': 'grid'}, svg);
      el('text', {x: L - 6, y: Y(v) + 4, 'text-anchor': 'end'}, svg).textContent = fmt(v);
    });
    niceTicks(x0, x1, 6).forEach(function (v) {
      el('line', {x1: X(v), x2: X(v), y1: T, y2: H - B, 'class': 'grid'}, svg);
      el('text', {x: X(v), y: H - B + 16, 'text-anchor': 'middle'}, svg).textContent = fmt(v);
    });
    el('line', {x1: L, x2: W - R, y1: H - B, y2: H - B, 'class': 'axis'}, svg);
    el('line', {x1: L, x2: L, y1: T, y2: H - B, 'class': 'axis'}, svg);
    el('text', {x: (L + W - R) / 2, y: H - 4, 'text-anchor': 'middle'}, svg).textContent = 'step';
    all.forEach(function (s, i) {
      var d = s.pts.map(function (p, j) { return (j && !p.gap ? 'L' : 'M') + X(p[0]).toFixed(1) + ' ' + Y(p[1]).toFixed(1); }).join(' ');
      el('path', {d: d, fill: 'none', stroke: s.color, 'stroke-width': 1.6, 'class': 'series series-' + s.key,
                  'data-points': s.pts.length, 'data-total': s.total}, svg);
      if (s.pts.length <= 60)
        s.pts.forEach(function (p) { el('circle', {cx: X(p[0]), cy: Y(p[1]), r: 2.2, fill: s.color, 'class': 'dot dot-' + s.key}, svg); });
      var lx = L + i * 150;  // legend in the top margin, clear of the data
      el('rect', {x: lx, y: 6, width: 10, height: 10, fill: s.color}, svg);
      el('text', {x: lx + 14, y: 15}, svg).textContent = s.key + ' (' + fmt(s.pts[s.pts.length - 1][1]) + ')';
    });
  }
  var figs = document.querySelectorAll('figure.chart');
  for (var i = 0; i < figs.length; ++i) draw(figs[i]);
  document.body.setAttribute('data-rendered', String(figs.length));
})();
)JS";

struct Chart {
  std::string id, title, series;
  double scale = 1;
};

std::optional<double> number(const json& r, const char* k) {
  auto it = r.find(k);
  if (it == r.end() || !it->is_number()) return std::nullopt;
  double v = it->get<double>();
  return std::isfinite(v) ? std::optional<double>(v) : std::nullopt;
}

// The summary table's rows: last and best losses, throughput, memory, wall time.
std::vector<std::pair<std::string, std::string>> summarize(const MetricsFile& mf) {
  std::optional<double> last_loss, min_loss, last_eval, best_eval, first_t, last_t;
  int64_t min_loss_step = -1, best_eval_step = -1, last_step = -1, steps = 0;
  double tps_sum = 0;
  int64_t tps_n = 0;
  double peak = 0;
  for (const auto& r : mf.rows) {
    if (r.contains("event")) continue;
    auto step = number(r, "step");
    if (step) last_step = std::max(last_step, int64_t(*step));
    if (auto l = number(r, "loss")) {
      ++steps;
      last_loss = l;
      if (!min_loss || *l < *min_loss) min_loss = l, min_loss_step = step ? int64_t(*step) : -1;
    }
    if (auto e = number(r, "eval_loss")) {
      last_eval = e;
      if (!best_eval || *e < *best_eval) best_eval = e, best_eval_step = step ? int64_t(*step) : -1;
    }
    if (auto t = number(r, "tokens_per_s"); t && *t > 0) tps_sum += *t, ++tps_n;
    if (auto p = number(r, "peak_memory_bytes")) peak = std::max(peak, *p);
    if (auto t = number(r, "time")) {
      first_t = first_t ? std::min(*first_t, *t) : *t;
      last_t = last_t ? std::max(*last_t, *t) : *t;
    }
  }
  auto opt4 = [](std::optional<double> v) {
    return v ? fmt::format("{:.4f}", *v) : std::string("–");
  };
  return {
      {"last step", last_step >= 0 ? std::to_string(last_step) : "–"},
      {"steps logged", std::to_string(steps)},
      {"last loss", opt4(last_loss)},
      {"lowest loss", min_loss ? fmt::format("{:.4f} (step {})", *min_loss, min_loss_step) : "–"},
      {"last eval loss", opt4(last_eval)},
      {"best eval loss",
       best_eval ? fmt::format("{:.4f} (step {})", *best_eval, best_eval_step) : "–"},
      {"mean throughput", tps_n ? format_count(tps_sum / double(tps_n)) + " tokens/s" : "–"},
      {"peak memory", peak > 0 ? format_bytes(peak) : "–"},
      {"wall time", first_t && last_t ? format_duration(*last_t - *first_t) : "–"}};
}

// The guard's events, one line each: the step, the event and its fields (docs/reliability.md
// lists them).
std::string events_html(const std::vector<json>& events) {
  std::string h;
  h += "<h2>Guard events</h2>\n<table class=\"events\"><tr><th>step</th><th>event</th>"
       "<th>details</th></tr>\n";
  for (const auto& e : events) {
    std::string details;
    for (auto& [k, v] : e.items()) {
      if (k == "event" || k == "step" || k == "time") continue;
      details += (details.empty() ? "" : "; ") + k + " " +
                 (v.is_string() ? v.get<std::string>() : v.dump());
    }
    h += fmt::format("<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>\n",
                     html_escape(e.value("step", json()).dump()), html_escape(e.value("event", "")),
                     html_escape(details));
  }
  h += "</table>\n";
  return h;
}

// The complete checkpoints of the run, by step.
std::string checkpoints_html(const std::string& run_dir) {
  std::string h;
  auto ckpts = list_checkpoints(run_dir);
  h += "<h2>Checkpoints</h2>\n";
  if (ckpts.empty()) {
    h += "<p>none complete</p>\n";
  } else {
    h += "<table class=\"checkpoints\"><tr><th>step</th><th>folder</th></tr>\n";
    for (const auto& c : ckpts)
      h += fmt::format("<tr><td class=\"num\">{}</td><td>{}</td></tr>\n", c.step,
                       html_escape(c.dir));
    h += "</table>\n";
  }
  return h;
}

}  // namespace

std::string render_report_html(const std::string& run_dir) {
  if (!fs::is_directory(run_dir)) bad_input("{}: no such run folder", run_dir);
  std::string mpath = (fs::path(run_dir) / "metrics.jsonl").string();
  if (!fs::exists(mpath)) bad_input("{}: no metrics.jsonl (is this a run folder?)", run_dir);
  MetricsFile mf = read_metrics(mpath);

  // Only numbers go into the page; other fields are not charted.
  json rows = json::array();
  std::set<std::string> numeric;
  size_t nonfinite_loss = 0;
  // The guard's event lines (skipped steps, rollbacks, ...) are listed, not charted.
  std::vector<json> events;
  for (const auto& r : mf.rows) {
    if (r.contains("event")) {
      events.push_back(r);
      continue;
    }
    json o = json::object();
    for (auto& [k, v] : r.items()) {
      if (v.is_number()) numeric.insert(k);
      if (v.is_number() || v.is_null()) o[k] = v;  // null: a NaN/Inf, drawn as a gap
    }
    if (r.contains("loss") && !number(r, "loss")) ++nonfinite_loss;
    rows.push_back(std::move(o));
  }

  std::vector<Chart> charts = {{"chart-loss", "Loss", "loss,eval_loss", 1},
                               {"chart-lr", "Learning rate", "lr", 1},
                               {"chart-throughput", "Throughput (tokens/s)", "tokens_per_s", 1},
                               {"chart-memory", "Peak memory (GiB)", "peak_memory_bytes", 1073741824.0},
                               {"chart-grad-norm", "Gradient norm", "grad_norm", 1}};
  std::set<std::string> shown = {"step", "time", "loss", "eval_loss", "lr", "tokens_per_s",
                                 "peak_memory_bytes", "grad_norm"};
  for (const auto& k : numeric)
    if (!shown.count(k)) charts.push_back({"chart-x-" + k, k, k, 1});

  const std::vector<std::pair<std::string, std::string>> summary = summarize(mf);

  fs::path abs = fs::absolute(run_dir).lexically_normal();
  if (abs.filename().empty()) abs = abs.parent_path();  // "runs/x/" -> "runs/x"
  std::string name = abs.filename().string();
  std::string h;
  h += "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n";
  h += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  h += fmt::format("<title>rig report: {}</title>\n<style>{}</style></head>\n<body>\n",
                   html_escape(name), kStyle);
  h += fmt::format("<h1>rig report: {}</h1>\n<div class=\"sub\">{} &middot; {} metrics lines</div>\n",
                   html_escape(name), html_escape(abs.string()),
                   mf.rows.size());
  if (mf.skipped)
    h += fmt::format("<p class=\"warn\">{} unreadable line(s) in metrics.jsonl were skipped (a run "
                     "killed mid-write leaves one).</p>\n",
                     mf.skipped);
  if (nonfinite_loss)
    h += fmt::format("<p class=\"warn\" id=\"nonfinite\">{} step(s) logged a NaN or infinite loss; "
                     "they are gaps in the loss chart.</p>\n",
                     nonfinite_loss);
  h += "<h2>Summary</h2>\n<table class=\"summary\">\n";
  for (const auto& [k, v] : summary)
    h += fmt::format("<tr><th>{}</th><td class=\"num\">{}</td></tr>\n", html_escape(k), html_escape(v));
  h += "</table>\n";
  if (!events.empty()) h += events_html(events);
  h += "<h2>Curves</h2>\n<noscript><p class=\"warn\">The charts are drawn by an inline "
       "script; enable JavaScript to see them.</p></noscript>\n<div class=\"charts\">\n";
  for (const auto& c : charts)
    h += fmt::format("<figure class=\"chart\" id=\"{}\" data-series=\"{}\" data-scale=\"{}\">"
                     "<figcaption>{}</figcaption></figure>\n",
                     html_escape(c.id), html_escape(c.series), c.scale, html_escape(c.title));
  h += "</div>\n";

  h += checkpoints_html(run_dir);
  fs::path cfg = fs::path(run_dir) / "config.yaml";
  if (fs::exists(cfg)) {
    h += "<h2>Config</h2>\n<pre class=\"config\">" + html_escape(read_file(cfg.string())) + "</pre>\n";
  }
  h += "<script type=\"application/json\" id=\"metrics\">" + script_safe(rows.dump()) + "</script>\n";
  h += std::string("<script>") + kScript + "</script>\n</body></html>\n";
  return h;
}

std::string write_report(const std::string& run_dir, const std::string& out) {
  std::string html = render_report_html(run_dir);
  std::string path = out.empty() ? (fs::path(run_dir) / "report.html").string() : out;
  write_file_atomic(path, html);
  return path;
}

}  // namespace rig
