// Several ranks sharing one GPU (threads here, each with its own Gloo communicator staged outside
// NCCL: sockets, shared host memory or device buffers): the collectives against closed forms, and
// data-parallel and sharded bf16 training (LoRA, QLoRA, full) against the one-rank GPU run,
// resumed on 4 -> 2 -> 1 ranks.
// Skipped with the reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "../unit/parallel_test_util.h"
#include "rig/dist/bench.h"
#include "rig/dist/communicator.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/train/checkpoint.h"

using namespace rig;
using namespace rig::test::parallel;

namespace {

#define REQUIRE_GPU() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible: shared-GPU rank tests run on a GPU machine"

// Each thread's Gloo communicator, taking tensors on cuda:0.
std::unique_ptr<dist::Communicator> on_gpu(std::unique_ptr<dist::Communicator> c) {
  return dist::make_staged(std::move(c), Device::cuda(0));
}

// The tiny fixture on the GPU in bf16 mixed precision.
TrainConfig gpu_tiny(const std::string& out, const std::string& method, const std::string& strategy,
                     int world, int64_t steps, std::vector<std::string> more = {}) {
  more.insert(more.end(), {"device=cuda", "precision=bf16"});
  return tiny(out, method, strategy, world, steps, 2, 8, more);
}

// Other world sizes split the batch into other bf16 products (8-bit mantissa, float32
// accumulation) and sum float32 gradients in another order. Measured on an H100 (2026-12-05):
// losses within 4e-5 relative, weights within 1.3e-4 relative L2 (1.6e-4 at most, a sixtieth of
// one AdamW step at lr 1e-2). The bounds: a quarter of one bf16 rounding (2^-8) on the losses,
// 2e-3 on the weights. Returns the worst relative loss difference.
double expect_bf16_close(const std::string& ref, const std::string& got, const std::string& method,
                         size_t steps) {
  auto a = losses(ref), b = losses(got);
  EXPECT_EQ(a.size(), steps) << ref;
  EXPECT_EQ(b.size(), steps) << got;
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double d = std::abs(b[i] - a[i]) / std::abs(a[i]);
    worst = std::max(worst, d);
    EXPECT_LT(d, 1e-3) << got << " step " << i + 1 << ": " << b[i] << " vs " << a[i];
  }
  auto fa = SafeTensorsFile::open(final_file(ref, method)),
       fb = SafeTensorsFile::open(final_file(got, method));
  double num = 0, den = 0, worst_abs = 0;
  for (const auto& t : fa.tensors()) {
    Tensor x = fa.get_f32(t.name), y = fb.get_f32(t.name);
    EXPECT_EQ(x.numel(), y.numel()) << t.name;
    if (x.numel() != y.numel()) continue;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double d = double(x.f32()[i]) - y.f32()[i];
      num += d * d;
      den += double(x.f32()[i]) * x.f32()[i];
      worst_abs = std::max(worst_abs, std::abs(d));
    }
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  EXPECT_LT(rel, 2e-3) << got << ": weights differ by " << rel << " (relative L2)";
  EXPECT_LT(worst_abs, 2e-3) << got;
  std::printf("%s vs %s: worst loss difference %.2e, weights %.2e relative L2, %.2e at most\n",
              got.c_str(), ref.c_str(), worst, rel, worst_abs);
  return worst;
}

}  // namespace

