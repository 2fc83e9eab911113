// The `rig watch --http` page: one self-contained HTML file (no CDN, no external script: the
// training box is often offline). The first state is embedded, so the GPU cards render on load;
// the script then polls /api/state and /api/run every second and draws the charts on canvases.
#include <string>

#include "rig/hw/watch.h"

namespace rig::hw {

namespace {

const char* kPage = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rig watch</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;background:#111418;color:#dde3ea}
header{padding:10px 16px;background:#1b2027;display:flex;gap:16px;align-items:baseline}
header h1{font-size:18px;margin:0}
#status{color:#8a96a3}
main{padding:12px 16px}
#gpus{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:12px}
.gpu-card{background:#1b2027;border-radius:8px;padding:10px 12px;border-left:4px solid #3a8a4a}
.gpu-card.warn{border-left-color:#c9a227}.gpu-card.hot{border-left-color:#d0433b}
.gpu-card h2{font-size:15px;margin:0 0 6px}
.kv{display:grid;grid-template-columns:repeat(3,1fr);gap:2px 10px;font-variant-numeric:tabular-nums}
.kv span b{color:#fff;font-weight:600}
canvas{width:100%;height:90px;display:block;margin-top:6px;background:#14181d;border-radius:4px}
#alerts{margin-top:14px}#alerts li{color:#f0a39e}
#run{margin-top:18px}#run .charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:12px}
.legend{font-size:12px;color:#8a96a3}
</style></head>
<body>
<header><h1>rig watch</h1><span id="host"></span><span id="status">loading</span></header>
<main>
<section id="gpus"></section>
<section id="alerts"><h3>Alerts</h3><ul id="alert-list"></ul></section>
<section id="run"><h3>Training run</h3><div id="run-summary">no run (start rig watch with --run DIR)</div><div class="charts" id="run-charts"></div></section>
</main>
<script>window.RIG_INITIAL = __RIG_INITIAL__;</script>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const fmt = (v, d = 0, u = "") => (v === null || v === undefined) ? "n/a" : Number(v).toFixed(d) + u;
const COLORS = ["#4fa3f7", "#f7a34f", "#7bd88f", "#e06c75", "#c678dd", "#56b6c2", "#d19a66", "#abb2bf"];

// Draws series [{label, color, points:[[x,y],...]}] on a canvas, scaled to fit.
function plot(canvas, series, yLabel) {
  const w = canvas.clientWidth || 320, h = canvas.clientHeight || 90, r = window.devicePixelRatio || 1;
  canvas.width = w * r; canvas.height = h * r;
  const c = canvas.getContext("2d"); c.scale(r, r); c.clearRect(0, 0, w, h);
  let xs = [], ys = [];
  for (const s of series) for (const [x, y] of s.points) if (y !== null && y !== undefined) { xs.push(x); ys.push(y); }
  if (!xs.length) { c.fillStyle = "#8a96a3"; c.fillText("no data", 8, 16); return; }
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y1 += 1; y0 -= 1; }
  const L = 34, B = 4, T = 12;
  const px = (x) => L + (x - x0) / (x1 - x0) * (w - L - 4), py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (h - T - B);
  c.fillStyle = "#8a96a3"; c.font = "10px sans-serif";
  c.fillText(y1.toPrecision(3), 2, T + 4); c.fillText(y0.toPrecision(3), 2, h - B); c.fillText(yLabel, L, 10);
  for (const s of series) {
    c.strokeStyle = s.color; c.lineWidth = 1.5; c.beginPath(); let pen = false;
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) { pen = false; continue; }
      if (pen) c.lineTo(px(x), py(y)); else { c.moveTo(px(x), py(y)); pen = true; }
    }
    c.stroke();
  }
}

function cardClass(g) {
  const s = g.sample || {};
  if (s.temp_c != null && g.temp_slowdown_c != null && s.temp_c >= g.temp_slowdown_c - 5) return "gpu-card hot";
  return (s.throttle && s.throttle.length) ? "gpu-card warn" : "gpu-card";
}

function renderGpus(state) {
  $("host").textContent = (state.hostname || "") + (state.driver ? "  driver " + state.driver : "");
  const box = $("gpus");
  for (const g of state.gpus) {
    let card = document.getElementById("gpu-" + g.index);
    if (!card) {
      card = document.createElement("div");
      card.id = "gpu-" + g.index;
      card.dataset.uuid = g.uuid;
      card.innerHTML = '<h2></h2><div class="kv"></div><canvas class="temp"></canvas><canvas class="power"></canvas>';
      box.appendChild(card);
    }
    card.className = cardClass(g);
    const s = g.sample || {};
    card.querySelector("h2").textContent = "GPU " + g.index + " \u00b7 " + g.name;
    const mem = (s.fb_used != null && s.fb_total != null) ? fmt(s.fb_used / 1048576, 0) + " / " + fmt(s.fb_total / 1048576, 0) + " MiB" : "n/a";
    const link = (s.pcie_gen != null) ? "gen" + s.pcie_gen + " x" + s.pcie_width : "n/a";
    const kv = [["temp", fmt(s.temp_c, 0, " C") + " / " + fmt(g.temp_slowdown_c, 0, " C")], ["power", fmt(s.power_w, 0, " W") + " / " + fmt(s.power_limit_w, 0, " W")],
      ["util", fmt(s.util_gpu_pct, 0, "%")], ["SM", fmt(s.sm_clock_mhz, 0, " MHz")], ["memory", mem], ["fan", fmt(s.fan_pct, 0, "%")],
      ["PCIe", link], ["throttle", (s.throttle && s.throttle.length) ? s.throttle.join(", ") : "-"], ["XID", g.last_xid ? String(g.last_xid) : "-"]];
    card.querySelector(".kv").innerHTML = kv.map(([k, v]) => '<span class="m-' + k + '">' + k + " <b>" + v + "</b></span>").join("");
    const h = g.history || [], t0 = h.length ? h[0].t : 0;
    plot(card.querySelector("canvas.temp"), [{ color: "#e06c75", points: h.map((p) => [p.t - t0, p.temp]) }], "temperature C");
    plot(card.querySelector("canvas.power"), [{ color: "#4fa3f7", points: h.map((p) => [p.t - t0, p.power]) }], "power W");
  }
  const list = $("alert-list");
  list.innerHTML = "";
  for (const a of (state.alerts || []).slice(-20).reverse()) {
    const li = document.createElement("li");
    li.textContent = new Date(a.time * 1000).toLocaleTimeString() + "  gpu" + a.gpu + " " + a.kind + ": " + a.message;
    list.appendChild(li);
  }
  $("status").textContent = "updated " + new Date().toLocaleTimeString();
}

function renderRun(run) {
  if (!run || !run.points || !run.points.length) { if (run && run.error) $("run-summary").textContent = run.error; return; }
  const last = run.points[run.points.length - 1];
  $("run-summary").textContent = run.path + ": step " + last.step + (last.loss !== undefined ? ", loss " + Number(last.loss).toFixed(4) : "") +
    (last.tokens_per_s !== undefined ? ", " + Math.round(last.tokens_per_s) + " tokens/s" : "");
  const box = $("run-charts");
  run.keys.forEach((k, i) => {
    let cv = document.getElementById("run-" + k);
    if (!cv) {
      const d = document.createElement("div");
      d.innerHTML = '<div class="legend">' + k + '</div><canvas id="run-' + k + '"></canvas>';
      box.appendChild(d); cv = document.getElementById("run-" + k);
    }
    plot(cv, [{ color: COLORS[i % COLORS.length], points: run.points.map((p) => [p.step, p[k] === undefined ? null : p[k]]) }], k);
  });
}

async function poll() {
  try {
    const st = await (await fetch("/api/state")).json();
    renderGpus(st);
    if (st.run) renderRun(await (await fetch("/api/run")).json());
  } catch (e) { $("status").textContent = "disconnected (" + e + ")"; }
}

renderGpus(window.RIG_INITIAL);
if (window.RIG_INITIAL.run) fetch("/api/run").then((r) => r.json()).then(renderRun).catch(() => {});
setInterval(poll, 1000);
</script>
</body></html>
)HTML";

}  // namespace

std::string dashboard_html(const nlohmann::json& initial_state) {
  std::string page = kPage;
  // "</" inside a script element would end it early; JSON allows "<\/" for the same text.
  std::string js = initial_state.dump();
  std::string safe;
  for (size_t i = 0; i < js.size(); ++i) {
    if (js[i] == '<' && i + 1 < js.size() && js[i + 1] == '/')
      safe += "<\\";
    else
      safe += js[i];
  }
  auto at = page.find("__RIG_INITIAL__");
  page.replace(at, std::string("__RIG_INITIAL__").size(), safe);
  return page;
}

}  // namespace rig::hw
