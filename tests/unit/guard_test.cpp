// The training guard (docs/reliability.md). Every fault `rig train --inject` knows is injected on
// the CPU engine (and on 2 Gloo ranks for the replica checks), and each test asserts that it was
// detected, what was done about it, that nothing was lost, and that the final weights equal an
// independent reference where the method promises it: a clean run, or a clean run that dropped
// the same batches without training on them (TrainHooks::discard_batches, no guard involved).
//
// Each fault test also writes its row of the table in docs/reliability.md under
// BUILD/reliability/ and checks that the committed page holds that row word for word
// (scripts/reliability-table.sh prints the rows to paste after a change).
#include "rig/train/guard.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "rig/core/dtype.h"
#include "rig/dist/communicator.h"
#include "rig/dist/store.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/ops/ops.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;
namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

const std::string kSrc = RIG_SOURCE_DIR;

// The first 400 samples of the demo task: enough for a few steps, quick to tokenize.
std::string small_data() {
  static const std::string path = [] {
    std::string dir = test::temp_dir("guard_data");
    std::ifstream in(kSrc + "/data/demo/reverse.jsonl");
    std::ofstream out(dir + "/reverse400.jsonl");
    std::string line;
    for (int i = 0; i < 400 && std::getline(in, line); ++i) out << line << "\n";
    return dir + "/reverse400.jsonl";
  }();
  return path;
}

// The demo's tiny model (full fine-tuning from random weights), a few quick steps. The spike
// rule gets 3 steps of history, so it is armed early in these short runs.
TrainConfig demo(const std::string& out, int64_t steps, int64_t save_every,
                 std::vector<std::string> more = {}) {
  std::vector<std::string> o = {"output_dir=" + out,
                                "max_steps=" + std::to_string(steps),
                                "save.every=" + std::to_string(save_every),
                                "save.keep_last=0",
                                "eval.every=0",
                                "eval.split=0",
                                "eval.generate=0",
                                "micro_batch_size=4",
                                "sequence_len=64",
                                "schedule.warmup_steps=2",
                                "guard.spike_warmup=3",
                                "tokenizer=" + kSrc + "/data/demo/tokenizer.json",
                                "datasets.0.path=" + small_data()};
  o.insert(o.end(), more.begin(), more.end());
  return load_train_config(kSrc + "/configs/demo.yaml", o);
}

TrainResult run(const TrainConfig& c, std::function<int64_t(int64_t)> discard = {}) {
  TrainHooks h;
  h.quiet = true;
  h.discard_batches = std::move(discard);
  return train(c, h);
}

// Drops `n` global batches just before step `at`: the clean reference of a skip.
std::function<int64_t(int64_t)> drop(int64_t at, int64_t n) {
  return [at, n](int64_t step) { return step == at ? n : 0; };
}

std::vector<json> rows(const std::string& run) {
  return read_metrics(run + "/metrics.jsonl").rows;
}

std::vector<json> events(const std::string& run, const std::string& name) {
  std::vector<json> out;
  for (const auto& r : rows(run))
    if (r.value("event", "") == name) out.push_back(r);
  return out;
}

// The optimizer steps metrics.jsonl holds a line for, in order.
std::vector<int64_t> logged_steps(const std::string& run) {
  std::vector<int64_t> out;
  for (const auto& r : rows(run))
    if (!r.contains("event") && !r.contains("eval_loss")) out.push_back(r["step"].get<int64_t>());
  return out;
}

// Steps 1..n missing from metrics.jsonl or there more than once: what a crash or a rollback must
// never leave behind.
int64_t steps_lost(const std::string& run, int64_t n) {
  const auto got = logged_steps(run);
  const std::multiset<int64_t> seen(got.begin(), got.end());
  int64_t bad = 0;
  for (int64_t s = 1; s <= n; ++s) bad += seen.count(s) != 1;
  return bad + (int64_t(got.size()) > n ? int64_t(got.size()) - n : 0);
}

// Every tensor bitwise equal (weights; for checkpoints also both AdamW moments).
void expect_same_tensors(const std::string& a, const std::string& b) {
  auto fa = SafeTensorsFile::open(a), fb = SafeTensorsFile::open(b);
  ASSERT_EQ(fa.tensors().size(), fb.tensors().size()) << a << " vs " << b;
  for (const auto& t : fa.tensors()) {
    ASSERT_TRUE(fb.has(t.name)) << t.name;
    Tensor x = fa.get(t.name), y = fb.get(t.name);
    ASSERT_EQ(x.nbytes(), y.nbytes()) << t.name;
    EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), x.nbytes())) << t.name << ": " << a << " vs " << b;
  }
}

