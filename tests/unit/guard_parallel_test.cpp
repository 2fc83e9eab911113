// The guard on 2 ranks (Gloo over 127.0.0.1): a bit flipped in one replica or one shard is found.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "guard_test_util.h"
#include "parallel_test_util.h"
#include "rig/dist/communicator.h"
#include "rig/dist/store.h"
#include "rig/io/atomic_file.h"
#include "rig/train/guard.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;
using namespace rig::test::guard;
using rig::test::small_data;
namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace std::chrono_literals;

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

using rig::test::parallel::train_ranks;

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
