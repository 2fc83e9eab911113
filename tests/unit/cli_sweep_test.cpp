// Every numeric flag of every subcommand, swept with 0, -1, nan, inf and 1e30. The flags come from
// the program itself (`rig --list-numeric-flags`), so a new one is swept without touching this
// file. Each value is either refused in one line naming the flag (non-zero exit), or runs cleanly:
// never a signal, a hang, "nan" or "inf" in the output, or an internal check's text.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hw_test_util.h"
#include "rig/core/error.h"
#include "rig/train/train_config.h"
#include "rig/train/train_config_schema.h"
#include "test_util.h"

namespace {

struct Flag {
  std::string command, name, type;
  bool checked = false;
};

std::vector<Flag> numeric_flags() {
  auto r = rig::test::run_rig("--list-numeric-flags");
  EXPECT_EQ(r.code, 0) << r.out;
  std::vector<Flag> flags;
  std::istringstream in(r.out);
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::istringstream fields(line);
    for (std::string x; std::getline(fields, x, '\t');) f.push_back(x);
    EXPECT_EQ(f.size(), 4u) << line;
    if (f.size() == 4) flags.push_back({f[0], f[1], f[2], f[3] == "checked"});
  }
  return flags;
}

// Arguments that end each command quickly once its flags are read: a model, config or folder
// that does not exist, a tiny shape, one sample. ("" as a flag: a positional argument.)
using Args = std::vector<std::pair<std::string, std::string>>;
std::map<std::string, Args> base_args(const std::string& tmp) {
  return {
      {"bench attention",
       {{"--batch", "1"},
        {"--seq", "64"},
        {"--heads", "2"},
        {"--kv-heads", "1"},
        {"--head-dim", "64"},
        {"--iters", "1"},
        {"--warmup", "0"},
        {"--impl", "reference"}}},
      {"bench comm",
       {{"--backend", "gloo"},
        {"--max-bytes", "4K"},
        {"--iters", "1"},
        {"--warmup", "0"},
        {"--timeout", "20"}}},
      {"bench train",
       {{"--hidden", "32"},
        {"--layers", "1"},
        {"--heads", "2"},
        {"--kv-heads", "1"},
        {"--intermediate", "64"},
        {"--vocab", "64"},
        {"--batch", "1"},
        {"--seq", "8"},
        {"--steps", "1"}}},
      {"ckpt verify", {{"", "/nonexistent/step-1"}}},
      {"data prepare", {{"--data", "/nonexistent/data.jsonl"}, {"--out", tmp + "/cache"}}},
      {"data inspect", {{"", "/nonexistent/cache"}}},
      {"debug allreduce-check", {{"--numel", "16"}, {"--iters", "1"}, {"--timeout-ms", "20000"}}},
      {"debug random-model", {{"--architecture", "no-such-model"}, {"--out", tmp + "/random"}}},
      {"eval", {{"--model", "/nonexistent/model"}, {"--data", "/nonexistent/data.jsonl"}}},
      {"generate", {{"--model", "/nonexistent/model"}, {"--prompt", "hi"}}},
      {"plan", {}},
      {"quantize", {{"--model", "/nonexistent/model"}, {"--out", tmp + "/q"}}},
      {"tokenize", {{"--tokenizer", "/nonexistent/tokenizer.json"}}},
      {"train", {{"", "/nonexistent/config.yaml"}}},
      // The fake NVML: -n 1 and --duration bound every run, whichever of them is swept.
      {"watch",
       {{"--nvml", FAKE_NVML_LIBRARY},
        {"--iterations", "1"},
        {"--duration", "0.5"},
        {"--interval", "0.01"}}},
  };
}

struct Case {
  Flag flag;
  std::string value, cmd;
  rig::test::RunResult r;
};

