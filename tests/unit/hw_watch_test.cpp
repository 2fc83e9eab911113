// rig watch against the fake NVML: alerts, logs, the Prometheus endpoint and the dashboard.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hw_test_util.h"
#include "rig/hw/telemetry.h"
#include "rig/hw/watch.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
using namespace rig::hw;
namespace fs = std::filesystem;
using rig::test::Fake;

// ---- watch ------------------------------------------------------------------------------------

TEST(HwWatch, AlertsOnThrottlingOnce) {
  Fake f("throttling");
  auto r = rig::test::run_rig("watch -n 4 --interval 0.05");
  EXPECT_EQ(r.code, 2) << "alerts fired: " << r.out;
  auto count = [&](const std::string& s) {
    size_t n = 0;
    for (size_t p = r.out.find(s); p != std::string::npos; p = r.out.find(s, p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(
      count("ALERT gpu0 power_throttle: power throttling (sw_power_cap) at 398 W of 400 W limit"),
      1u)
      << r.out;
  EXPECT_EQ(count("ALERT gpu1 thermal_throttle: thermal throttling (hw_thermal_slowdown) at 84 C"),
            1u)
      << r.out;
  EXPECT_EQ(count("ALERT gpu1 near_slowdown: 84 C is within 4 C of the 88 C slowdown threshold"),
            1u)
      << r.out;
  EXPECT_EQ(count("ALERT gpu1 power_throttle"), 1u) << r.out;
  EXPECT_EQ(count("--- "), 4u) << r.out;  // four frames
  // Thermal before power on gpu1, as the timeline has it.
  EXPECT_LT(r.out.find("gpu1 thermal_throttle"), r.out.find("gpu1 power_throttle"));
}

TEST(HwWatch, EccAndXidAlerts) {
  Fake f("ecc");
  auto r = rig::test::run_rig("watch -n 2 --interval 0.05");
  EXPECT_EQ(r.code, 2) << "alerts fired: " << r.out;
  EXPECT_NE(r.out.find("ALERT gpu0 remap_pending"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ALERT gpu0 ecc: 1 new uncorrected ECC error(s) (total 2)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("ALERT gpu0 xid: XID 48: double-bit ECC error"), std::string::npos) << r.out;
  // Errors present before watch started are not "new".
  EXPECT_EQ(r.out.find("new corrected"), std::string::npos) << r.out;
}

TEST(HwWatch, NearSlowdownHysteresis) {
  GpuInfo g;
  g.temp_slowdown_c = 88;
  AlertTracker tr;
  int n = 0;
  for (double t : {80.0, 83.0, 84.0, 82.0, 83.0, 80.9, 83.5}) {
    GpuSample s;
    s.temp_c = t;
    for (auto& a : tr.update({g}, {s})) n += a.kind == "near_slowdown";
  }
  EXPECT_EQ(n, 2);  // at 83, and again at 83.5 after cooling below 81
}

TEST(HwWatch, CsvAndJsonlLogs) {
  Fake f("two_gpus");
  std::string dir = rig::test::temp_dir("hw-log");
  auto r = rig::test::run_rig("watch -n 3 --interval 0.05 --log " + dir + "/gpu.csv");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream csv(dir + "/gpu.csv");
  std::string header, line;
  std::getline(csv, header);
  EXPECT_EQ(header.rfind("time,gpu,uuid,temp_c,mem_temp_c,power_w,", 0), 0u) << header;
  std::vector<std::string> rows;
  while (std::getline(csv, line)) rows.push_back(line);
  ASSERT_EQ(rows.size(), 6u);  // 3 samples x 2 GPUs
  EXPECT_NE(rows[1].find(",1,GPU-fa4e0000-0000-4000-8000-000000000001,74,,405.5,450,2610,"),
            std::string::npos)
      << rows[1];

  ASSERT_EQ(rig::test::run_rig("watch -n 2 --interval 0.05 --log " + dir + "/gpu.jsonl").code, 0);
  std::ifstream jl(dir + "/gpu.jsonl");
  int n = 0;
  while (std::getline(jl, line)) {
    json j = json::parse(line);
    EXPECT_EQ(j["gpu"], n % 2);
    EXPECT_EQ(j["uuid"], fmt::format("GPU-fa4e0000-0000-4000-8000-00000000000{}", n % 2));
    EXPECT_TRUE(j["ecc_uncorrected"].is_null());
    ++n;
  }
  EXPECT_EQ(n, 4);

  auto bad = rig::test::run_rig("watch -n 1 --log " + dir + "/gpu.txt");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.out.find("use a .csv or .jsonl"), std::string::npos) << bad.out;
}

TEST(HwWatch, DurationBoundsTheRun) {
  Fake f("healthy");
  // Nothing else ends this run (no --iterations): that it ends at all is --duration's doing (a
  // watch still running after 5 minutes is killed and fails). Frames are due every 0.1 s from the
  // start and none after 1 s, so at most 11 (10 plus rounding) whatever the machine's load; two
  // or more show that it sampled on until the limit rather than stopping after the first.
  const std::string dir = rig::test::temp_dir("hw-duration");
  const pid_t pid = rig::test::spawn_rig("watch --duration 1 --interval 0.1", dir + "/out");
  ASSERT_GT(pid, 0);
  const int code = rig::test::wait_exit_within(pid, 300);
  const std::string out = rig::test::file_text(dir + "/out");
  EXPECT_EQ(code, 0) << out;
  size_t frames = 0;
  for (size_t p = out.find("--- "); p != std::string::npos; p = out.find("--- ", p + 1)) ++frames;
  EXPECT_GE(frames, 2u) << out;
  EXPECT_LE(frames, 11u) << out;
}

TEST(HwWatch, PrometheusTextUsesDcgmNamesAndLabels) {
  GpuInfo g;
  g.name = "NVIDIA \"Quoted\" GPU";
  g.uuid = "GPU-1234";
  g.pci_bus_id = "00000000:01:00.0";
  GpuSample s;
  s.temp_c = 65;
  s.power_w = 301.25;
  s.fb_used = 2048ull << 20;
  std::string t = prometheus_text({g}, {s}, {79}, {"box1", "550.54.14"});
  EXPECT_NE(t.find("# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n"), std::string::npos) << t;
  EXPECT_NE(
      t.find("DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-1234\",pci_bus_id=\"00000000:01:00.0\","
             "device=\"nvidia0\",modelName=\"NVIDIA \\\"Quoted\\\" GPU\",Hostname=\"box1\","
             "DCGM_FI_DRIVER_VERSION=\"550.54.14\"} 65\n"),
      std::string::npos)
      << t;
  EXPECT_NE(t.find("} 301.25\n"), std::string::npos);
  EXPECT_NE(t.find("DCGM_FI_DEV_FB_USED{"), std::string::npos);
  EXPECT_NE(t.find("} 2048\n"), std::string::npos);
  EXPECT_NE(t.find("DCGM_FI_DEV_XID_ERRORS{"), std::string::npos);
  EXPECT_NE(t.find("} 79\n"), std::string::npos);
  EXPECT_EQ(t.find("DCGM_FI_DEV_MEMORY_TEMP"), std::string::npos);  // not reported: left out
}

// Runs `rig watch` in this process with the fake, calls `body` with the ports once it listens.
void with_watch(const std::string& scenario, WatchOptions o,
                const std::function<void(int, int)>& body) {
  Fake f(scenario);
  o.nvml_library = FAKE_NVML_LIBRARY;
  o.interval_s = 0.05;
  o.duration_s = 30;  // a bound in case the test body hangs
  std::atomic<bool> stop{false};
  std::promise<std::pair<int, int>> ports;
  std::ostringstream out;
  std::string err;
  std::thread th([&] {
    try {
      run_watch(o, out, &stop, [&](int p, int h) { ports.set_value({p, h}); });
    } catch (const std::exception& e) {
      err = e.what();
      ports.set_value({-1, -1});
    }
  });
  auto [p, h] = ports.get_future().get();
  body(p, h);
  stop = true;
  th.join();
  EXPECT_EQ(err, "");
}

TEST(HwWatch, PrometheusScrapedOverHttp) {
  WatchOptions o;
  o.prometheus_port = 0;
  with_watch("two_gpus", o, [](int port, int http) {
    ASSERT_GT(port, 0);
    EXPECT_EQ(http, -1);
    httplib::Client cli("127.0.0.1", port);
    cli.set_connection_timeout(5);
    auto res = cli.Get("/metrics");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    EXPECT_NE(res->get_header_value("Content-Type").find("text/plain"), std::string::npos);
    const std::string& b = res->body;
    EXPECT_NE(b.find("# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n"), std::string::npos)
        << b;
    EXPECT_NE(
        b.find("DCGM_FI_DEV_GPU_TEMP{gpu=\"1\",UUID=\"GPU-fa4e0000-0000-4000-8000-000000000001\","
               "pci_bus_id=\"00000000:41:00.0\",device=\"nvidia1\",modelName=\"NVIDIA GeForce RTX "
               "4090\""),
        std::string::npos)
        << b;
    for (const char* m : {"DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
                          "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED",
                          "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_PCIE_LINK_GEN",
                          "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"})
      EXPECT_NE(b.find(std::string("# TYPE ") + m + " "), std::string::npos) << m;
    EXPECT_NE(b.find("Hostname=\""), std::string::npos);
    // Every sample line is NAME{labels} VALUE.
    std::istringstream in(b);
    std::string line;
    int samples = 0;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      ++samples;
      EXPECT_EQ(line.rfind("DCGM_FI_", 0), 0u) << line;
      EXPECT_NE(line.find("} "), std::string::npos) << line;
    }
    EXPECT_GT(samples, 20);
    EXPECT_EQ(cli.Get("/nothing")->status, 404);
  });
}

std::string write_run(const std::string& name) {
  std::string dir = rig::test::temp_dir(name);
  std::ofstream m(dir + "/metrics.jsonl");
  for (int s = 1; s <= 3; ++s)
    m << json{{"step", s},
              {"loss", 3.0 / s},
              {"lr", 1e-4},
              {"tokens_per_s", 5000 + s},
              {"note", "x"}}
             .dump()
      << "\n";
  // A guard event with numbers of its own: not a point of the curves.
  m << json{{"event", "rollback"}, {"step", 3}, {"value", 9.5}, {"to_step", 1}}.dump() << "\n";
  m << "{\"step\": 4, \"loss\":";  // a line being written
  return dir;
}

TEST(HwWatch, RunMetricsAreReadAndThinned) {
  std::string dir = write_run("hw-run-read");
  json j = read_run_metrics(dir);
  EXPECT_EQ(j["keys"], json({"loss", "lr", "tokens_per_s"}));
  ASSERT_EQ(j["points"].size(), 3u);
  EXPECT_EQ(j["points"][2]["step"], 3);
  EXPECT_FALSE(j["points"][0].contains("note"));
  std::ofstream m(dir + "/metrics.jsonl");
  for (int s = 0; s < 1001; ++s) m << json{{"step", s}, {"loss", 1.0}}.dump() << "\n";
  m.close();
  json t = read_run_metrics(dir, 100);
  EXPECT_LE(t["points"].size(), 102u);
  EXPECT_EQ(t["points"].back()["step"], 1000);  // the latest point is always kept
  EXPECT_TRUE(read_run_metrics(dir + "/missing").contains("error"));
}

TEST(HwWatch, DashboardServesPageStateAndRun) {
  WatchOptions o;
  o.http_port = 0;
  o.run_dir = write_run("hw-run-http");
  with_watch("two_gpus", o, [&](int, int port) {
    ASSERT_GT(port, 0);
    httplib::Client cli("127.0.0.1", port);
    auto page = cli.Get("/");
    ASSERT_TRUE(page);
    EXPECT_EQ(page->status, 200);
    EXPECT_NE(page->body.find("<title>rig watch</title>"), std::string::npos);
    EXPECT_NE(page->body.find("window.RIG_INITIAL = {"), std::string::npos);
    EXPECT_EQ(page->body.find("__RIG_INITIAL__"), std::string::npos);
    EXPECT_EQ(page->body.find("http://"), std::string::npos);  // nothing fetched from elsewhere
    EXPECT_EQ(page->body.find("https://"), std::string::npos);
    json st = json::parse(cli.Get("/api/state")->body);
    ASSERT_EQ(st["gpus"].size(), 2u);
    EXPECT_EQ(st["gpus"][0]["sample"]["temp_c"], 71.0);
    EXPECT_GE(st["gpus"][0]["history"].size(), 1u);
    json run = json::parse(cli.Get("/api/run")->body);
    EXPECT_EQ(run["points"].size(), 3u);
    EXPECT_NE(cli.Get("/metrics")->body.find("DCGM_FI_DEV_GPU_TEMP"), std::string::npos);
  });
}

TEST(HwWatch, DashboardRendersInHeadlessChromium) {
  const char* candidates[] = {"/usr/bin/chromium", "/usr/bin/chromium-browser",
                              "/usr/bin/google-chrome"};
  std::string browser;
  for (auto c : candidates)
    if (fs::exists(c)) browser = c;
  if (browser.empty()) RIG_MISSING_TOOL("no chromium installed (apt-get install chromium)");
  WatchOptions o;
  o.http_port = 0;
  o.run_dir = write_run("hw-run-chromium");
  with_watch("two_gpus", o, [&](int, int port) {
    std::string profile = rig::test::temp_dir("hw-chromium-profile");
    std::string cmd = fmt::format(
        "timeout 60 {} --headless --no-sandbox --disable-gpu --disable-background-networking "
        "--disable-dev-shm-usage --user-data-dir={} --virtual-time-budget=3000 --dump-dom "
        "http://127.0.0.1:{}/ 2>/dev/null",
        browser, profile, port);
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_TRUE(p);
    std::string dom;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) dom.append(buf, n);
    int st = pclose(p);
    if (dom.empty())
      RIG_MISSING_TOOL("chromium produced no DOM (exit " << st << "): cannot run headless here");
    // The cards exist only if the script ran: the served HTML has an empty #gpus section.
    EXPECT_NE(dom.find("id=\"gpu-0\""), std::string::npos) << dom.substr(0, 2000);
    EXPECT_NE(dom.find("id=\"gpu-1\""), std::string::npos);
    EXPECT_NE(dom.find("data-uuid=\"GPU-fa4e0000-0000-4000-8000-000000000001\""),
              std::string::npos);
    EXPECT_NE(dom.find("GPU 0 · NVIDIA GeForce RTX 4090"), std::string::npos);
    EXPECT_NE(dom.find("71 C / 88 C"), std::string::npos);
    EXPECT_NE(dom.find("step 3, loss 1.0000, 5003 tokens/s"), std::string::npos);
    EXPECT_NE(dom.find("id=\"run-loss\""), std::string::npos);
  });
}

}  // namespace