TEST(SharedGpu, StagedCollectivesAreCorrectAtEverySize) {
  REQUIRE_GPU();
  // Through Gloo's sockets, the shared-memory segment of ranks on one host, and device buffers
  // (CUDA IPC between processes; these ranks are threads, so the same rounds over each other's
  // pointers), at sizes from 4 B to 4 MiB and at 150 MiB (several 32 MiB rounds per collective).
  struct Case {
    int world;
    const char* transport;
    int64_t min_bytes, max_bytes;
  };
  const Case cases[] = {{2, "Gloo sockets", 4, 4 << 20},
                        {4, "Gloo sockets", 4, 4 << 20},
                        {2, "shared host memory", 4, 4 << 20},
                        {4, "shared host memory", 4, 4 << 20},
                        {2, "CUDA IPC device buffers", 4, 4 << 20},
                        {4, "CUDA IPC device buffers", 4, 4 << 20},
                        {4, "shared host memory", 150 << 20, 150 << 20},
                        {4, "CUDA IPC device buffers", 150 << 20, 150 << 20}};
  for (const Case& c : cases) {
    const std::string tr = c.transport;
    const bool store_shared = tr != "Gloo sockets";
    if (tr == "shared host memory") ::setenv("RIG_STAGED_IPC", "0", 1);
    const int world = c.world;
    dist::StoreServer server(0);
    std::vector<std::thread> ts;
    std::vector<int64_t> wrong(static_cast<size_t>(world), -1);
    std::vector<std::string> errors(static_cast<size_t>(world)), used(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r)
      ts.emplace_back([&, r] {
        try {
          auto store = std::make_shared<dist::Store>("127.0.0.1", server.port(), r,
                                                     dist::Millis(30000));
          dist::CommOptions co;
          co.timeout = std::chrono::seconds(30);
          auto comm = dist::make_staged(dist::make_gloo(store, r, world, co), Device::cuda(0),
                                        store_shared ? store : nullptr);
          EXPECT_EQ(comm->device(), Device::cuda(0));
          used[size_t(r)] = comm->transport();
          dist::CommBenchOptions o;
          o.ops = dist::all_comm_ops();
          o.min_bytes = c.min_bytes;
          o.max_bytes = c.max_bytes;
          o.factor = 8;
          o.iters = 2;
          o.warmup = 1;
          int64_t w = 0;
          for (const auto& row : dist::bench_comm(*comm, o)) w += row.wrong;
          wrong[size_t(r)] = w;
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    ::unsetenv("RIG_STAGED_IPC");
    for (int r = 0; r < world; ++r) {
      const std::string what = fmt::format("rank {} of {} through {}, {} to {} bytes", r, world,
                                           tr, c.min_bytes, c.max_bytes);
      EXPECT_EQ(errors[size_t(r)], "") << what;
      EXPECT_EQ(used[size_t(r)], tr) << what;
      EXPECT_EQ(wrong[size_t(r)], 0) << what;
    }
  }
}

class SharedGpuEquivalence
    : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(SharedGpuEquivalence, TwoAndFourRanksOnOneGpuMatchOneRankInBf16) {
  REQUIRE_GPU();
  const auto& [method, strategy] = GetParam();
  const std::string base = test::temp_dir("gpu_shared_" + method + "_" + strategy);
  const int64_t steps = 6;
  train_one(gpu_tiny(base + "/one", method, strategy, 1, steps));
  for (int world : {2, 4}) {
    const std::string run = base + "/w" + std::to_string(world);
    train_ranks(
        world, [&](int) { return gpu_tiny(run, method, strategy, world, steps); }, {}, on_gpu);
    expect_bf16_close(base + "/one", run, method, size_t(steps));
  }
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndStrategies, SharedGpuEquivalence,
    ::testing::Combine(::testing::Values("lora", "qlora", "full"),
                       ::testing::Values("ddp", "sharded")),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::get<1>(info.param);
    });

// A base the folder stores in bf16 (the bitsandbytes fixture's): it loads as bf16, and under
// sharded QLoRA each rank quantizes only the weights its shards hold, on demand, the nested
// offsets shared through the staged all-reduce. Four ranks end as one process does.
TEST(SharedGpu, Bf16FolderShardedOnFourRanksMatchesOneRank) {
  REQUIRE_GPU();
  // The tiny fixture written in bf16 (its vocabulary fits the demo tokenizer).
  const std::string dir = test::temp_dir("gpu_bf16_folder") + "/model";
  LlamaModel::load(kSrc + "/tests/data/hf/tiny-llama3/model")->save_pretrained(dir, DType::BF16);
  ASSERT_EQ(WeightFiles::open_dir(dir).info("model.embed_tokens.weight").dtype, DType::BF16);
  const std::vector<std::string> folder = {"model=" + dir};
  const int64_t steps = 6;
  for (const std::string method : {"qlora", "lora"}) {
    const std::string base = test::temp_dir("gpu_bf16_folder_" + method);
    train_one(gpu_tiny(base + "/one", method, "sharded", 1, steps, folder));
    train_ranks(
        4, [&](int) { return gpu_tiny(base + "/four", method, "sharded", 4, steps, folder); }, {},
        on_gpu);
    expect_bf16_close(base + "/one", base + "/four", method, size_t(steps));
  }
}

// The frozen bf16 lm_head read in slices of 300 of its 1000 vocabulary rows (RIG_HEAD_SLICE_BYTES,
// as the 70B run's 2 GiB head is in 256 MiB slices). Four ranks with the head whole end as one
// rank does to 1e-7 (the same products); with slices, the logits' products have other shapes, so
// cuBLAS sums their 64 terms in another order and some bf16 logits round one unit apart. That moves
// the losses by ~5e-5 and the first step's gradient norm by ~7e-5 (relative), but Adam's first
// steps are lr * sign(gradient) for every element, so LoRA elements whose gradient is near zero
// flip: measured on an H100 (2026-12-07), weights 4.7e-3 (QLoRA) and 5.4e-3 (LoRA) relative L2
// after 6 steps, 1.25e-2 (1.25 lr) at most. The algorithm itself is held to float32 below.
TEST(SharedGpu, HeadInSlicesOnFourRanksMatchesOneRank) {
  REQUIRE_GPU();
  const int64_t steps = 6;
  auto grad_norms = [](const std::string& run) {
    std::vector<double> out;
    for (const auto& row : read_metrics(run + "/metrics.jsonl").rows)
      if (row.contains("grad_norm")) out.push_back(row["grad_norm"]);
    return out;
  };
  for (const std::string method : {"qlora", "lora"}) {
    const std::string base = test::temp_dir("gpu_head_slices_" + method);
    train_one(gpu_tiny(base + "/one", method, "sharded", 1, steps));
    setenv("RIG_HEAD_SLICE_BYTES", "38400", 1);
    train_ranks(
        4, [&](int) { return gpu_tiny(base + "/four", method, "sharded", 4, steps); }, {}, on_gpu);
    unsetenv("RIG_HEAD_SLICE_BYTES");
    const auto a = losses(base + "/one"), b = losses(base + "/four");
    ASSERT_EQ(a.size(), size_t(steps));
    ASSERT_EQ(b.size(), size_t(steps));
    for (size_t k = 0; k < a.size(); ++k)
      EXPECT_LT(std::abs(b[k] - a[k]) / a[k], 2e-4) << method << " step " << k + 1;
    const auto ga = grad_norms(base + "/one"), gb = grad_norms(base + "/four");
    ASSERT_FALSE(ga.empty());
    ASSERT_FALSE(gb.empty());
    const double g1 = std::abs(gb[0] - ga[0]) / ga[0];
    std::printf("%s: step 1 gradient norm %.6g vs %.6g (%.2e relative)\n", method.c_str(), gb[0],
                ga[0], g1);
    EXPECT_LT(g1, 5e-4) << method;
    auto fa = SafeTensorsFile::open(final_file(base + "/one", method)),
         fb = SafeTensorsFile::open(final_file(base + "/four", method));
    double num = 0, den = 0;
    for (const auto& t : fa.tensors()) {
      Tensor x = fa.get_f32(t.name), y = fb.get_f32(t.name);
      for (int64_t e = 0; e < x.numel(); ++e) {
        num += std::pow(double(y.f32()[e]) - x.f32()[e], 2);
        den += std::pow(double(x.f32()[e]), 2);
      }
    }
    std::printf("%s: weights %.2e relative L2\n", method.c_str(), std::sqrt(num / den));
    EXPECT_LT(std::sqrt(num / den), 2e-2) << method;
  }
}

// The same in float32 on the GPU (the CPU test's arithmetic, the CUDA kernels): four ranks end as
// one rank within float32 reduction order.
TEST(SharedGpu, Fp32HeadInSlicesOnFourRanksMatchesOneRank) {
  REQUIRE_GPU();
  const int64_t steps = 4;
  const std::vector<std::string> fp32 = {"device=cuda", "precision=fp32"};
  const std::string base = test::temp_dir("gpu_head_slices_fp32");
  train_one(tiny(base + "/one", "lora", "sharded", 1, steps, 2, 8, fp32));
  setenv("RIG_HEAD_SLICE_BYTES", "76800", 1);
  train_ranks(
      4, [&](int) { return tiny(base + "/four", "lora", "sharded", 4, steps, 2, 8, fp32); }, {},
      on_gpu);
  unsetenv("RIG_HEAD_SLICE_BYTES");
  expect_close_runs(base + "/one", base + "/four", "lora", size_t(steps), abs_tolerance("lora"));
}

// A sharded bf16 QLoRA run stopped on 4 ranks resumes on 2, then finishes on one process; it ends
// where the uninterrupted one-rank run ends, within bf16's tolerance.
TEST(SharedGpu, ShardedBf16QloraResumesFourThenTwoThenOneRank) {
  REQUIRE_GPU();
  const std::string base = test::temp_dir("gpu_shared_reshard");
  const int64_t steps = 6;
  train_one(gpu_tiny(base + "/ref", "qlora", "sharded", 1, steps));
  const std::string run = base + "/run";
  reshard_run(
      run, steps, 4, 2, [&](int world) { return gpu_tiny(run, "qlora", "sharded", world, steps); },
      [](const std::string& dir) {
        // bf16 frozen matrices (the embedding, lm_head) travel as bytes; never saved.
        const nlohmann::json layout = load_checkpoint(dir).state["sharded"];
        bool bytes_unit = false;
        for (const auto& u : layout["units"])
          if (u.value("bytes", false) && u["name"] == "outer.frozen") bytes_unit = true;
        EXPECT_TRUE(bytes_unit) << layout.dump();
      },
      on_gpu);
  expect_bf16_close(base + "/ref", run, "qlora", size_t(steps));
}
