// `rig train --nproc-per-node` end to end: one run, memory, a killed worker, SIGINT.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "parallel_test_util.h"
#include "rig/io/atomic_file.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "test_util.h"

using namespace rig;
using namespace rig::test::parallel;
using rig::test::small_data;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

// ---- through the rig binary -----------------------------------------------------------------

namespace {

std::string cli_args(const std::string& out, int64_t steps, int64_t micro) {
  return fmt::format(
      "train {}/tests/data/configs/tiny-llama3-lora.yaml --quiet --output {} --set "
      "model={}/tests/data/hf/tiny-llama3/model "
      "--set tokenizer={}/data/demo/tokenizer.json --set datasets.0.path={} --set max_steps={} "
      "--set micro_batch_size={} --set gradient_accumulation_steps=2 --set packing=false "
      "--set eval.split=0 --set save.every=0 --set dist.timeout_s=20",
      kSrc, out, kSrc, kSrc, small_data(), steps, micro);
}

std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::ifstream f(fmt::format("/proc/{}/task/{}/children", pid, pid));
  pid_t c;
  while (f >> c) out.push_back(c);
  return out;
}

bool alive(pid_t pid) {
  // Gone, or a zombie nobody will reap (it would show as 'Z').
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(f, stat)) return false;
  auto p = stat.rfind(')');
  return p != std::string::npos && p + 2 < stat.size() && stat[p + 2] != 'Z';
}

// A `rig train --nproc-per-node N` launcher running in the background, and its workers.
struct Launch {
  pid_t pid = 0;
  std::vector<pid_t> workers;
};

// Starts `rig ARGS` in the background, its output in OUT/log, and waits until its run folder
// OUT/run has logged a step: training runs. pid 0 (and the launcher killed) when it did not
// start within 5 minutes (generous: a loaded 2-core machine under the sanitizers).
Launch start_training(const std::string& args, const std::string& out) {
  const pid_t pid = test::spawn_rig(args, out + "/log");
  if (pid > 0 && test::wait_for_nonempty(out + "/run/metrics.jsonl", 300))
    return {pid, children_of(pid)};
  if (pid > 0) {
    kill(pid, SIGKILL);
    test::wait_status(pid);
  }
  return {};
}

}  // namespace

TEST(Parallel, NprocPerNodeWritesOneRunEqualToOneProcess) {
  const std::string base = test::temp_dir("par_cli");
  auto ref = test::run_rig(cli_args(base + "/one", 3, 4));
  ASSERT_EQ(ref.code, 0) << ref.out;
  auto two = test::run_rig(cli_args(base + "/two", 3, 2) + " --nproc-per-node 2");
  ASSERT_EQ(two.code, 0) << two.out;
  // Rank 0 alone reports and writes.
  size_t n = 0;
  for (size_t p = two.out.find("trained 3 steps"); p != std::string::npos;
       p = two.out.find("trained 3 steps", p + 1))
    ++n;
  EXPECT_EQ(n, 1u) << two.out;
  expect_close_runs(base + "/one", base + "/two", "lora", 3);
  std::string log = read_file(base + "/two/train.log");
  EXPECT_NE(log.find("2 ranks, ddp"), std::string::npos) << log;
}

TEST(Parallel, KilledWorkerStopsTheOthersNamingIt) {
  const std::string out = test::temp_dir("par_kill");
  // Wait until training runs, then kill rank 1.
  const auto [pid, workers] = start_training(
      cli_args(out + "/run", 100000, 2) + " --nproc-per-node 2 --launch-grace-ms 20000", out);
  ASSERT_NE(pid, 0) << read_file(out + "/log");
  ASSERT_EQ(workers.size(), 2u);
  pid_t rank1 = 0;
  for (pid_t w : workers) {
    std::ifstream env(fmt::format("/proc/{}/environ", w));
    // One string built in place: `std::string(1, '\0') + std::string(...)` here set off GCC 12's
    // -Wrestrict false positive.
    std::string all(1, '\0');
    all.append(std::istreambuf_iterator<char>(env), std::istreambuf_iterator<char>());
    if (all.find(std::string("\0RANK=1\0", 8)) != std::string::npos) rank1 = w;
  }
  ASSERT_NE(rank1, 0);
  kill(rank1, SIGKILL);
  const int st = test::wait_status(pid);
  std::string log = read_file(out + "/log");
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << log;
  EXPECT_NE(log.find("rig launch: rank 1 (pid"), std::string::npos) << log;
  // The survivor names the dead rank from the store, not from its collective timeout (which
  // would say "did not take part"): it noticed the death itself, no clock needed.
  EXPECT_NE(log.find("rank 1 exited or lost its connection"), std::string::npos) << log;
  for (pid_t w : workers) EXPECT_FALSE(alive(w)) << "worker " << w << " outlived the launcher";
}

namespace {
int64_t peak_memory(const std::string& run) {
  int64_t peak = 0;
  for (const auto& row : read_metrics(run + "/metrics.jsonl").rows)
    if (row.contains("peak_memory_bytes"))
      peak = std::max<int64_t>(peak, row["peak_memory_bytes"].get<int64_t>());
  return peak;
}
}  // namespace

