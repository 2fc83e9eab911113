// rig doctor / rig watch against the fake NVML (tests/fake_nvml): scripted readings drive the
// verdicts, exit codes, alerts, logs, the Prometheus endpoint and the dashboard.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <sstream>
#include <thread>

#include "rig/core/error.h"
#include "rig/hw/doctor.h"
#include "rig/hw/libraries.h"
#include "rig/hw/telemetry.h"
#include "rig/hw/topology.h"
#include "rig/hw/watch.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
using namespace rig::hw;
namespace fs = std::filesystem;

// Sets environment variables for the test's lifetime (the fake reads them; so does a child rig).
struct Env {
  std::vector<std::string> names;
  void set(const std::string& k, const std::string& v) {
    setenv(k.c_str(), v.c_str(), 1);
    names.push_back(k);
  }
  ~Env() {
    for (auto& n : names) unsetenv(n.c_str());
  }
};

// The fake NVML with `scenario`, and the fake standing in for NCCL, cuDNN and the CUDA runtime,
// so the result does not depend on what this machine has installed.
struct Fake : Env {
  explicit Fake(const std::string& scenario) {
    set("FAKE_NVML_SCENARIO", scenario);
    set("RIG_NVML_LIBRARY", FAKE_NVML_LIBRARY);
    set("RIG_NCCL_LIBRARY", FAKE_NVML_LIBRARY);
    set("RIG_CUDNN_LIBRARY", FAKE_NVML_LIBRARY);
    set("RIG_CUDART_LIBRARY", FAKE_NVML_LIBRARY);
  }
};

// A sysfs tree with the given network interfaces (name -> operstate) and InfiniBand devices.
std::string fake_sysfs(const std::string& name, std::map<std::string, std::string> nets,
                       std::vector<std::string> ib = {}) {
  std::string root = rig::test::temp_dir(name);
  for (auto& [n, state] : nets) {
    fs::create_directories(fs::path(root) / "class/net" / n);
    std::ofstream(fs::path(root) / "class/net" / n / "operstate") << state << "\n";
  }
  for (auto& d : ib) fs::create_directories(fs::path(root) / "class/infiniband" / d);
  return root;
}

const Check* find_check(const std::vector<Check>& cs, const std::string& id, int gpu = -1) {
  for (auto& c : cs)
    if (c.id == id && c.gpu == gpu) return &c;
  return nullptr;
}

std::string doctor_args(const std::string& extra = "") {
  static std::string sys = fake_sysfs("hw-sysfs-default", {{"eth0", "up"}, {"lo", "unknown"}});
  return "doctor --no-p2p --sysfs " + sys + " " + extra;
}

// ---- NVML loading -----------------------------------------------------------------------------

TEST(HwNvml, MissingLibraryIsAClearErrorNotACrash) {
  try {
    Telemetry::open("/nonexistent/libnvidia-ml.so.1");
    FAIL() << "expected rig::Error";
  } catch (const rig::Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("NVML not available"), std::string::npos) << m;
    EXPECT_NE(m.find("/nonexistent/libnvidia-ml.so.1"), std::string::npos) << m;
    EXPECT_NE(m.find("driver"), std::string::npos) << m;
  }
}

TEST(HwNvml, DoctorWithoutNvmlSaysSoAndExitsNonZero) {
  Env env;
  env.set("RIG_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1");
  auto r = rig::test::run_rig(doctor_args());
  EXPECT_EQ(r.code, 1) << r.out;  // not a signal, not an internal error
  EXPECT_NE(r.out.find("NVML not available"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Result: NOT READY"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nvml: NVML not available"), std::string::npos) << r.out;

  auto j = rig::test::run_rig(doctor_args("--json"));
  EXPECT_EQ(j.code, 1);
  json rep = json::parse(j.out);
  EXPECT_FALSE(rep["ready"].get<bool>());
  EXPECT_EQ(rep["failing"][0]["id"], "nvml");
  EXPECT_TRUE(rep["gpus"].empty());
}

