// Helpers of the parallel_*_test.cpp files: tiny runs on several ranks and how two runs compare.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "rig/dist/communicator.h"
#include "rig/dist/store.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "rig/train/trainer.h"
#include "test_util.h"

namespace rig::test::parallel {

inline const std::string kSrc = source_dir();

// The tiny pretrained llama3 fixture; `rows` rows per step in all, split as micro x accum x world.
// `more` overrides go last.
inline TrainConfig tiny(const std::string& out, const std::string& method,
                        const std::string& strategy, int world, int64_t steps, int64_t accum = 2,
                        int64_t rows = 8, const std::vector<std::string>& more = {}) {
  std::vector<std::string> set = {"model=" + kSrc + "/tests/data/hf/tiny-llama3/model",
                                  "tokenizer=" + kSrc + "/data/demo/tokenizer.json",
                                  "datasets.0.path=" + small_data(),
                                  "output_dir=" + out,
                                  "method=" + method,
                                  "strategy=" + strategy,
                                  "max_steps=" + std::to_string(steps),
                                  "gradient_accumulation_steps=" + std::to_string(accum),
                                  "micro_batch_size=" + std::to_string(rows / accum / world),
                                  "packing=false",
                                  "eval.split=0",
                                  "save.every=0",
                                  "save.keep_last=0",
                                  "dist.timeout_s=30",
                                  "optimizer.lr=1e-2"};
  set.insert(set.end(), more.begin(), more.end());
  return load_train_config(kSrc + "/tests/data/configs/tiny-llama3-lora.yaml", set);
}

inline std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  for (const auto& row : read_metrics(run + "/metrics.jsonl").rows)
    if (row.contains("loss") && !row.contains("eval_loss")) out.push_back(row["loss"]);
  return out;
}

// Rank r's Gloo communicator through the store server at `port` (30 s timeouts).
inline std::unique_ptr<dist::Communicator> gloo_rank(int port, int r, int world) {
  auto store = std::make_shared<dist::Store>("127.0.0.1", port, r, dist::Millis(30000));
  dist::CommOptions o;
  o.timeout = std::chrono::seconds(30);
  return dist::make_gloo(store, r, world, o);
}

// Runs train() on `world` ranks as threads, each with its own Gloo communicator (wrapped by
// `wrap` when given). Rethrows the first rank's error.
using Wrap =
    std::function<std::unique_ptr<dist::Communicator>(std::unique_ptr<dist::Communicator>)>;
