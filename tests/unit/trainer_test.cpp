// The training loop end to end on the bundled demo data: exact resume, interruption by signal,
// SIGKILL during a run, and real learning.
#include "rig/train/trainer.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "test_util.h"

using namespace rig;
namespace fs = std::filesystem;

namespace {

const std::string kDemo = std::string(RIG_SOURCE_DIR) + "/configs/demo.yaml";

// A small, fast variant of the demo.
TrainConfig small_config(const std::string& out, int64_t steps, int64_t save_every) {
  return load_train_config(
      kDemo, {"output_dir=" + out, "max_steps=" + std::to_string(steps),
              "save.every=" + std::to_string(save_every), "save.keep_last=0", "eval.every=0",
              "eval.generate=0", "micro_batch_size=4", "sequence_len=64", "schedule.warmup_steps=2",
              "tokenizer=" + std::string(RIG_SOURCE_DIR) + "/data/demo/tokenizer.json",
              "datasets.0.path=" + std::string(RIG_SOURCE_DIR) + "/data/demo/reverse.jsonl",
              "lora.dropout=0.1"});
}

std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  for (const auto& row : read_metrics(run + "/metrics.jsonl").rows)
    if (row.contains("loss") && !row.contains("eval_loss")) out.push_back(row["loss"]);
  return out;
}

}  // namespace

TEST(Trainer, ResumeIsExact) {
  const std::string a = test::temp_dir("resume_a"), b = test::temp_dir("resume_b");
  TrainHooks quiet;
  quiet.quiet = true;
  auto ra = train(small_config(a, 20, 10), quiet);
  EXPECT_EQ(ra.steps, 20);

  // Stop after 10 steps as a signal would, then resume.
  int polls = 0;
  TrainHooks stop = quiet;
  stop.should_stop = [&] { return ++polls > 10; };
  auto rb1 = train(small_config(b, 20, 10), stop);
  EXPECT_TRUE(rb1.interrupted);
  EXPECT_EQ(rb1.steps, 10);
  auto rb2 = train(small_config(b, 20, 10), quiet);
  EXPECT_EQ(rb2.steps, 20);

  EXPECT_EQ(losses(a), losses(b));  // bit-identical step losses
  ASSERT_EQ(losses(a).size(), 20u);
  auto fa = SafeTensorsFile::open(a + "/final/model.safetensors");
  auto fb = SafeTensorsFile::open(b + "/final/model.safetensors");
  for (const auto& t : fa.tensors()) {
    Tensor x = fa.get(t.name), y = fb.get(t.name);
    EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), x.nbytes())) << t.name;
  }
}

// optimizer: adamw8bit (every tensor 8-bit here: the demo's are small) learns, checkpoints its
// 8-bit state, and resumes bit for bit.
TEST(Trainer, EightBitAdamWLearnsAndResumesExactly) {
  const std::string a = test::temp_dir("adam8_a"), b = test::temp_dir("adam8_b");
  auto cfg = [&](const std::string& out) {
    TrainConfig c = small_config(out, 16, 8);
    c.optimizer.name = "adamw8bit";
    c.optimizer.min_8bit_size = 0;
    return c;
  };
  TrainHooks quiet;
  quiet.quiet = true;
  train(cfg(a), quiet);
  int polls = 0;
  TrainHooks stop = quiet;
  stop.should_stop = [&] { return ++polls > 8; };
  train(cfg(b), stop);
  auto ck = SafeTensorsFile::open(b + "/checkpoints/step-8/state.safetensors");
  bool has_codes = false;
  for (const auto& t : ck.tensors()) has_codes |= t.name.rfind("adamw8bit.mq.", 0) == 0;
  EXPECT_TRUE(has_codes) << "the checkpoint holds 8-bit moments";
  train(cfg(b), quiet);
  ASSERT_EQ(losses(a).size(), 16u);
  EXPECT_EQ(losses(a), losses(b));
  EXPECT_LT(losses(a).back(), losses(a).front());
}