// Runs `rig ARGS` with stdin from /dev/null, killed after 60 s (a hang: exit 124 or 137).
rig::test::RunResult run_bounded(const std::string& args) {
  const std::string cmd =
      "timeout -k 5 60 " + std::string(RIG_BINARY) + " " + args + " </dev/null 2>&1";
  rig::test::RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

bool is_integer_type(const std::string& t) {
  return t == "INT" || t == "UINT";
}

TEST(CliSweep, EveryNumericFlagIsChecked) {
  const auto flags = numeric_flags();
  ASSERT_GT(flags.size(), 50u);
  std::set<std::string> commands;
  for (const auto& f : flags) {
    EXPECT_TRUE(f.checked) << "rig " << f.command << " " << f.name
                           << " takes a number without the check of apps/rig/flags.h "
                              "(add it with add_number or add_size)";
    commands.insert(f.command);
  }
  const auto base = base_args("/tmp");
  for (const auto& c : commands)
    EXPECT_TRUE(base.count(c)) << "rig " << c
                               << " has numeric flags: give it arguments in base_args() that end "
                                  "it quickly, so its flags are swept";
  // The ones the issue named, at least.
  for (const auto& [c, n] :
       std::vector<std::pair<std::string, std::string>>{{"plan", "--efficiency"},
                                                        {"plan", "--overlap"},
                                                        {"plan", "--tokens"},
                                                        {"plan", "--checkpoint-gbs"},
                                                        {"watch", "--interval"},
                                                        {"bench comm", "--max-bytes"},
                                                        {"quantize", "--max-shard-size"},
                                                        {"train", "--nproc-per-node"},
                                                        {"generate", "--temperature"}}) {
    bool found = false;
    for (const auto& f : flags) found |= f.command == c && f.name == n;
    EXPECT_TRUE(found) << c << " " << n;
  }
}

TEST(CliSweep, ZeroMinusOneNanInfAndHugeAreRefusedInOneLineOrRunCleanly) {
  const std::string tmp = rig::test::temp_dir("cli-sweep");
  rig::test::Env env;
  env.set("FAKE_NVML_SCENARIO", "healthy");
  // rig sets this and starts itself again when it is missing: half the time of a case.
  if (!std::getenv("OMP_WAIT_POLICY")) env.set("OMP_WAIT_POLICY", "PASSIVE");
  const auto base = base_args(tmp);
  std::vector<Case> cases;
  for (const auto& f : numeric_flags()) {
    auto b = base.find(f.command);
    if (b == base.end()) continue;  // EveryNumericFlagIsChecked names it
    for (const std::string v : {"0", "-1", "nan", "inf", "1e30"}) {
      std::string cmd = f.command;
      for (const auto& [k, val] : b->second)
        if (k != f.name) cmd += (k.empty() ? " " : " " + k + " ") + "'" + val + "'";
      cmd += f.name.rfind('-', 0) == 0 ? " " + f.name + " " + v : " " + v;
      cases.push_back({f, v, cmd, {}});
    }
  }
  ASSERT_GT(cases.size(), 250u);
  // Two at a time: most cases are a process start and a parse.
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next++) < cases.size();) cases[i].r = run_bounded(cases[i].cmd);
  };
  std::thread t1(worker), t2(worker);
  t1.join();
  t2.join();

  const std::regex nonfinite(R"((^|[^A-Za-z])-?(nan|inf|infinity)([^A-Za-z]|$))",
                             std::regex::icase);
  const std::regex internal(
      R"(\.(cpp|h|cu):[0-9]|failed at |internal error|terminate called|Assertion)");
  size_t refused = 0, ran = 0;
  for (const auto& c : cases) {
    const auto& out = c.r.out;
    const std::string what = "rig " + c.cmd + "\n" + out;
    EXPECT_NE(c.r.code, 124) << "hang: " << what;
    EXPECT_LT(c.r.code, 124) << "signal or timeout: " << what;
    EXPECT_FALSE(std::regex_search(out, internal)) << "an internal check: " << what;
    const std::string refusal = "rig " + c.flag.command + ": " + c.flag.name + " must be ";
    if (out.rfind(refusal, 0) == 0) {
      ++refused;
      EXPECT_NE(c.r.code, 0) << what;
      EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "one line: " << what;
      EXPECT_NE(out.find(", got " + c.value + "\n"), std::string::npos) << what;
      continue;
    }
    ++ran;
    // Not refused: a value the flag takes. Never nan or inf, nor 1e30 for an integer.
    EXPECT_TRUE(c.value != "nan" && c.value != "inf") << "accepted: " << what;
    EXPECT_FALSE(c.value == "1e30" && is_integer_type(c.flag.type)) << "accepted: " << what;
    EXPECT_FALSE(std::regex_search(out, nonfinite)) << "nan or inf in the output: " << what;
    EXPECT_EQ(out.find(c.flag.name + " must be"), std::string::npos)
        << "a refusal of the flag, but not the one line of the command-line check: " << what;
    if (c.r.code != 0) {
      // Stopped later, on the missing model or config: one line saying so.
      EXPECT_EQ(out.rfind("rig", 0), 0u) << what;
    }
  }
  EXPECT_GT(refused, ran) << "most of these values are wrong for most flags";
}