// The final model and the final checkpoint (weights and optimizer state) of two runs.
void expect_same_runs(const std::string& a, const std::string& b, int64_t steps) {
  expect_same_tensors(a + "/final/model.safetensors", b + "/final/model.safetensors");
  const std::string ck = fmt::format("/checkpoints/step-{}/state.safetensors", steps);
  expect_same_tensors(a + ck, b + ck);
}

// One row of the table in docs/reliability.md, from what the test observed.
struct Row {
  std::string fault, setup, detected, latency, recovery, redone, skipped, lost, result;
};
void check_row(const std::string& key, const Row& r) {
  const std::string line =
      fmt::format("| `{}` | {} | {} | {} | {} | {} | {} | {} | {} |", r.fault, r.setup, r.detected,
                  r.latency, r.recovery, r.redone, r.skipped, r.lost, r.result);
  const fs::path dir = fs::path(RIG_BUILD_DIR) / "reliability";
  fs::create_directories(dir);
  write_file_atomic((dir / (key + ".md")).string(), line + "\n");
  const std::string doc = read_file(kSrc + "/docs/reliability.md");
  EXPECT_NE(doc.find(line + "\n"), std::string::npos)
      << "docs/reliability.md lacks this row (bash scripts/reliability-table.sh prints them all):\n"
      << line;
}

// "0 steps", "1 step", "2 steps".
std::string steps_text(int64_t n) {
  return fmt::format("{} step{}", n, n == 1 ? "" : "s");
}

// How a replica, weight or shard verdict came about, in the table's words.
std::string detected_by(const json& ev) {
  const std::string by = ev.value("found_by", "");
  const std::string how =
      by == "check at rest"
          ? "check at rest (every guard.replica_check_every steps and before each checkpoint)"
      : by == "NaN/Inf" ? "NaN/Inf gradients, then the weight check"
      : by == "spike"   ? "a spike, then the weight check"
                        : "the rank's own shard hash over a checked step";
  return how + ": " + ev.value("detail", "");
}

}  // namespace

// ---- the pieces ------------------------------------------------------------------------------

TEST(GuardOps, HashMatchesAReferenceAndSeesEveryBit) {
  // The definition of ops/guard_hash.h written out plainly: word i of tensor t (little-endian
  // 32 bits, the last one zero-padded) adds mix(((i << 32) | w) ^ mix(t + C)).
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  auto reference = [&](const std::vector<Tensor>& ts) {
    uint64_t h = 0;
    for (size_t t = 0; t < ts.size(); ++t) {
      const uint64_t base = mix(t + 0x5851f42d4c957f2dULL);
      std::vector<uint8_t> bytes(static_cast<const uint8_t*>(ts[t].raw()),
                                 static_cast<const uint8_t*>(ts[t].raw()) + ts[t].nbytes());
      while (bytes.size() % 4) bytes.push_back(0);
      for (size_t i = 0; i < bytes.size() / 4; ++i) {
        const uint64_t w = uint64_t(bytes[4 * i]) | uint64_t(bytes[4 * i + 1]) << 8 |
                           uint64_t(bytes[4 * i + 2]) << 16 | uint64_t(bytes[4 * i + 3]) << 24;
        h += mix(((uint64_t(i) << 32) | w) ^ base);
      }
    }
    return h;
  };
  std::vector<float> v(100003);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(float(i)) * 0.02f;
  Tensor a = Tensor::from_f32(v, {int64_t(v.size())});
  Tensor b = a.to_dtype(DType::BF16);
  Tensor odd = b.slice_rows(1, 4);  // 3 BF16 values at an odd offset: a padded, unaligned word
  const std::vector<Tensor> list = {a, b, odd};
  EXPECT_EQ(ops::hash64(list), reference(list));
  EXPECT_EQ(ops::hash64({odd}), reference({odd}));
  // Every single flipped bit changes it; the order of the list matters.
  const uint64_t h = ops::hash64({a});
  for (int bit : {0, 7, 22, 30, 31}) {
    Tensor c = a.clone();
    reinterpret_cast<uint32_t*>(c.raw())[77777] ^= 1u << bit;
    EXPECT_NE(ops::hash64({c}), h) << "bit " << bit;
  }
  EXPECT_NE(ops::hash64({a, b}), ops::hash64({b, a}));
}