TEST(Trainer, LoraWithDropoutResumesExactlyAndWritesPeftAdapter) {
  const std::string a = test::temp_dir("lora_a"), b = test::temp_dir("lora_b");
  auto cfg = [&](const std::string& out) {
    auto c = small_config(out, 8, 4);
    c.method = "lora";
    c.lora.r = 4;
    c.lora.dropout = 0.1;
    return c;
  };
  TrainHooks quiet;
  quiet.quiet = true;
  train(cfg(a), quiet);
  int polls = 0;
  TrainHooks stop = quiet;
  stop.should_stop = [&] { return ++polls > 4; };
  train(cfg(b), stop);
  train(cfg(b), quiet);
  EXPECT_EQ(losses(a), losses(b));
  EXPECT_TRUE(fs::exists(b + "/final/adapter_config.json"));
  auto fa = SafeTensorsFile::open(a + "/final/adapter_model.safetensors");
  auto fb = SafeTensorsFile::open(b + "/final/adapter_model.safetensors");
  EXPECT_TRUE(fa.has("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  for (const auto& t : fa.tensors())
    EXPECT_EQ(0, std::memcmp(fa.get(t.name).raw(), fb.get(t.name).raw(), t.end - t.begin))
        << t.name;
}

TEST(Trainer, ChangedConfigRefusesToResume) {
  const std::string a = test::temp_dir("changed");
  TrainHooks stop;
  stop.quiet = true;
  int polls = 0;
  stop.should_stop = [&] { return ++polls > 2; };
  train(small_config(a, 10, 5), stop);
  auto c = small_config(a, 10, 5);
  c.optimizer.lr = 1e-2;
  try {
    train(c, TrainHooks{{}, true});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("configuration differs"), std::string::npos) << e.what();
  }
}

namespace {
using test::spawn_rig;
using test::wait_exit;
std::string common_args(const std::string& out, int steps) {
  return kDemo + " --quiet --output " + out + " --set max_steps=" + std::to_string(steps) +
         " --set save.every=5 --set save.keep_last=2 --set eval.every=0 --set eval.generate=0" +
         " --set tokenizer=" + RIG_SOURCE_DIR +
         "/data/demo/tokenizer.json --set datasets.0.path=" + RIG_SOURCE_DIR +
         "/data/demo/reverse.jsonl";
}
// Polls until the run has a complete checkpoint of step `step` or later; false after `seconds`
// (generous: a loaded 2-core machine under the sanitizers).
bool wait_for_checkpoint(const std::string& run, int64_t step = 1, double seconds = 300) {
  return test::wait_until(
      [&] {
        auto c = latest_checkpoint(run);
        return c && c->step >= step;
      },
      seconds);
}
}  // namespace

TEST(Trainer, SigintSavesAndResumeFinishes) {
  const std::string out = test::temp_dir("sigint");
  pid_t pid = spawn_rig("train " + common_args(out, 100000), out + ".log");
  ASSERT_TRUE(wait_for_checkpoint(out));
  kill(pid, SIGINT);
  EXPECT_EQ(wait_exit(pid), 130) << test::run_rig("ckpt list " + out).out;
  auto latest = latest_checkpoint(out);
  ASSERT_TRUE(latest);
  EXPECT_TRUE(verify_checkpoint(latest->dir).ok());
  // The checkpoint written on SIGINT is the step the run reached.
  EXPECT_EQ(latest->step, int64_t(losses(out).size()));
}

TEST(Trainer, SigkillLeavesAResumableCheckpoint) {
  const std::string out = test::temp_dir("sigkill");
  pid_t pid = spawn_rig("train " + common_args(out, 60), out + ".log");
  // Kill it while it keeps writing checkpoints every 5 steps: as soon as the second one (step
  // 10 of 60) is complete, wherever the run then is (training, or writing the next one).
  ASSERT_TRUE(wait_for_checkpoint(out, 10));
  kill(pid, SIGKILL);
  wait_exit(pid);
  auto latest = latest_checkpoint(out);
  ASSERT_TRUE(latest);
  EXPECT_TRUE(verify_checkpoint(latest->dir).ok());
  auto r = test::run_rig("train --quiet --resume " + out);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("trained 60 steps"), std::string::npos) << r.out;
  EXPECT_EQ(losses(out).size(), 60u);
}

