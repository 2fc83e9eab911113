// Helpers of the guard_*test.cpp files: run metrics, tensors compared bitwise, the table rows.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/train/metrics.h"
#include "test_util.h"

namespace rig::test::guard {

inline const std::string kSrc = RIG_SOURCE_DIR;

inline std::vector<nlohmann::json> rows(const std::string& run) {
  return read_metrics(run + "/metrics.jsonl").rows;
}

inline std::vector<nlohmann::json> events(const std::string& run, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (const auto& r : rows(run))
    if (r.value("event", "") == name) out.push_back(r);
  return out;
}

// The optimizer steps metrics.jsonl holds a line for, in order.
inline std::vector<int64_t> logged_steps(const std::string& run) {
  std::vector<int64_t> out;
  for (const auto& r : rows(run))
    if (!r.contains("event") && !r.contains("eval_loss")) out.push_back(r["step"].get<int64_t>());
  return out;
}

// Steps 1..n missing from metrics.jsonl or there more than once: what a crash or a rollback must
// never leave behind.
inline int64_t steps_lost(const std::string& run, int64_t n) {
  const auto got = logged_steps(run);
  const std::multiset<int64_t> seen(got.begin(), got.end());
  int64_t bad = 0;
  for (int64_t s = 1; s <= n; ++s) bad += seen.count(s) != 1;
  return bad + (int64_t(got.size()) > n ? int64_t(got.size()) - n : 0);
}

// Every tensor bitwise equal (weights; for checkpoints also both AdamW moments).
inline void expect_same_tensors(const std::string& a, const std::string& b) {
  auto fa = SafeTensorsFile::open(a), fb = SafeTensorsFile::open(b);
  ASSERT_EQ(fa.tensors().size(), fb.tensors().size()) << a << " vs " << b;
  for (const auto& t : fa.tensors()) {
    ASSERT_TRUE(fb.has(t.name)) << t.name;
    Tensor x = fa.get(t.name), y = fb.get(t.name);
    ASSERT_EQ(x.nbytes(), y.nbytes()) << t.name;
    EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), x.nbytes())) << t.name << ": " << a << " vs " << b;
  }
}

// One row of the table in docs/reliability.md, from what the test observed.
struct Row {
  std::string fault, setup, detected, latency, recovery, redone, skipped, lost, result;
};
inline void check_row(const std::string& key, const Row& r) {
  const std::string line =
      fmt::format("| `{}` | {} | {} | {} | {} | {} | {} | {} | {} |", r.fault, r.setup, r.detected,
                  r.latency, r.recovery, r.redone, r.skipped, r.lost, r.result);
  const std::filesystem::path dir = std::filesystem::path(RIG_BUILD_DIR) / "reliability";
  std::filesystem::create_directories(dir);
  write_file_atomic((dir / (key + ".md")).string(), line + "\n");
  const std::string doc = read_file(kSrc + "/docs/reliability.md");
  EXPECT_NE(doc.find(line + "\n"), std::string::npos)
      << "docs/reliability.md lacks this row (bash scripts/reliability-table.sh prints them all):\n"
      << line;
}

// "0 steps", "1 step", "2 steps".
inline std::string steps_text(int64_t n) {
  return fmt::format("{} step{}", n, n == 1 ? "" : "s");
}

// How a replica, weight or shard verdict came about, in the table's words.
inline std::string detected_by(const nlohmann::json& ev) {
  const std::string by = ev.value("found_by", "");
  const std::string how =
      by == "check at rest"
          ? "check at rest (every guard.replica_check_every steps and before each checkpoint)"
      : by == "NaN/Inf" ? "NaN/Inf gradients, then the weight check"
      : by == "spike"   ? "a spike, then the weight check"
                        : "the rank's own shard hash over a checked step";
  return how + ": " + ev.value("detail", "");
}

}  // namespace rig::test::guard