TEST(GuardOps, CountsNanInfAndImplausibleValues) {
  Tensor a = Tensor::from_f32({1.0f, -2.5f, 1e9f, 0.0f}, {4});
  EXPECT_TRUE(ops::all_finite({a}));
  EXPECT_EQ(ops::count_bad_values({a}, 1e8), 1);
  a.f32()[3] = std::nanf("");
  Tensor b = Tensor::from_f32({INFINITY, -INFINITY, 3.0f}, {3}).to_dtype(DType::BF16);
  EXPECT_EQ(ops::count_bad_values({a, b}), 3);
  EXPECT_FALSE(ops::all_finite({b}));
  EXPECT_EQ(ops::count_bad_values({Tensor::zeros({5}, DType::I64)}), 0);
  // The bit-flip fault: one high exponent bit of element numel/2.
  Tensor w = Tensor::from_f32({0.5f, 0.5f, 0.0123f, 0.5f}, {4});
  auto [was, is] = flip_high_exponent_bit(w);
  EXPECT_EQ(was, 0.0123f);
  EXPECT_EQ(double(is), double(was) * std::ldexp(1.0, 128));  // 2^128 larger
  EXPECT_EQ(ops::count_bad_values({w}, kImplausibleWeight), 1);
}

TEST(GuardUnits, InjectionSpecs) {
  Injection i = parse_injection("bit-flip@40:1", "x");
  EXPECT_EQ(i.kind, FaultKind::BitFlip);
  EXPECT_EQ(i.step, 40);
  EXPECT_EQ(i.rank, 1);
  EXPECT_EQ(parse_injection("kill@3", "x").rank, 0);
  auto error = [](const std::string& spec) {
    try {
      parse_injection(spec, "cfg.yaml: 'inject'");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("nan-grads@3").find("did you mean 'nan-grad'"), std::string::npos);
  EXPECT_NE(error("kill").find("KIND@STEP"), std::string::npos);
  EXPECT_NE(error("kill@0").find("from 1"), std::string::npos);
  EXPECT_NE(error("kill@2:x").find("rank"), std::string::npos);
  EXPECT_NE(error("kill@2:").find("rank"), std::string::npos);
  // In a config: checked at load, named by file and key, kept in the resolved config (which
  // reads back), out of the hash.
  const std::string base =
      "init: random\narchitecture: tiny\ntokenizer: t.json\n"
      "datasets: [d.jsonl]\nmax_steps: 5\n";
  try {
    parse_train_config(base + "inject: [kill@2, bitflip@3]\n", "run.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("run.yaml:6: 'inject.1'"), std::string::npos) << e.what();
  }
  TrainConfig c = parse_train_config(
      base + "inject: [kill@2, 'bit-flip@3:1']\nguard: {spike_k: 5}\n", "run.yaml");
  EXPECT_EQ(c.inject, (std::vector<std::string>{"kill@2", "bit-flip@3:1"}));
  TrainConfig back = parse_train_config(c.to_yaml(), "back.yaml");
  EXPECT_EQ(back.inject, c.inject);
  EXPECT_EQ(back.guard.spike_k, 5);
  EXPECT_EQ(back.config_hash(), parse_train_config(base, "plain.yaml").config_hash());
  try {
    parse_train_config(base + "guard: {spike_warmup: 200}\n", "run.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("guard.spike_warmup"), std::string::npos) << e.what();
  }
  // Several injections of one kind and step hit successive attempts; a rank beyond the world is
  // an error.
  Injector inj({"nan-grad@3", "nan-grad@3", "kill-during-save@4"}, 2, "x");
  EXPECT_FALSE(inj.take(FaultKind::NanGrad, 2));
  EXPECT_TRUE(inj.take(FaultKind::NanGrad, 3));
  EXPECT_TRUE(inj.take(FaultKind::NanGrad, 3));
  EXPECT_FALSE(inj.take(FaultKind::NanGrad, 3));
  EXPECT_FALSE(inj.take(FaultKind::KillDuringSave, 3, true));
  EXPECT_TRUE(inj.take(FaultKind::KillDuringSave, 6, true));  // the first checkpoint at or after 4
  EXPECT_THROW(Injector({"kill@3:2"}, 2, "x"), InputError);
}

TEST(GuardUnits, SpikeRuleOnMedianAndMad) {
  // History 1, 2, 3, 4, 100: median 3, absolute deviations 2, 1, 0, 1, 97 -> MAD 1.
  EXPECT_EQ(median_of({1, 2, 3, 4, 100}), 3);
  EXPECT_EQ(mad_of({1, 2, 3, 4, 100}, 3), 1);
  EXPECT_EQ(median_of({4, 1, 3, 2}), 2.5);
  SpikeDetector d(SpikeRule{5, 5, 8, 1.5, 10});
  for (double x : {1, 2, 3, 4}) {
    d.record(x, 1.0);
    EXPECT_FALSE(d.check(1e9, 1.0)) << "armed only after 5 steps";
  }
  d.record(100, 1.0);
  // Loss: max(3 + 8 * 1.4826 * 1, 1.5 * 3) = 14.8608.
  EXPECT_FALSE(d.check(14.86, 1.0));
  auto s = d.check(14.87, 1.0);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->metric, "loss");
  EXPECT_NEAR(s->threshold, 14.8608, 1e-9);
  // Gradient norm: all 1.0, MAD 0: the ratio decides, 10 x 1.0.
  EXPECT_FALSE(d.check(2.0, 10.0));
  ASSERT_TRUE(d.check(2.0, 10.01));
  EXPECT_EQ(d.check(2.0, 10.01)->metric, "grad_norm");
  // The window keeps the last 5; the history survives a checkpoint.
  d.record(5, 1.0);
  SpikeDetector e(SpikeRule{5, 5, 8, 1.5, 10});
  e.from_json(d.to_json());
  EXPECT_EQ(e.size(), 5u);
  EXPECT_EQ(e.to_json(), d.to_json());
}

// ---- faults on one process ---------------------------------------------------------------------

TEST(Guard, NanGradientSkipsTheStepLikeARunThatSkippedTheBatch) {
  const std::string base = test::temp_dir("guard_nan");
  const int64_t steps = 8, at = 4;
  TrainConfig c = demo(base + "/nan", steps, 0, {"inject=[nan-grad@4]"});
  auto r = run(c);
  EXPECT_EQ(r.steps, steps);
  EXPECT_EQ(r.skipped_steps, 1);
  auto skipped = events(base + "/nan", "skipped_step");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0]["step"], at);
  ASSERT_EQ(events(base + "/nan", "inject").size(), 1u);
  EXPECT_EQ(events(base + "/nan", "inject")[0]["kind"], "nan-grad");
  // The reference: no NaN, no guard at work, the batch of step 4 drawn and dropped.
  run(demo(base + "/ref", steps, 0), drop(at, 1));
  EXPECT_TRUE(events(base + "/ref", "skipped_step").empty());
  expect_same_runs(base + "/nan", base + "/ref", steps);
  EXPECT_EQ(logged_steps(base + "/nan"), logged_steps(base + "/ref"));
  // The schedule did not move: step 4's learning rate is the reference's.
  auto lr = [](const std::string& run, int64_t s) {
    for (const auto& r : rows(run))
      if (!r.contains("event") && r["step"] == s) return r["lr"].get<double>();
    return -1.0;
  };
  EXPECT_EQ(lr(base + "/nan", at), lr(base + "/ref", at));
  const int64_t lost = steps_lost(base + "/nan", steps);
  EXPECT_EQ(lost, 0);
  check_row("01-nan-grad",
            {"--inject nan-grad@4", "CPU, 1 process",
             "NaN/Inf check of the gradients, before the optimizer",
             steps_text(skipped[0]["step"].get<int64_t>() - at),
             "step skipped: weights, AdamW moments, schedule unchanged; batch consumed", "0",
             "1 (the bad one)", std::to_string(lost),
             "bitwise equal to a run that skipped the same batch"});
}