TEST(Trainer, DemoLearnsTheHeldOutTask) {
  // A shortened demo: held-out exact match must rise from 0 to a clear majority.
  const std::string out = test::temp_dir("demo");
  auto c = load_train_config(
      kDemo,
      {"output_dir=" + out, "max_steps=200", "eval.every=200", "eval.generate=60", "save.every=0",
       "tokenizer=" + std::string(RIG_SOURCE_DIR) + "/data/demo/tokenizer.json",
       "datasets.0.path=" + std::string(RIG_SOURCE_DIR) + "/data/demo/reverse.jsonl"});
  auto r = train(c, TrainHooks{{}, true});
  std::vector<double> em;
  for (const auto& row : read_metrics(out + "/metrics.jsonl").rows)
    if (row.contains("eval_exact_match")) em.push_back(row["eval_exact_match"]);
  ASSERT_GE(em.size(), 2u);
  EXPECT_EQ(em.front(), 0.0);  // the random model solves nothing
  EXPECT_GT(r.exact_match, 0.5);
  EXPECT_LT(r.eval_loss, 0.5);
  // The guard (on by default) saw nothing to skip, roll back or reject in a healthy run.
  for (const auto& row : read_metrics(out + "/metrics.jsonl").rows)
    EXPECT_FALSE(row.contains("event")) << row.dump();
  EXPECT_EQ(r.skipped_steps, 0);
  EXPECT_EQ(r.rollbacks, 0);
}

// The run states what rig plan predicts for it beside max_memory, and warns before the first step
// when the prediction is over it (the CPU engine's pool: the same formulas without the CUDA
// context). The demo peaks at about 57 MiB; 40 MiB cannot hold it.
TEST(Trainer, StatesThePlannedPeakAndWarnsWhenOverTheBudget) {
  const std::string dir = test::temp_dir("planned-peak");
  const std::string args = " --quiet --set device=cpu --set max_steps=2 "
                           "--set schedule.warmup_steps=0 --set eval.generate=0 --set tokenizer=" +
                           std::string(RIG_SOURCE_DIR) +
                           "/data/demo/tokenizer.json --set datasets.0.path=" + RIG_SOURCE_DIR +
                           "/data/demo/reverse.jsonl";
  auto fits = test::run_rig("train " + kDemo + args + " --output " + dir + "/fits");
  ASSERT_EQ(fits.code, 0) << fits.out;
  const std::string log = read_file(dir + "/fits/train.log");
  EXPECT_NE(log.find("rig plan predicts a peak of"), std::string::npos) << log;
  auto over = test::run_rig("train " + kDemo + args + " --set max_memory=40MiB --output " + dir +
                            "/over");
  EXPECT_NE(over.code, 0) << over.out;
  const std::string warned = read_file(dir + "/over/train.log");
  EXPECT_NE(warned.find("warning: rig plan predicts a peak of"), std::string::npos) << warned;
  EXPECT_NE(warned.find("over max_memory 40.00 MiB"), std::string::npos) << warned;
  EXPECT_NE(over.out.find("out of memory"), std::string::npos) << over.out;
}

