// The training guard (docs/reliability.md). Every fault `rig train --inject` knows is injected on
// the CPU engine (and on 2 Gloo ranks for the replica checks, in guard_parallel_test.cpp), and
// each test asserts that it was detected, what was done about it, that nothing was lost, and that
// the final weights equal an independent reference where the method promises it: a clean run, or
// a clean run that dropped the same batches without training on them
// (TrainHooks::discard_batches, no guard involved). The guard's pieces: guard_units_test.cpp.
//
// Each fault test also writes its row of the table in docs/reliability.md under
// BUILD/reliability/ and checks that the committed page holds that row word for word
// (scripts/reliability-table.sh prints the rows to paste after a change).
#include "rig/train/guard.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "guard_test_util.h"
#include "rig/io/atomic_file.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;
using namespace rig::test::guard;
using rig::test::small_data;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

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

// The final model and the final checkpoint (weights and optimizer state) of two runs.
void expect_same_runs(const std::string& a, const std::string& b, int64_t steps) {
  expect_same_tensors(a + "/final/model.safetensors", b + "/final/model.safetensors");
  const std::string ck = fmt::format("/checkpoints/step-{}/state.safetensors", steps);
  expect_same_tensors(a + ck, b + ck);
}

}  // namespace

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