TEST(Guard, NanGradientsFiveTimesInARowStopTheRun) {
  const std::string run_dir = test::temp_dir("guard_nan5");
  TrainConfig c =
      demo(run_dir, 10, 2, {"inject=[nan-grad@3,nan-grad@3,nan-grad@3,nan-grad@3,nan-grad@3]"});
  std::string msg;
  try {
    run(c);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("step 3: 5 optimizer steps in a row were skipped"), std::string::npos) << msg;
  EXPECT_NE(msg.find("step-2) is intact"), std::string::npos) << msg;
  EXPECT_EQ(events(run_dir, "skipped_step").size(), 5u);
  // The last checkpoint is the one before the trouble, whole and finite; resuming it finishes.
  auto latest = latest_checkpoint(run_dir);
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->step, 2);
  EXPECT_TRUE(verify_checkpoint(latest->dir, verify_for_use()).ok());
  c.inject.clear();
  EXPECT_EQ(run(c).steps, 10);
  check_row("02-nan-grad-x5",
            {"--inject nan-grad@3 (5 times)", "CPU, 1 process",
             "5 skipped steps in a row (guard.max_skips_in_row)", "0 steps",
             "run stops with an error naming the intact checkpoint (step-2)", "-", "5",
             std::to_string(steps_lost(run_dir, 10)), "resumes from step-2 and finishes"});
}

