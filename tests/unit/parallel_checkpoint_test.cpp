// Checkpoints of runs on several ranks: resumed on other world sizes, refused, verified.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "parallel_test_util.h"
#include "rig/io/safetensors.h"
#include "rig/train/checkpoint.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;
using namespace rig::test::parallel;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

// ---- sharded checkpoints across world sizes -----------------------------------------------------

TEST(Parallel, ShardedCheckpointResumesOnOtherWorldSizes) {
  const std::string base = test::temp_dir("par_reshard");
  const int64_t steps = 6;
  train_one(tiny(base + "/ref", "full", "sharded", 1, steps));

  // 4 ranks stop after 2 steps, 2 ranks continue to 4, one process finishes.
  const std::string run = base + "/run";
  reshard_run(run, steps, 4, 2,
              [&](int world) { return tiny(run, "full", "sharded", world, steps); });
  expect_close_runs(base + "/ref", run, "full", size_t(steps));

  // And a one-process checkpoint resumed sharded on 2 ranks.
  const std::string run2 = base + "/run2";
  int polls = 0;
  train_one(tiny(run2, "lora", "sharded", 1, steps), [&] { return ++polls > 3; });
  train_ranks(2, [&](int) { return tiny(run2, "lora", "sharded", 2, steps); });
  train_one(tiny(base + "/ref_lora", "lora", "sharded", 1, steps));
  expect_close_runs(base + "/ref_lora", run2, "lora", size_t(steps));
}

TEST(Parallel, DataParallelCheckpointResumesOnOneRank) {
  const std::string base = test::temp_dir("par_ddp_resume");
  const int64_t steps = 4;
  train_one(tiny(base + "/ref", "lora", "ddp", 1, steps));
  train_ranks(
      2, [&](int) { return tiny(base + "/run", "lora", "ddp", 2, steps); }, stop_after(2));
  EXPECT_EQ(latest_checkpoint(base + "/run")->step, 2);
  train_one(tiny(base + "/run", "lora", "ddp", 1, steps));
  expect_close_runs(base + "/ref", base + "/run", "lora", size_t(steps));

  // Packed rows: the ranks' data positions differ, so another world size cannot re-split them.
  TrainConfig packed = tiny(base + "/packed", "lora", "ddp", 2, steps);
  packed.packing = true;
  packed.sequence_len = 512;  // several samples per row, a different number on each rank
  train_ranks(
      2, [&](int) { return packed; }, stop_after(1));
  TrainConfig one = tiny(base + "/packed", "lora", "ddp", 1, steps);
  one.packing = true;
  one.sequence_len = 512;
  try {
    train_one(one);
    FAIL() << "re-split packed positions";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("packing"), std::string::npos) << e.what();
  }
}

TEST(Parallel, IncompatibleResumesAreClearErrors) {
  const std::string run = test::temp_dir("par_badresume");
  train_ranks(
      2, [&](int) { return tiny(run, "full", "sharded", 2, 3); }, stop_after(1));
  // LoRA on top of that checkpoint: other trainable units.
  TrainConfig c = tiny(run, "lora", "sharded", 1, 3);
  c.resume = latest_checkpoint(run)->dir;
  try {
    train_one(c);
    FAIL() << "resumed a checkpoint of another method";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("differs"), std::string::npos) << e.what();
  }
  // Two ranks resuming the 2-rank run with half the global batch.
  TrainConfig half = tiny(run, "full", "sharded", 2, 3);
  half.micro_batch_size = 1;
  try {
    train_one(half);
    FAIL() << "resumed with another global batch";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("global batch of 8 rows on 2 rank(s), but here it is 2"),
              std::string::npos)
        << e.what();
  }
}

TEST(Parallel, VerifyScansEveryRanksShards) {
  const std::string run = test::temp_dir("par_verify");
  train_ranks(
      2, [&](int) { return tiny(run, "full", "sharded", 2, 3); }, stop_after(1));
  auto ck = latest_checkpoint(run);
  ASSERT_TRUE(ck);
  auto ok = verify_checkpoint(ck->dir);
  EXPECT_TRUE(ok.ok()) << ok.to_text();
  EXPECT_GT(ok.tensors_scanned, 10u);
  // A NaN in rank 1's file: the checksum and the value scan both name that file.
  const std::string file = ck->dir + "/shard-1-of-2.safetensors";
  uint64_t header = 0, offset = 0;
  {
    auto f = SafeTensorsFile::open(file);
    offset = f.info("param.layer.0.decay").begin;
    std::ifstream in(file, std::ios::binary);
    in.read(reinterpret_cast<char*>(&header), 8);
  }
  const float nan = std::nanf("");
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekp(std::streamoff(8 + header + offset));
  io.write(reinterpret_cast<const char*>(&nan), 4);
  io.close();
  auto bad = verify_checkpoint(ck->dir);
  EXPECT_FALSE(bad.ok());
  std::string text = bad.to_text();
  EXPECT_NE(text.find("shard-1-of-2.safetensors"), std::string::npos) << text;
  EXPECT_NE(text.find("1 NaN"), std::string::npos) << text;
}