TEST(HwNvml, WatchWithoutNvmlFailsWithOneLine) {
  Env env;
  env.set("RIG_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1");
  auto r = rig::test::run_rig("watch -n 1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out.rfind("rig: NVML not available", 0), 0u) << r.out;
}

TEST(HwNvml, DriverNotLoadedIsExplained) {
  Fake f("no_driver");
  auto r = rig::test::run_rig(doctor_args());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("Driver Not Loaded"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("kernel module is not loaded"), std::string::npos) << r.out;
}

TEST(HwTelemetry, ReadsEveryFieldOfTwoGpus) {
  Fake f("two_gpus");
  Telemetry t = Telemetry::open(FAKE_NVML_LIBRARY);
  EXPECT_EQ(t.driver_version(), "550.54.14");
  EXPECT_EQ(cuda_version_string(t.cuda_driver_version()), "12.4");
  ASSERT_EQ(t.gpus().size(), 2u);
  const GpuInfo& g1 = t.gpus()[1];
  EXPECT_EQ(g1.name, "NVIDIA GeForce RTX 4090");
  EXPECT_TRUE(g1.geforce());
  EXPECT_EQ(g1.uuid, "GPU-fa4e0000-0000-4000-8000-000000000001");
  EXPECT_EQ(g1.pci_bus_id, "00000000:41:00.0");
  EXPECT_EQ(g1.pci_device_id, 0x268410deu);
  EXPECT_EQ(*g1.temp_slowdown_c, 88);
  EXPECT_EQ(*g1.power_default_limit_w, 450);
  EXPECT_EQ(*g1.max_pcie_width, 16u);
  EXPECT_FALSE(g1.mem_temp_max_c.has_value());  // null in the scenario: not supported

  auto s = t.sample();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(*s[0].temp_c, 71);
  EXPECT_DOUBLE_EQ(*s[1].power_w, 405.5);
  EXPECT_EQ(*s[0].sm_clock_mhz, 2640);
  EXPECT_EQ(*s[0].util_gpu_pct, 98);
  EXPECT_EQ(*s[0].fb_used, 21474836480ull);
  EXPECT_EQ(*s[0].fb_free, 25757220864ull - 21474836480ull);
  EXPECT_EQ(*s[1].fan_pct, 75);
  EXPECT_EQ(*s[0].clocks_event_reasons, 0u);
  EXPECT_FALSE(s[0].ecc_uncorrected.has_value());  // GeForce: no ECC, not "zero errors"
  EXPECT_FALSE(s[0].mem_temp_c.has_value());

  StepSummary sum = Telemetry::summarize(s);
  EXPECT_EQ(sum.gpus, 2);
  EXPECT_EQ(*sum.max_temp_c, 74);
  EXPECT_EQ(sum.hottest_gpu, 1);
  EXPECT_DOUBLE_EQ(sum.total_power_w, 817.5);
  EXPECT_DOUBLE_EQ(sum.max_power_w, 412);
  EXPECT_FALSE(sum.thermal_throttle);
  EXPECT_EQ(sum.to_json()["max_temp_c"], 74.0);
}

TEST(HwTelemetry, TimelineThrottleAndOldDriverFallback) {
  {
    Fake f("throttling");
    Telemetry t = Telemetry::open(FAKE_NVML_LIBRARY);
    auto s0 = t.sample();
    EXPECT_TRUE(s0[0].power_throttle());
    EXPECT_FALSE(s0[1].thermal_throttle());
    auto s1 = t.sample();
    EXPECT_TRUE(s1[1].thermal_throttle());
    EXPECT_EQ(*s1[1].temp_c, 84);
    auto sum = Telemetry::summarize(s1);
    EXPECT_TRUE(sum.thermal_throttle);
    EXPECT_TRUE(sum.power_throttle);
    EXPECT_EQ(sum.to_json()["throttle"], json({"sw_power_cap", "hw_thermal_slowdown"}));
  }
  {
    // Drivers before 535 only have nvmlDeviceGetCurrentClocksThrottleReasons.
    Fake f("old_driver");
    Telemetry t = Telemetry::open(FAKE_NVML_LIBRARY);
    auto s = t.sample();
    ASSERT_TRUE(s[0].clocks_event_reasons.has_value());
    EXPECT_TRUE(s[0].thermal_throttle());
  }
}

TEST(HwTelemetry, XidEventsArriveOnTheSampleThatRaisedThem) {
  Fake f("ecc");
  Telemetry t = Telemetry::open(FAKE_NVML_LIBRARY);
  auto s0 = t.sample();
  EXPECT_TRUE(s0[0].xids.empty());
  EXPECT_EQ(*s0[0].ecc_uncorrected, 1u);
  EXPECT_TRUE(*s0[0].remap_pending);
  EXPECT_EQ(*s0[0].mem_temp_c, 60);
  auto s1 = t.sample();
  EXPECT_EQ(s1[0].xids, std::vector<uint64_t>{48});
  EXPECT_EQ(*s1[0].ecc_uncorrected, 2u);
  EXPECT_TRUE(t.sample()[0].xids.empty());  // drained
}

TEST(HwTelemetry, ThermalPauseHasHysteresis) {
  ThermalPause p(83, 75);
  auto at = [](double t) {
    StepSummary s;
    s.max_temp_c = t;
    return s;
  };
  EXPECT_FALSE(p.update(at(70)));
  EXPECT_FALSE(p.update(at(82.9)));
  EXPECT_TRUE(p.update(at(83)));
  EXPECT_TRUE(p.update(at(78)));         // cooler, but not cool enough to resume
  EXPECT_TRUE(p.update(StepSummary{}));  // no reading: keep the state
  EXPECT_FALSE(p.update(at(74.5)));
  EXPECT_TRUE(p.update(at(90)));
  EXPECT_EQ(p.pauses(), 2);
  EXPECT_THROW(ThermalPause(80, 85), rig::InputError);
}

// ---- doctor -----------------------------------------------------------------------------------

TEST(HwDoctor, HealthyBoxIsReady) {
  Fake f("healthy");
  auto r = rig::test::run_rig(doctor_args());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("Result: READY"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("4 x NVIDIA GeForce RTX 4090"), std::string::npos);
  EXPECT_NE(r.out.find("NCCL            2.21.5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cuDNN           9.1.0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CUDA runtime    12.4"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not measured (--no-p2p)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("export NCCL_P2P_DISABLE=1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("export NCCL_IB_DISABLE=1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("export NCCL_SOCKET_IFNAME=eth0"), std::string::npos) << r.out;
}

TEST(HwDoctor, HotCardFailsAndIsListed) {
  Fake f("hot");
  auto r = rig::test::run_rig(doctor_args());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("NOT READY, 1 failing check(s)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gpu0 temperature: 85 C (slowdown at 88 C): within 3 C"), std::string::npos)
      << r.out;

  json rep = json::parse(rig::test::run_rig(doctor_args("--json")).out);
  EXPECT_FALSE(rep["ready"].get<bool>());
  ASSERT_EQ(rep["failing"].size(), 1u);
  EXPECT_EQ(rep["failing"][0]["gpu"], 0);
  EXPECT_EQ(rep["failing"][0]["id"], "temperature");
  EXPECT_EQ(rep["gpus"][1]["checks"][0]["verdict"], "ok");  // the 60 C card is fine
  EXPECT_EQ(rep["gpus"][0]["sample"]["fan_pct"], 100.0);
}

TEST(HwDoctor, DegradedLinkWarnsAndFailsOnlyWhenStrict) {
  Fake f("degraded_link");
  auto r = rig::test::run_rig(doctor_args());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[WARN] pcie_link    gen3 x4 (card supports gen4 x16): running x4 of x16"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("gen3 under load"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("NCCL advice: none (one GPU)"), std::string::npos) << r.out;
  auto s = rig::test::run_rig(doctor_args("--strict"));
  EXPECT_EQ(s.code, 1) << s.out;
  EXPECT_NE(s.out.find("gpu0 pcie_link: gen3 x4"), std::string::npos) << s.out;
}

TEST(HwDoctor, ThrottlingAndPowerLimitVerdicts) {
  Fake f("throttling");
  DoctorOptions o;
  o.measure_p2p = false;
  o.sysfs_root = fake_sysfs("hw-sysfs-throttle", {});
  DoctorReport rep = run_doctor(o);
  ASSERT_EQ(rep.gpus.size(), 2u);
  const Check* pl = find_check(rep.checks, "power_limit", 0);
  ASSERT_TRUE(pl);
  EXPECT_EQ(pl->verdict, Verdict::warn);
  EXPECT_NE(pl->detail.find("limit 400 W (default 450 W): 89% of default"), std::string::npos)
      << pl->detail;
  EXPECT_EQ(find_check(rep.checks, "throttle", 0)->verdict,
            Verdict::warn);  // sw power cap under load
  EXPECT_EQ(find_check(rep.checks, "power_limit", 1)->verdict, Verdict::ok);
  EXPECT_TRUE(rep.ready());  // warnings only
  // No interface up: loopback for a single node.
  ASSERT_FALSE(rep.advice.empty());
  EXPECT_EQ(rep.advice.back().line(), "export NCCL_SOCKET_IFNAME=lo");
}

TEST(HwDoctor, GpuChecksFromScriptedSamples) {
  GpuInfo g;
  g.name = "NVIDIA RTX A6000";
  g.temp_slowdown_c = 90;
  g.max_pcie_gen = 4;
  g.max_pcie_width = 16;
  GpuSample s;
  s.temp_c = 50;
  s.pcie_gen = 1;  // idle: the link trains down to save power
  s.pcie_width = 16;
  s.util_gpu_pct = 0;
  s.clocks_event_reasons = 0x1;
  s.ecc_corrected = 0;
  s.ecc_uncorrected = 0;
  auto cs = check_gpu(g, s);
  EXPECT_EQ(find_check(cs, "pcie_link", 0)->verdict, Verdict::ok);
  EXPECT_NE(find_check(cs, "pcie_link", 0)->detail.find("idle"), std::string::npos);
  EXPECT_EQ(find_check(cs, "ecc", 0)->verdict, Verdict::ok);
  EXPECT_EQ(find_check(cs, "throttle", 0)->detail, "none (idle)");
  {
    // No ECC (GeForce): the advice names what rig train's guard does, and where it is described.
    GpuSample plain = s;
    plain.ecc_corrected.reset();
    plain.ecc_uncorrected.reset();
    const auto plain_checks = check_gpu(g, plain);
    const Check* ecc = find_check(plain_checks, "ecc", 0);
    EXPECT_EQ(ecc->verdict, Verdict::skip);
    for (const char* what :
         {"skips NaN/Inf steps", "replica", "verifies checkpoints", "docs/reliability.md"})
      EXPECT_NE(ecc->detail.find(what), std::string::npos) << what << ": " << ecc->detail;
  }
  EXPECT_EQ(find_check(cs, "power_limit", 0)->verdict, Verdict::skip);

  s.util_gpu_pct = 90;            // the same gen1 link under load is a problem
  s.clocks_event_reasons = 0x80;  // power brake: the PSU cannot keep up
  s.ecc_corrected = 5;
  cs = check_gpu(g, s);
  EXPECT_EQ(find_check(cs, "pcie_link", 0)->verdict, Verdict::warn);
  EXPECT_EQ(find_check(cs, "ecc", 0)->verdict, Verdict::warn);
  EXPECT_EQ(find_check(cs, "throttle", 0)->verdict, Verdict::fail);
  EXPECT_NE(find_check(cs, "throttle", 0)->detail.find("PSU"), std::string::npos);

  s.remap_failure = true;
  s.temp_c = 86;
  cs = check_gpu(g, s);
  EXPECT_EQ(find_check(cs, "ecc", 0)->verdict, Verdict::fail);
  EXPECT_NE(find_check(cs, "ecc", 0)->detail.find("needs service"), std::string::npos);
  EXPECT_EQ(find_check(cs, "temperature", 0)->verdict, Verdict::fail);
  s.temp_c = 84.9;  // 5.1 C below slowdown
  EXPECT_EQ(find_check(check_gpu(g, s), "temperature", 0)->verdict, Verdict::ok);
}

TEST(HwDoctor, EccErrorsFailTheDoctor) {
  Fake f("ecc");
  auto r = rig::test::run_rig(doctor_args("--json"));
  EXPECT_EQ(r.code, 1) << r.out;
  json rep = json::parse(r.out);
  ASSERT_EQ(rep["failing"].size(), 1u);
  EXPECT_EQ(rep["failing"][0]["id"], "ecc");
  std::string d = rep["failing"][0]["detail"];
  EXPECT_NE(d.find("3 corrected, 1 uncorrected"), std::string::npos) << d;
  EXPECT_NE(d.find("row remap is pending"), std::string::npos) << d;
  EXPECT_TRUE(rep["advice"].empty());  // one GPU
}

TEST(HwDoctor, NcclAdviceFollowsWhatWasFound) {
  AdviceInputs in;
  GpuInfo g;
  g.name = "NVIDIA GeForce RTX 4090";
  in.gpus = {g, g};
  std::string sys = fake_sysfs(
      "hw-sysfs-net", {{"docker0", "up"}, {"enp5s0", "up"}, {"eno1", "down"}, {"lo", "unknown"}},
      {"mlx5_0"});
  in.net_interfaces = list_net_interfaces(sys);
  in.ib_devices = list_infiniband(sys);
  EXPECT_EQ(in.net_interfaces, std::vector<std::string>{"enp5s0"});  // not docker0, not a down link
  EXPECT_EQ(in.ib_devices, std::vector<std::string>{"mlx5_0"});
  auto adv = nccl_advice(in);
  std::vector<std::string> lines;
  for (auto& a : adv) lines.push_back(a.line());
  EXPECT_EQ(lines, (std::vector<std::string>{"export NCCL_P2P_DISABLE=1",
                                             "export NCCL_SOCKET_IFNAME=enp5s0"}));

  // Measured peer access wins over the GeForce guess.
  in.p2p.measured = true;
  in.p2p.can_access = {{-1, 1}, {1, -1}};
  in.ib_devices.clear();
  lines.clear();
  for (auto& a : nccl_advice(in)) lines.push_back(a.line());
  EXPECT_EQ(lines, (std::vector<std::string>{"export NCCL_IB_DISABLE=1",
                                             "export NCCL_SOCKET_IFNAME=enp5s0"}));

  in.gpus.resize(1);
  EXPECT_TRUE(nccl_advice(in).empty());
}

TEST(HwDoctor, LibraryVersionsAndDecoders) {
  EXPECT_EQ(nccl_version_string(22105), "2.21.5");
  EXPECT_EQ(nccl_version_string(2708), "2.7.8");
  EXPECT_EQ(cudnn_version_string(90100), "9.1.0");
  EXPECT_EQ(cudnn_version_string(8902), "8.9.2");
  Fake f("healthy");
  f.set("RIG_CUDNN_LIBRARY", "/nonexistent/libcudnn.so.9");
  auto libs = probe_libraries();
  ASSERT_EQ(libs.size(), 3u);
  EXPECT_TRUE(libs[0].found);
  EXPECT_EQ(libs[0].version, "2.21.5");
  EXPECT_FALSE(libs[1].found);
  EXPECT_NE(libs[1].error.find("/nonexistent/libcudnn.so.9"), std::string::npos);
  EXPECT_EQ(libs[2].version, "12.4");
}

TEST(HwDoctor, CudaRuntimeNewerThanDriver) {
  std::string dir = rig::test::temp_dir("hw-cudart");
  std::string scn = dir + "/newer_runtime.json";
  std::ofstream(scn) << R"({"cuda_driver": 12020, "cudart_version": 13000, "gpus": [{}]})";
  Fake f(scn);
  json rep = json::parse(rig::test::run_rig(doctor_args("--json")).out);
  ASSERT_EQ(rep["failing"].size(), 1u);
  EXPECT_EQ(rep["failing"][0]["id"], "cuda_runtime");
  EXPECT_NE(rep["failing"][0]["detail"].get<std::string>().find("needs a newer driver"),
            std::string::npos);
}

TEST(HwDoctor, TopologyOfUnknownBusIds) {
  Topology t = probe_topology({"00000000:ff:1f.7", "garbage"});
  ASSERT_TRUE(t.ok) << t.error;
  EXPECT_GE(t.pus, 1);
  ASSERT_EQ(t.gpus.size(), 2u);
  EXPECT_FALSE(t.gpus[0].found);
  EXPECT_EQ(t.paths[0][0], "X");
  EXPECT_EQ(t.paths[0][1], "?");
  EXPECT_FALSE(probe_topology({}, "/nonexistent.xml").ok);
}

TEST(HwDoctor, TopologyPathsFromHwlocXml) {
  // Two sockets: GPUs 02 and 03 behind one PCIe bridge, 11 under another host bridge of socket
  // 0, 81 on socket 1.
  std::string xml = std::string(FAKE_NVML_SCENARIOS) + "/../two_socket_4gpu.xml";
  Topology t = probe_topology(
      {"00000000:02:00.0", "00000000:03:00.0", "00000000:11:00.0", "00000000:81:00.0"}, xml);
  ASSERT_TRUE(t.ok) << t.error;
  EXPECT_EQ(t.packages, 2);
  EXPECT_EQ(t.numa_nodes, 2);
  EXPECT_EQ(t.paths[0], (std::vector<std::string>{"X", "PIX", "NODE", "SYS"}));
  EXPECT_EQ(t.paths[3][2], "SYS");
  EXPECT_EQ(t.gpus[3].numa_node, 1);
  EXPECT_EQ(t.gpus[3].cpus, "2-3");
  EXPECT_NEAR(*t.gpus[0].link_gbps, 31.5, 0.01);
  EXPECT_TRUE(t.spans_numa_nodes());

  std::string scn = rig::test::temp_dir("hw-topo") + "/four.json";
  std::ofstream(scn) << R"({"gpus": [{"bus_id": "00000000:02:00.0"}, {"bus_id": "00000000:03:00.0"},
                                     {"bus_id": "00000000:11:00.0"}, {"bus_id": "00000000:81:00.0"}]})";
  Fake f(scn);
  auto r = rig::test::run_rig(doctor_args("--topology-xml " + xml));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(
                "[WARN] 2 package(s), 2 NUMA node(s), 4 cores: GPUs hang off different NUMA nodes"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("GPU3  NUMA 1  CPUs 2-3  link 31.5 GB/s"), std::string::npos) << r.out;
}

// ---- watch ------------------------------------------------------------------------------------

TEST(HwWatch, AlertsOnThrottlingOnce) {
  Fake f("throttling");
  auto r = rig::test::run_rig("watch -n 4 --interval 0.05");
  EXPECT_EQ(r.code, 0) << r.out;
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
  EXPECT_EQ(r.code, 0) << r.out;
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
  auto t0 = std::chrono::steady_clock::now();
  auto r = rig::test::run_rig("watch --duration 0.4 --interval 0.1");
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_LT(s, 30.0);  // generous: a loaded 2-core CI box starts processes slowly; frames bound it too
  size_t frames = 0;
  for (size_t p = r.out.find("--- "); p != std::string::npos; p = r.out.find("--- ", p + 1))
    ++frames;
  EXPECT_GE(frames, 3u);
  EXPECT_LE(frames, 6u);
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
  if (browser.empty()) GTEST_SKIP() << "no chromium installed (apt-get install chromium)";
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
      GTEST_SKIP() << "chromium produced no DOM (exit " << st << "): cannot run headless here";
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