TEST(Guard, LossSpikeRollsBackAndSkipsTheWindowOfBatches) {
  const std::string base = test::temp_dir("guard_spike");
  const int64_t steps = 10, at = 7;
  TrainConfig c = demo(base + "/spike", steps, 4, {"inject=[loss-spike@7]"});
  auto r = run(c);
  EXPECT_EQ(r.steps, steps);
  EXPECT_EQ(r.rollbacks, 1);
  auto rb = events(base + "/spike", "rollback");
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_EQ(rb[0]["step"], at);
  EXPECT_EQ(rb[0]["rule"], "loss");
  EXPECT_EQ(rb[0]["to_step"], 4);
  EXPECT_GT(rb[0]["value"].get<double>(), 100 * rb[0]["median"].get<double>());
  const int64_t skipped = rb[0]["skipped_batches"];
  EXPECT_EQ(skipped, at - 4);  // the batches of steps 5, 6, 7
  // The reference: from step 5 on, the batches that led to the spike are never seen.
  run(demo(base + "/ref", steps, 4), drop(5, skipped));
  expect_same_runs(base + "/spike", base + "/ref", steps);
  const int64_t lost = steps_lost(base + "/spike", steps);
  EXPECT_EQ(lost, 0);
  check_row("03-loss-spike",
            {"--inject loss-spike@7", "CPU, 1 process",
             "spike rule (loss above its running median by 8 MADs and 1.5x)",
             steps_text(rb[0]["step"].get<int64_t>() - at),
             "rollback to step-4, then skip the window of batches",
             std::to_string(at - 1 - rb[0]["to_step"].get<int64_t>()), std::to_string(skipped),
             std::to_string(lost), "bitwise equal to a run that skipped the same batches"});
}

TEST(Guard, CorruptNewestCheckpointIsRejectedAtRollback) {
  const std::string base = test::temp_dir("guard_corrupt_rb");
  const int64_t steps = 11, at = 10;
  auto r = run(demo(base + "/run", steps, 4, {"inject=[corrupt-checkpoint@8,loss-spike@10]"}));
  EXPECT_EQ(r.steps, steps);
  auto rej = events(base + "/run", "checkpoint_rejected");
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0]["step"], 8);
  EXPECT_NE(rej[0]["problems"].dump().find("checksum"), std::string::npos) << rej[0].dump();
  EXPECT_TRUE(fs::exists(base + "/run/checkpoints/rejected-step-8/manifest.json"));
  auto rb = events(base + "/run", "rollback");
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_EQ(rb[0]["to_step"], 4);
  const int64_t skipped = rb[0]["skipped_batches"];
  EXPECT_EQ(skipped, at - 4);
  run(demo(base + "/ref", steps, 4), drop(5, skipped));
  expect_same_runs(base + "/run", base + "/ref", steps);
  const int64_t lost = steps_lost(base + "/run", steps);
  EXPECT_EQ(lost, 0);
  check_row("06-corrupt-checkpoint-rollback",
            {"--inject corrupt-checkpoint@8 --inject loss-spike@10", "CPU, 1 process",
             "checksum mismatch when the rollback verifies step-8", "at the next use (step 10)",
             "step-8 set aside as rejected-step-8; rollback to step-4", std::to_string(at - 1 - 4),
             std::to_string(skipped), std::to_string(lost),
             "bitwise equal to a run that skipped the same batches"});
}

TEST(Guard, BitFlipInAWeightRollsBackToTheSameResult) {
  const std::string base = test::temp_dir("guard_flip");
  const int64_t steps = 8, at = 6;
  auto r = run(demo(base + "/flip", steps, 4, {"inject=[bit-flip@6]"}));
  EXPECT_EQ(r.steps, steps);
  auto bad = events(base + "/flip", "bad_weights");
  auto rb = events(base + "/flip", "rollback");
  ASSERT_EQ(bad.size(), 1u);
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_EQ(rb[0]["rule"], "weights");
  EXPECT_EQ(rb[0]["to_step"], 4);
  EXPECT_EQ(rb[0]["skipped_batches"], 0);  // the data was fine: the same batches again
  // The weights are corrupt, not the data: the run ends exactly where a clean one does.
  run(demo(base + "/ref", steps, 4));
  expect_same_runs(base + "/flip", base + "/ref", steps);
  const int64_t lost = steps_lost(base + "/flip", steps);
  EXPECT_EQ(lost, 0);
  check_row("04-bit-flip",
            {"--inject bit-flip@6", "CPU, 1 process", detected_by(bad[0]),
             steps_text(bad[0]["step"].get<int64_t>() - at),
             "rollback to step-4, replaying the same batches", std::to_string(at - 1 - 4), "0",
             std::to_string(lost), "bitwise equal to a clean run"});
}