TEST(Parallel, ShardedRankHoldsLessThanDataParallelAndEvaluates) {
  // Full fine-tuning of a model whose layers outweigh its activations: weights, gradients and both
  // AdamW moments are what a rank holds, and sharding halves them on 2 ranks.
  const std::string base = test::temp_dir("par_mem");
  std::ofstream(base + "/cfg.yaml")
      << "init: random\n"
         "architecture: {model_type: llama, vocab_size: 264, hidden_size: 192, "
         "intermediate_size: 768, num_hidden_layers: 3, num_attention_heads: 4, "
         "num_key_value_heads: 2, max_position_embeddings: 256, tie_word_embeddings: true}\n"
         "tokenizer: " +
             kSrc +
             "/data/demo/tokenizer.json\n"
             "datasets: [{path: " +
             small_data() +
             ", format: chat, template: chatml}]\n"
             "method: full\nsequence_len: 64\npacking: false\nmicro_batch_size: 2\n"
             "gradient_accumulation_steps: 2\nmax_steps: 2\n"
             "schedule: {name: constant, warmup_steps: 0}\n"
             "eval: {every: 0, split: 0.05, batches: 1, generate: 2}\nsave: {every: 0}\n";
  auto run = [&](const std::string& strategy) {
    auto r = test::run_rig("train " + base + "/cfg.yaml --quiet --nproc-per-node 2 --output " +
                           base + "/" + strategy + " --set strategy=" + strategy);
    EXPECT_EQ(r.code, 0) << r.out;
    return base + "/" + strategy;
  };
  const std::string ddp = run("ddp"), sharded = run("sharded");
  const int64_t a = peak_memory(ddp), b = peak_memory(sharded);
  EXPECT_GT(a, 0);
  // ddp: weights, gradients, 2 moments and the buckets (5 copies); sharded: half of 4 copies plus
  // what is in flight (this layer's and the prefetched layer's weights, this layer's gradients
  // and the previous one's being reduce-scattered): about 0.7 with 3 layers, less with more.
  EXPECT_LT(double(b), 0.75 * double(a)) << "ddp " << a << " bytes, sharded " << b;
  // Held-out loss and generation run on the gathered model and agree with the replicated one.
  auto eval_loss = [](const std::string& run) {
    double l = -1;
    for (const auto& row : read_metrics(run + "/metrics.jsonl").rows)
      if (row.contains("eval_loss")) l = row["eval_loss"];
    return l;
  };
  EXPECT_GT(eval_loss(ddp), 0);
  EXPECT_NEAR(eval_loss(sharded), eval_loss(ddp), 1e-4);
  expect_close_runs(ddp, sharded, "full", 2);
}

TEST(Parallel, SigintToTheLauncherCheckpointsOnEveryRankAtOneStep) {
  const std::string out = test::temp_dir("par_sigint");
  const auto [pid, workers] = start_training(
      cli_args(out + "/run", 100000, 2) + " --set strategy=sharded --nproc-per-node 2", out);
  ASSERT_NE(pid, 0) << read_file(out + "/log");
  kill(pid, SIGINT);
  const int st = test::wait_status(pid);
  std::string log = read_file(out + "/log");
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 130) << log;
  auto ck = latest_checkpoint(out + "/run");
  ASSERT_TRUE(ck) << log;
  EXPECT_TRUE(verify_checkpoint(ck->dir).ok()) << verify_checkpoint(ck->dir).to_text();
  EXPECT_EQ(ck->step, int64_t(losses(out + "/run").size()));
  EXPECT_TRUE(fs::exists(ck->dir + "/shard-1-of-2.safetensors"));
  for (pid_t w : workers) EXPECT_FALSE(alive(w));
}

// Sharded QLoRA whose whole 4-bit base (about 41 MiB gathered with one decoded weight) does not
// fit beside a rank's shard in max_memory: training fits, exact-match generation would not, and
// the run is refused before its first step instead of stopping out of memory at the first
// evaluation.
TEST(Parallel, ShardedGenerationLargerThanTheBudgetIsRefusedAtStart) {
  const std::string out = test::temp_dir("par_gen_budget");
  auto run = [&](int generate) {
    return test::run_rig(fmt::format(
        "train {}/configs/demo.yaml --quiet --nproc-per-node 2 --output {}/gen{} --set "
        "device=cpu method=qlora strategy=sharded architecture.hidden_size=1024 "
        "architecture.intermediate_size=2048 architecture.num_hidden_layers=6 "
        "architecture.num_attention_heads=8 architecture.num_key_value_heads=4 "
        "tokenizer={}/data/demo/tokenizer.json datasets.0.path={}/data/demo/reverse.jsonl "
        "sequence_len=32 micro_batch_size=1 max_steps=2 schedule.warmup_steps=0 save.every=0 "
        "eval.every=2 eval.batches=1 eval.generate={} max_memory=56MiB",
        kSrc, out, generate, kSrc, kSrc, generate));
  };
  auto loss_only = run(0);
  ASSERT_EQ(loss_only.code, 0) << loss_only.out;
  EXPECT_TRUE(fs::exists(out + "/gen0/final/adapter_model.safetensors"));
  auto refused = run(2);
  EXPECT_NE(refused.code, 0) << refused.out;
  EXPECT_NE(refused.out.find("demo.yaml: eval.generate 2 generates with the whole model gathered "
                             "on every rank"),
            std::string::npos)
      << refused.out;
  EXPECT_NE(refused.out.find("of 56.00 MiB); set eval.generate: 0"), std::string::npos)
      << refused.out;
  EXPECT_FALSE(fs::exists(out + "/gen2/metrics.jsonl")) << "refused before the first step";
  EXPECT_FALSE(fs::exists(out + "/gen2/final"));
}
