// Several ranks sharing one GPU (threads here, each with its own Gloo communicator staged outside
// NCCL: sockets, shared host memory or device buffers): the collectives against closed forms, and
// data-parallel and sharded bf16 training (LoRA, QLoRA, full) against the one-rank GPU run,
// resumed on 4 -> 2 -> 1 ranks.
// Skipped with the reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
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

// Ranks sharing a GPU through CUDA IPC hold a staging buffer outside the allocator; max_memory
// counts it, so a cap no larger than that buffer is refused before any model is placed (else
// the budget left for the allocator would wrap around and lift the cap).
TEST(SharedGpu, MaxMemoryNoLargerThanTheIpcStagingBufferIsRefused) {
  REQUIRE_GPU();
  const std::string run = test::temp_dir("gpu_shared_tiny_cap") + "/run";
  try {
    train_ranks(
        2, [&](int) { return gpu_tiny(run, "qlora", "ddp", 2, 4, {"max_memory=16MiB"}); }, {},
        on_gpu);
    ADD_FAILURE() << "a 16 MiB cap beside the 32 MiB staging buffer was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("leaves nothing beside the 33554432 bytes of collective"),
              std::string::npos)
        << e.what();
  }
}