namespace {

// A bit flipped at step 3 in a frozen base weight of the tiny Llama-3 fixture, with LoRA on it
// (`more` picks the method): the base is in no checkpoint, so its hash must never move; when it
// does, the rollback reloads it and the run ends as a clean one. Writes the table row `key`.
void expect_frozen_flip_repaired(const std::string& name, const std::vector<std::string>& more,
                                 const std::string& key, const std::string& setup,
                                 const std::string& recovery) {
  const std::string base = test::temp_dir(name);
  const int64_t steps = 6, at = 3;
  auto cfg = [&](const std::string& out, std::vector<std::string> extra) {
    extra.insert(extra.end(), more.begin(), more.end());
    extra.insert(extra.end(), {"guard.replica_check_every=2", "save.every=2", "packing=false",
                               "micro_batch_size=4", "eval.split=0", "save.keep_last=0",
                               "optimizer.lr=1e-2", "max_steps=" + std::to_string(steps),
                               "output_dir=" + out, "datasets.0.path=" + small_data(),
                               "model=" + kSrc + "/tests/data/hf/tiny-llama3/model",
                               "tokenizer=" + kSrc + "/data/demo/tokenizer.json"});
    return load_train_config(kSrc + "/tests/data/configs/tiny-llama3-lora.yaml", extra);
  };
  auto r = run(cfg(base + "/flip", {"inject=[bit-flip-frozen@3]"}));
  EXPECT_EQ(r.rollbacks, 1);
  auto fm = events(base + "/flip", "frozen_mismatch");
  ASSERT_EQ(fm.size(), 1u) << read_file(base + "/flip/train.log");
  auto rb = events(base + "/flip", "rollback");
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_EQ(rb[0]["rule"], "frozen");
  EXPECT_EQ(rb[0].value("reloaded_frozen_weights", false), true);
  run(cfg(base + "/ref", {}));
  expect_same_tensors(base + "/flip/final/adapter_model.safetensors",
                      base + "/ref/final/adapter_model.safetensors");
  expect_same_tensors(fmt::format("{}/flip/checkpoints/step-{}/state.safetensors", base, steps),
                      fmt::format("{}/ref/checkpoints/step-{}/state.safetensors", base, steps));
  const int64_t lost = steps_lost(base + "/flip", steps);
  EXPECT_EQ(lost, 0);
  const int64_t seen = fm[0]["step"];
  check_row(key, {"--inject bit-flip-frozen@3", setup, detected_by(fm[0]), steps_text(seen - at),
                  recovery, std::to_string(seen - 1 - 2), "0", std::to_string(lost),
                  "bitwise equal to a clean run"});
}

}  // namespace

TEST(Guard, BitFlipInAFrozenBaseWeightIsFoundAndReloaded) {
  expect_frozen_flip_repaired("guard_frozen", {}, "05-bit-flip-frozen", "CPU, 1 process, LoRA",
                              "rollback to step-2, frozen weights reloaded from the model, same "
                              "batches");
}

// The same on QLoRA: the flip lands in the packed 4-bit codes (one code moves by 8 of its 16
// values); the hash of the stored bytes finds it and the rollback re-quantizes the base.
TEST(Guard, BitFlipInA4BitBaseWeightIsFoundAndReloaded) {
  expect_frozen_flip_repaired("guard_frozen_4bit", {"method=qlora"}, "05b-bit-flip-frozen-4bit",
                              "CPU, 1 process, QLoRA (NF4 codes)",
                              "rollback to step-2, 4-bit weights re-quantized from the model, "
                              "same batches");
}

// ---- crashes, through the rig binary -----------------------------------------------------------

