// rig doctor against the fake NVML (tests/fake_nvml): NVML loading, telemetry, checks, verdicts.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "hw_test_util.h"
#include "rig/core/error.h"
#include "rig/hw/doctor.h"
#include "rig/hw/libraries.h"
#include "rig/hw/telemetry.h"
#include "rig/hw/topology.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;
using namespace rig::hw;
namespace fs = std::filesystem;
using rig::test::Env;
using rig::test::Fake;

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

}  // namespace