TEST(Trainer, BadConfigAndDataAreClearErrors) {
  const std::string dir = test::temp_dir("badtrain");
  auto r = test::run_rig("train " + kDemo + " --set learnig_rate=1e-3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("did you mean 'learning_rate'"), std::string::npos) << r.out;
  std::ofstream(dir + "/bad.jsonl")
      << "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n{oops\n";
  r = test::run_rig("train " + kDemo + " --quiet --output " + dir +
                    "/run --set datasets.0.path=" + dir +
                    "/bad.jsonl --set tokenizer=" + RIG_SOURCE_DIR + "/data/demo/tokenizer.json");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("bad.jsonl:"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir + "/run/final"));
}

// A recipe names its model as on the Hugging Face Hub; on a machine that has not downloaded it,
// the run says what to do instead of naming a missing tokenizer file.
TEST(Trainer, ModelNotDownloadedSaysHowToGetIt) {
  const std::string dir = test::temp_dir("not-downloaded");
  auto r = test::run_rig("train " + std::string(RIG_SOURCE_DIR) +
                         "/configs/llama3-70b-qlora-4x24gb.yaml --quiet --set device=cpu --set "
                         "precision=fp32 --output " + dir + "/run");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("model: 'meta-llama/Meta-Llama-3-70B' is not a folder here"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("huggingface-cli download meta-llama/Meta-Llama-3-70B"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(dir + "/run/final"));
}

TEST(Trainer, PretokenizedIdOutsideTheVocabularyIsCaughtAtLoad) {
  // Row 1 of a pre-tokenized file holds id 300; the demo model's vocabulary is 264. The error
  // names the file, the row and the column before the run folder gets a config or metrics.
  const std::string dir = test::temp_dir("badtokens");
  Tensor t = Tensor::empty({3, 4}, DType::I64);
  const int64_t v[] = {5, 6, 7, 8, 9, 300, 11, -1, 12, 13, 14, 15};
  std::copy(v, v + 12, t.data<int64_t>());
  save_safetensors(dir + "/tokens.safetensors", {{"tokens", t}});
  auto r = test::run_rig(
      "train " + kDemo + " --quiet --output " + dir + "/run --set 'datasets=[{path: " + dir +
      "/tokens.safetensors, format: tokens}]' --set tokenizer=" + RIG_SOURCE_DIR +
      "/data/demo/tokenizer.json");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokens.safetensors: tensor 'tokens' row 1 column 1: id 300 is outside the "
                       "model's vocabulary (vocab_size 264)"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(dir + "/run/config.yaml"));
  EXPECT_FALSE(fs::exists(dir + "/run/metrics.jsonl"));
}

TEST(Trainer, GpuTelemetryInMetricsAndThermalPause) {
  // The fake NVML: a card that heats past the limit for a few samples, then cools down.
  const std::string out = test::temp_dir("thermal");
  std::ofstream(out + "/scenario.json")
      << R"({"gpus": [{"temp": 60, "timeline": [{}, {}, {"temp": 90}, {}, {}, {"temp": 70}]}]})";
  std::string env = std::string("RIG_NVML_LIBRARY=") + FAKE_NVML_LIBRARY +
                    " FAKE_NVML_SCENARIO=" + out + "/scenario.json RIG_THERMAL_POLL_MS=10 ";
  std::string cmd = "sh -c '" + env + RIG_BINARY + " train " + common_args(out + "/run", 8) +
                    " --set schedule.warmup_steps=2 --set thermal.pause_above_c=85 --set "
                    "thermal.resume_below_c=80' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_TRUE(p);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  ASSERT_EQ(pclose(p), 0) << text;
  int with_temp = 0;
  for (const auto& row : read_metrics(out + "/run/metrics.jsonl").rows)
    if (row.contains("gpu") && row["gpu"].contains("max_temp_c")) ++with_temp;
  EXPECT_EQ(with_temp, 8);
  std::string log = read_file(out + "/run/train.log");
  EXPECT_NE(log.find("pausing: GPU 0 at 90 C is above 85 C"), std::string::npos) << log;
  EXPECT_NE(log.find("resuming at 70 C"), std::string::npos) << log;
}