TEST(Guard, KillsAndACorruptCheckpointResumeToTheCleanResult) {
  const std::string base = test::temp_dir("guard_kill");
  const int64_t steps = 12;
  run(demo(base + "/ref", steps, 5));
  // The same config through `rig train CONFIG --inject ...`, then `rig train --resume RUN`.
  auto crash = [&](const std::string& name, const std::string& injects) {
    const std::string out = base + "/" + name;
    std::ofstream(base + "/" + name + ".yaml") << demo(out, steps, 5).to_yaml();
    auto r = test::run_rig("train " + base + "/" + name + ".yaml --quiet " + injects);
    EXPECT_EQ(r.code, 128 + SIGKILL) << r.out;
    // What is on disk: the resolved config records the faults, the metrics the one that fired.
    EXPECT_NE(read_file(out + "/config.yaml").find("inject:"), std::string::npos);
    auto resumed = test::run_rig("train --quiet --resume " + out);
    EXPECT_EQ(resumed.code, 0) << resumed.out;
    EXPECT_NE(resumed.out.find(fmt::format("trained {} steps", steps)), std::string::npos)
        << resumed.out;
    expect_same_runs(out, base + "/ref", steps);
    EXPECT_EQ(steps_lost(out, steps), 0);
    return out;
  };

  // SIGKILL in the middle of step 8 (after its backward pass): resumes from step-5.
  std::string out = crash("kill", "--inject kill@8");
  auto inj = events(out, "inject");
  ASSERT_EQ(inj.size(), 1u);
  EXPECT_EQ(inj[0]["spec"], "kill@8");
  auto res = events(out, "resumed");
  ASSERT_EQ(res.size(), 1u);
  EXPECT_EQ(res[0]["step"], 5);
  check_row("08-kill", {"--inject kill@8", "CPU, 1 process (rig binary)",
                        "the process is gone; rig train --resume", "-",
                        "resume from the last complete checkpoint (step-5)", "2", "0",
                        std::to_string(steps_lost(out, steps)), "bitwise equal to a clean run"});

  // SIGKILL while step-10 is being written: its half-written folder is ignored.
  out = crash("kill_save", "--inject kill-during-save@10");
  res = events(out, "resumed");
  ASSERT_EQ(res.size(), 1u);
  EXPECT_EQ(res[0]["step"], 5);
  EXPECT_TRUE(verify_checkpoint(out + "/checkpoints/step-10").ok());  // written again, whole
  EXPECT_FALSE(fs::exists(out + "/checkpoints/.step-10.tmp"));
  check_row("09-kill-during-save",
            {"--inject kill-during-save@10", "CPU, 1 process (rig binary)",
             "the process is gone; step-10 has no manifest, so it is not a checkpoint", "-",
             "resume from step-5; the half-written folder is removed", "5", "0",
             std::to_string(steps_lost(out, steps)), "bitwise equal to a clean run"});

  // Bytes flipped in step-10 after it was written, then a kill: the resume rejects step-10.
  out = crash("corrupt", "--inject corrupt-checkpoint@10 --inject kill@12");
  auto rej = events(out, "checkpoint_rejected");
  ASSERT_EQ(rej.size(), 1u);
  EXPECT_EQ(rej[0]["step"], 10);
  res = events(out, "resumed");
  ASSERT_EQ(res.size(), 1u);
  EXPECT_EQ(res[0]["step"], 5);
  EXPECT_TRUE(fs::exists(out + "/checkpoints/rejected-step-10"));
  check_row("07-corrupt-checkpoint",
            {"--inject corrupt-checkpoint@10 --inject kill@12", "CPU, 1 process (rig binary)",
             "checksum mismatch when the resume verifies step-10", "at the next use (the resume)",
             "step-10 set aside as rejected-step-10; resume from step-5", "6", "0",
             std::to_string(steps_lost(out, steps)), "bitwise equal to a clean run"});
}

// ---- replicas: 2 ranks, Gloo over 127.0.0.1
// ------------------------------------------------------

namespace {

TrainConfig tiny(const std::string& out, const std::string& strategy, int world, int64_t steps,
                 std::vector<std::string> more = {}) {
  std::vector<std::string> o = {"model=" + kSrc + "/tests/data/hf/tiny-llama3/model",
                                "tokenizer=" + kSrc + "/data/demo/tokenizer.json",
                                "datasets.0.path=" + small_data(),
                                "output_dir=" + out,
                                "method=lora",
                                "strategy=" + strategy,
                                "max_steps=" + std::to_string(steps),
                                "gradient_accumulation_steps=1",
                                "micro_batch_size=" + std::to_string(4 / world),
                                "packing=false",
                                "eval.split=0",
                                "save.every=2",
                                "save.keep_last=0",
                                "dist.timeout_s=30",
                                "optimizer.lr=1e-2",
                                "guard.replica_check_every=2"};
  o.insert(o.end(), more.begin(), more.end());
  return load_train_config(kSrc + "/tests/data/configs/tiny-llama3-lora.yaml", o);
}

std::vector<TrainResult> train_ranks(int world, const std::function<TrainConfig(int)>& cfg) {
  dist::StoreServer server(0);
  std::vector<std::thread> ts;
  std::vector<TrainResult> results(static_cast<size_t>(world));
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      try {
        auto store =
            std::make_shared<dist::Store>("127.0.0.1", server.port(), r, dist::Millis(30000));
        dist::CommOptions o;
        o.timeout = 30s;
        auto comm = dist::make_gloo(store, r, world, o);
        TrainHooks h;
        h.quiet = true;
        h.comm = comm.get();
        results[size_t(r)] = train(cfg(r), h);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r)
    if (!errors[size_t(r)].empty())
      throw std::runtime_error(fmt::format("rank {}: {}", r, errors[size_t(r)]));
  return results;
}

void expect_same_adapters(const std::string& a, const std::string& b, int64_t steps) {
  expect_same_tensors(a + "/final/adapter_model.safetensors",
                      b + "/final/adapter_model.safetensors");
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(fmt::format("{}/checkpoints/step-{}", a, steps)))
    if (e.path().extension() == ".safetensors") files.insert(e.path().filename().string());
  ASSERT_FALSE(files.empty());
  for (const auto& f : files)
    expect_same_tensors(fmt::format("{}/checkpoints/step-{}/{}", a, steps, f),
                        fmt::format("{}/checkpoints/step-{}/{}", b, steps, f));
}

}  // namespace