inline std::vector<TrainResult> train_ranks(int world, const std::function<TrainConfig(int)>& cfg,
                                            const std::function<TrainHooks(int)>& hooks = {},
                                            const Wrap& wrap = {}) {
  using namespace std::chrono_literals;
  dist::StoreServer server(0);
  std::vector<std::thread> ts;
  std::vector<TrainResult> results(static_cast<size_t>(world));
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      try {
        std::unique_ptr<dist::Communicator> comm = gloo_rank(server.port(), r, world);
        if (wrap) comm = wrap(std::move(comm));
        TrainHooks h = hooks ? hooks(r) : TrainHooks{};
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

inline TrainResult train_one(const TrainConfig& c, const std::function<bool()>& stop = {}) {
  TrainHooks h;
  h.quiet = true;
  h.should_stop = stop;
  return train(c, h);
}

// Hooks that stop every rank after n optimizer steps (each stop saves a checkpoint first).
inline std::function<TrainHooks(int)> stop_after(int n) {
  return [n](int) {
    TrainHooks h;
    auto polls = std::make_shared<int>(0);
    h.should_stop = [polls, n] { return ++*polls > n; };
    return h;
  };
}

// A run resharded twice: `first` ranks stop after 2 steps, `second` ranks continue to step 4, one
// process finishes all `steps`. cfg(world) is the run's config on that many ranks; `check` looks
// at the first checkpoint.
inline void reshard_run(const std::string& run, int64_t steps, int first, int second,
                        const std::function<TrainConfig(int world)>& cfg,
                        const std::function<void(const std::string& ck_dir)>& check = {},
                        const Wrap& wrap = {}) {
  auto shard_file = [](const std::string& dir, int world) {
    return fmt::format("{}/shard-{}-of-{}.safetensors", dir, world - 1, world);
  };
  auto rs = train_ranks(
      first, [&](int) { return cfg(first); }, stop_after(2), wrap);
  EXPECT_TRUE(rs[0].interrupted);
  auto ck = latest_checkpoint(run);
  ASSERT_TRUE(ck);
  EXPECT_EQ(ck->step, 2);
  EXPECT_TRUE(std::filesystem::exists(shard_file(ck->dir, first)));
  EXPECT_TRUE(verify_checkpoint(ck->dir).ok()) << verify_checkpoint(ck->dir).to_text();
  if (check) check(ck->dir);
  train_ranks(
      second, [&](int) { return cfg(second); }, stop_after(2), wrap);
  EXPECT_EQ(latest_checkpoint(run)->step, 4);
  EXPECT_TRUE(std::filesystem::exists(shard_file(latest_checkpoint(run)->dir, second)));
  EXPECT_EQ(train_one(cfg(1)).steps, steps);
}

inline std::string final_file(const std::string& run, const std::string& method) {
  return run + (method == "full" ? "/final/model.safetensors" : "/final/adapter_model.safetensors");
}

// Float32 reduction order differs between world sizes; nothing else may.
inline void expect_close_runs(const std::string& ref, const std::string& got,
                              const std::string& method, size_t steps, double abs_tol = 1e-6) {
  auto a = losses(ref), b = losses(got);
  ASSERT_EQ(a.size(), steps) << ref;
  ASSERT_EQ(b.size(), steps) << got;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "step " << i + 1;
  auto fa = SafeTensorsFile::open(final_file(ref, method)),
       fb = SafeTensorsFile::open(final_file(got, method));
  ASSERT_EQ(fa.tensors().size(), fb.tensors().size());
  // Weights: 1e-5 relative, plus 1e-6 absolute (1e-4 of one step at lr 1e-2) for the values
  // near zero, where Adam's normalised update carries the gradients' rounding differences.
  double worst = 0;
  std::string where;
  for (const auto& t : fa.tensors()) {
    Tensor x = fa.get_f32(t.name), y = fb.get_f32(t.name);
    ASSERT_EQ(x.numel(), y.numel()) << t.name;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double a = x.f32()[i],
                   d = std::abs(a - double(y.f32()[i])) / (abs_tol + 1e-5 * std::abs(a));
      if (d > worst) {
        worst = d;
        where = fmt::format("{}[{}]: {} vs {}", t.name, i, x.f32()[i], y.f32()[i]);
      }
    }
  }
  EXPECT_LE(worst, 1.0) << where;
}

// The guard on 2 sharded ranks (replica checks and saves every 2 steps): a NaN gradient at step 3
// is skipped with no rollback, and the fault `flip` rolls back once and the run ends as the clean
// one. cfg(dir, overrides) is the run's config. Returns the flipped run's log.
inline std::string expect_guard_recovers(
    const std::string& base, int64_t steps, const std::string& method, const std::string& flip,
    const std::function<TrainConfig(const std::string&, std::vector<std::string>)>& cfg) {
  auto with = [](std::vector<std::string> more) {
    more.insert(more.end(), {"guard.replica_check_every=2", "save.every=2"});
    return more;
  };
  train_ranks(2, [&](int) { return cfg(base + "/ref", with({})); });
  auto nan = train_ranks(2, [&](int) { return cfg(base + "/nan", with({"inject=[nan-grad@3]"})); });
  EXPECT_EQ(nan[0].skipped_steps, 1);
  EXPECT_EQ(nan[0].rollbacks, 0) << read_file(base + "/nan/train.log");
  auto flipped = train_ranks(2, [&](int) { return cfg(base + "/flip", with({flip})); });
  const std::string log = read_file(base + "/flip/train.log");
  EXPECT_EQ(flipped[0].rollbacks, 1) << log;
  expect_close_runs(base + "/ref", base + "/flip", method, size_t(steps), 0);
  return log;
}

// The absolute part of expect_close_runs' tolerance. QLoRA: one LoRA A element of the tiny run
// (down_proj, layer 1) moves 1.4e-6 with the reduction order, under ddp as under sharded (which
// agree with each other within 0.25 of the LoRA tolerance), so 2e-6.
inline double abs_tolerance(const std::string& method) {
  return method == "qlora" ? 2e-6 : 1e-6;
}

}  // namespace rig::test::parallel