TEST(CliSweep, MessagesNameTheFlagAndTheRange) {
  struct Want {
    std::string args, line;
  };
  for (const auto& w : std::vector<Want>{
           {"plan --efficiency nan",
            "rig plan: --efficiency must be a finite number in (0, 1], got nan"},
           {"plan --overlap 1.5", "rig plan: --overlap must be a finite number in [0, 1], got 1.5"},
           {"plan --tokens 0", "rig plan: --tokens must be a finite number > 0, got 0"},
           {"plan --checkpoint-gbs 0",
            "rig plan: --checkpoint-gbs must be a finite number > 0, got 0"},
           {"plan --seq 2.5", "rig plan: --seq must be a whole number from 1 to 16777216, got 2.5"},
           {"plan --max-memory -1GiB",
            "rig plan: --max-memory must be a size from 1 B to 1 PiB (e.g. 4096, 512MiB, 22GiB, "
            "1.5GB), got -1GiB"},
           {"watch --interval inf",
            "rig watch: --interval must be a finite number in (0, 86400], got inf"},
           {"watch --interval nan",
            "rig watch: --interval must be a finite number in (0, 86400], got nan"},
           {"bench comm --max-bytes nan",
            "rig bench comm: --max-bytes must be a size from 4 B to 16 GiB (e.g. 4096, 64K, 256M, "
            "1G), got nan"},
           {"quantize --model m --out o --max-shard-size inf",
            "rig quantize: --max-shard-size must be a finite number in (0, 1000000], got inf"},
           {"train x.yaml --nproc-per-node -1",
            "rig train: --nproc-per-node must be a whole number from 1 to 1024, got -1"},
           {"train x.yaml --nproc-per-node 0",
            "rig train: --nproc-per-node must be a whole number from 1 to 1024, got 0"},
           {"bench train --packed 1",
            "rig bench train: --packed must be 0 (whole rows) or a whole number from 2 to "
            "16777216, got 1"},
           {"generate --model m --prompt p --seed -1",
            "rig generate: --seed must be a whole number >= 0, got -1"},
           {"bench train --steps 1e30",
            "rig bench train: --steps must be a whole number from 1 to 1000000, got 1e30"},
           {"data inspect d -n 1e30",
            "rig data inspect: -n must be a whole number >= 0 and at most 2147483647, got 1e30"},
       }) {
    auto r = rig::test::run_rig(w.args);
    EXPECT_NE(r.code, 0) << w.args;
    EXPECT_EQ(r.out, w.line + "\n") << w.args;
  }
  // Other command-line errors are one line too, with where to look.
  auto r = rig::test::run_rig("plan --no-such-flag");
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.out,
            "rig plan: The following argument was not expected: --no-such-flag (see rig plan "
            "--help)\n");
}

TEST(CliSweep, AcceptedForms) {
  // Whole numbers written as 1e3 or 2.0, decimal never octal, sizes with units.
  auto r = rig::test::run_rig("plan --seq 4e3 --micro-batch 010 --max-memory 22GiB --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["setup"]["seq_len"], 4000) << j["setup"].dump();
  EXPECT_EQ(j["setup"]["micro_batch"], 10) << j["setup"].dump();
  // The launcher flags: a node rank past the nodes is refused before anything starts.
  r = rig::test::run_rig("debug allreduce-check --nnodes 2 --node-rank 2 --master 127.0.0.1:1");
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.out, "rig: --node-rank 2 must be below --nnodes 2 (nodes count from 0)\n") << r.out;
}

// The config's numbers take another path (train_config_read.cpp, TrainConfig::validate): every
// numeric key of the schema, set to nan, inf, -1, 0 and 1e30 over a config that uses them all.
TEST(CliSweep, ConfigNumbersRefuseNanInfAndNegatives) {
  const std::string yaml = R"(
model: m
method: lora
datasets: [{path: d.jsonl, format: alpaca}]
max_steps: 10
eval: {every: 5, split: 0.1}
thermal: {pause_above_c: 85, resume_below_c: 75}
output_dir: out
)";
  ASSERT_NO_THROW(rig::parse_train_config(yaml, "cfg.yaml"));
  size_t keys = 0;
  for (const auto& k : rig::config_schema()) {
    const bool number =
        k.type.rfind("integer", 0) == 0 || k.type.rfind("number", 0) == 0 || k.type == "size";
    if (!number) continue;
    ++keys;
    for (const std::string v : {"nan", "inf", "-inf", "-1", "0", "1e30"}) {
      std::string error;
      try {
        rig::parse_train_config(yaml, "cfg.yaml", {k.name + "=" + v});
      } catch (const rig::InputError& e) {
        error = e.what();
      }
      const std::string what = k.name + "=" + v + " (" + k.type + "): " + error;
      if (!error.empty()) {
        EXPECT_NE(error.find(k.name), std::string::npos) << "names the key: " << what;
        EXPECT_EQ(error.find(".cpp"), std::string::npos) << what;
        continue;
      }
      EXPECT_TRUE(v != "nan" && v != "inf" && v != "-inf") << "accepted: " << what;
      // Only a plain "integer" key (recompute_layers: -1 is every layer) takes a negative.
      EXPECT_TRUE(v != "-1" || k.type == "integer") << "accepted: " << what;
      // A huge count, duration or size would overflow the integer it becomes.
      EXPECT_TRUE(v != "1e30" || k.type.rfind("number", 0) == 0) << "accepted: " << what;
      for (const char* big : {"num_epochs", "dist.timeout_s", "dist.bucket_mb"})
        EXPECT_TRUE(v != "1e30" || k.name != big) << "accepted: " << what;
    }
  }
  EXPECT_GT(keys, 30u);
}

}  // namespace