TEST(GuardParallel, BitFlipOnOneReplicaIsNamedAndEveryRankRollsBack) {
  const std::string base = test::temp_dir("guard_replica");
  const int64_t steps = 6, at = 4;
  train_ranks(2, [&](int) { return tiny(base + "/ref", "ddp", 2, steps); });
  auto r = train_ranks(
      2, [&](int) { return tiny(base + "/flip", "ddp", 2, steps, {"inject=[bit-flip@4:1]"}); });
  EXPECT_EQ(r[0].rollbacks, 1);
  EXPECT_EQ(r[1].rollbacks, 1);
  auto mm = events(base + "/flip", "replica_mismatch");
  ASSERT_EQ(mm.size(), 1u) << read_file(base + "/flip/train.log");
  EXPECT_EQ(mm[0]["ranks"], json::array({1})) << mm[0].dump();
  ASSERT_EQ(mm[0]["hashes"].size(), 2u);
  EXPECT_NE(mm[0]["hashes"][0], mm[0]["hashes"][1]);
  auto rb = events(base + "/flip", "rollback");
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_EQ(rb[0]["rule"], "replica");
  EXPECT_EQ(rb[0]["to_step"], 2);
  EXPECT_EQ(rb[0]["skipped_batches"], 0);
  expect_same_adapters(base + "/flip", base + "/ref", steps);
  const int64_t lost = steps_lost(base + "/flip", steps);
  EXPECT_EQ(lost, 0);
  const int64_t seen = mm[0]["step"];
  check_row("10-bit-flip-replica",
            {"--inject bit-flip@4:1", "CPU, 2 ranks data-parallel (Gloo)", detected_by(mm[0]),
             steps_text(seen - at), "every rank rolls back to step-2, replaying the same batches",
             std::to_string(seen - 1 - 2), "0", std::to_string(lost),
             "bitwise equal to a clean 2-rank run"});
}

TEST(GuardParallel, BitFlipInAShardIsFoundByItsOwnHash) {
  const std::string base = test::temp_dir("guard_shard");
  const int64_t steps = 6, at = 4;
  train_ranks(2, [&](int) { return tiny(base + "/ref", "sharded", 2, steps); });
  auto r = train_ranks(
      2, [&](int) { return tiny(base + "/flip", "sharded", 2, steps, {"inject=[bit-flip@4:1]"}); });
  EXPECT_EQ(r[0].rollbacks, 1);
  auto mm = events(base + "/flip", "shard_mismatch");
  ASSERT_EQ(mm.size(), 1u) << read_file(base + "/flip/train.log");
  EXPECT_EQ(mm[0]["ranks"], json::array({1}));
  auto rb = events(base + "/flip", "rollback");
  ASSERT_EQ(rb.size(), 1u);
  EXPECT_EQ(rb[0]["to_step"], 2);
  expect_same_adapters(base + "/flip", base + "/ref", steps);
  const int64_t lost = steps_lost(base + "/flip", steps);
  EXPECT_EQ(lost, 0);
  const int64_t seen = mm[0]["step"];
  // A flipped bit in rank 0's shard of a frozen base weight: not in any checkpoint, so the
  // rollback reloads the frozen shards from the model folder.
  train_ranks(2, [&](int) {
    return tiny(base + "/frozen", "sharded", 2, steps, {"inject=[bit-flip-frozen@3]"});
  });
  auto fm = events(base + "/frozen", "shard_mismatch");
  ASSERT_EQ(fm.size(), 1u) << read_file(base + "/frozen/train.log");
  EXPECT_EQ(fm[0]["ranks"], json::array({0}));
  auto frb = events(base + "/frozen", "rollback");
  ASSERT_EQ(frb.size(), 1u);
  EXPECT_EQ(frb[0].value("reloaded_frozen_weights", false), true);
  expect_same_adapters(base + "/frozen", base + "/ref", steps);
  EXPECT_EQ(steps_lost(base + "/frozen", steps), 0);
  check_row("12-bit-flip-frozen-shard",
            {"--inject bit-flip-frozen@3", "CPU, 2 ranks sharded (Gloo)", detected_by(fm[0]),
             steps_text(fm[0]["step"].get<int64_t>() - 3),
             "every rank rolls back to step-2; the frozen shards are reloaded from the model",
             std::to_string(fm[0]["step"].get<int64_t>() - 1 - 2), "0",
             std::to_string(steps_lost(base + "/frozen", steps)),
             "bitwise equal to a clean 2-rank sharded run"});
  check_row("11-bit-flip-shard",
            {"--inject bit-flip@4:1", "CPU, 2 ranks sharded (Gloo)", detected_by(mm[0]),
             steps_text(seen - at), "every rank rolls back to step-2, replaying the same batches",
             std::to_string(seen - 1 - 2), "0", std::to_string(lost),
             "bitwise equal to a clean 2-rank sharded run"});
}
