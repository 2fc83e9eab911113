// Training on several ranks (CPU, Gloo over 127.0.0.1): data-parallel and sharded runs on 2 and
// 4 ranks against the 1-rank run with the same global batch, sharded checkpoints resumed on other
// world sizes, no communication on accumulation micro-steps, and `rig train --nproc-per-node`
// end to end, including a killed worker.
#include "rig/train/parallel.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "rig/dist/communicator.h"
#include "rig/dist/store.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/train/checkpoint.h"
#include "rig/train/metrics.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

const std::string kSrc = RIG_SOURCE_DIR;

// The first 400 samples of the demo task: enough for a few steps, quick to tokenize.
std::string small_data() {
  static const std::string path = [] {
    std::string dir = test::temp_dir("parallel_data");
    std::ifstream in(kSrc + "/data/demo/reverse.jsonl");
    std::ofstream out(dir + "/reverse400.jsonl");
    std::string line;
    for (int i = 0; i < 400 && std::getline(in, line); ++i) out << line << "\n";
    return dir + "/reverse400.jsonl";
  }();
  return path;
}

// The tiny pretrained llama3 fixture; `rows` rows per step in all, split as micro x accum x world.
// `more` overrides go last.
TrainConfig tiny(const std::string& out, const std::string& method, const std::string& strategy,
                 int world, int64_t steps, int64_t accum = 2, int64_t rows = 8,
                 const std::vector<std::string>& more = {}) {
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

std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  for (const auto& row : read_metrics(run + "/metrics.jsonl").rows)
    if (row.contains("loss") && !row.contains("eval_loss")) out.push_back(row["loss"]);
  return out;
}

// Runs train() on `world` ranks as threads, each with its own Gloo communicator (wrapped by
// `wrap` when given). Rethrows the first rank's error.
using Wrap =
    std::function<std::unique_ptr<dist::Communicator>(std::unique_ptr<dist::Communicator>)>;
std::vector<TrainResult> train_ranks(int world, const std::function<TrainConfig(int)>& cfg,
                                     const std::function<TrainHooks(int)>& hooks = {},
                                     const Wrap& wrap = {}) {
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
        std::unique_ptr<dist::Communicator> comm = dist::make_gloo(store, r, world, o);
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

TrainResult train_one(const TrainConfig& c, const std::function<bool()>& stop = {}) {
  TrainHooks h;
  h.quiet = true;
  h.should_stop = stop;
  return train(c, h);
}

// Hooks that stop every rank after n optimizer steps (each stop saves a checkpoint first).
std::function<TrainHooks(int)> stop_after(int n) {
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
void reshard_run(const std::string& run, int64_t steps, int first, int second,
                 const std::function<TrainConfig(int world)>& cfg,
                 const std::function<void(const std::string& ck_dir)>& check = {}) {
  auto shard_file = [](const std::string& dir, int world) {
    return fmt::format("{}/shard-{}-of-{}.safetensors", dir, world - 1, world);
  };
  auto rs = train_ranks(first, [&](int) { return cfg(first); }, stop_after(2));
  EXPECT_TRUE(rs[0].interrupted);
  auto ck = latest_checkpoint(run);
  ASSERT_TRUE(ck);
  EXPECT_EQ(ck->step, 2);
  EXPECT_TRUE(fs::exists(shard_file(ck->dir, first)));
  EXPECT_TRUE(verify_checkpoint(ck->dir).ok()) << verify_checkpoint(ck->dir).to_text();
  if (check) check(ck->dir);
  train_ranks(second, [&](int) { return cfg(second); }, stop_after(2));
  EXPECT_EQ(latest_checkpoint(run)->step, 4);
  EXPECT_TRUE(fs::exists(shard_file(latest_checkpoint(run)->dir, second)));
  EXPECT_EQ(train_one(cfg(1)).steps, steps);
}

std::string final_file(const std::string& run, const std::string& method) {
  return run + (method == "full" ? "/final/model.safetensors" : "/final/adapter_model.safetensors");
}

// Float32 reduction order differs between world sizes; nothing else may.
void expect_close_runs(const std::string& ref, const std::string& got, const std::string& method,
                       size_t steps, double abs_tol = 1e-6) {
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
std::string expect_guard_recovers(
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
double abs_tolerance(const std::string& method) {
  return method == "qlora" ? 2e-6 : 1e-6;
}

}  // namespace

// ---- equivalence with one rank ------------------------------------------------------------------

class ParallelEquivalence : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
};

TEST_P(ParallelEquivalence, TwoAndFourRanksMatchOneRank) {
  const auto [strategy, method] = GetParam();
  const std::string base = test::temp_dir("par_" + strategy + "_" + method);
  const int64_t steps = 4;
  train_one(tiny(base + "/w1", method, strategy, 1, steps));
  for (int world : {2, 4}) {
    const std::string out = base + fmt::format("/w{}", world);
    train_ranks(world, [&](int) { return tiny(out, method, strategy, world, steps); });
    expect_close_runs(base + "/w1", out, method, size_t(steps), abs_tolerance(method));
    EXPECT_FALSE(fs::exists(out + "/final/rank1")) << "only rank 0 writes";
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, ParallelEquivalence,
                         ::testing::Combine(::testing::Values("ddp", "sharded"),
                                            ::testing::Values("lora", "full")),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param);
                         });

// QLoRA: the NF4 base (quantized while loading the float32 fixture) is frozen; its packed bytes
// and quantization state are sharded and gathered per layer, the adapters trained as with LoRA.
INSTANTIATE_TEST_SUITE_P(Qlora, ParallelEquivalence,
                         ::testing::Combine(::testing::Values("ddp", "sharded"),
                                            ::testing::Values("qlora")),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param);
                         });

TEST(Parallel, ShardedQloraRankHoldsItsPartOfThe4BitBytesAndGathersThemExactly) {
  const std::string dir = kSrc + "/tests/data/hf/tiny-llama3/model";
  LoadOptions lo;
  lo.quantize = true;
  // Every stored tensor of every 4-bit weight (transformers' keys), as the unsharded model has it.
  auto stored = [](const LlamaModel& m) {
    std::map<std::string, std::string> out;
    for (const auto& p : m.params())
      if (p.quant && p.quant->packed.defined())
        for (const auto& [key, t] : quant::state_dict(p.name, *p.quant))
          out[key] = std::string(static_cast<const char*>(t.raw()), t.nbytes());
    return out;
  };
  auto ref_model = LlamaModel::load(dir, lo);
  const auto ref = stored(*ref_model);
  const size_t total = ref_model->quantized_bytes();
  ASSERT_GT(total, 0u);
  for (int world : {2, 4}) {
    dist::StoreServer server(0);
    std::vector<std::thread> ts;
    std::vector<std::string> errors(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r)
      ts.emplace_back([&, r] {
        try {
          auto store =
              std::make_shared<dist::Store>("127.0.0.1", server.port(), r, dist::Millis(30000));
          dist::CommOptions o;
          o.timeout = 30s;
          auto comm = dist::make_gloo(store, r, world, o);
          auto m = LlamaModel::load(dir, lo);
          m->add_lora(LoraConfig{}, 1);
          Sharded sh(*comm, *m);
          auto check = [&](bool ok, const std::string& what) {
            if (!ok && errors[size_t(r)].empty()) errors[size_t(r)] = what;
          };
          // At rest a rank holds its shards of the 4-bit units and nothing of the full weights.
          check(m->quantized_bytes() == 0, "4-bit tensors kept after sharding");
          size_t held = 0;
          auto shards = sh.frozen_shards();
          size_t k = 0;
          for (const auto& u : sh.units()) {
            if (u.trainable) continue;
            if (u.four_bit) {
              held += shards[k].nbytes();
              // Bytes, not floats: the guard's scan for implausible weights must skip them.
              check(shards[k].dtype() == DType::U8, u.name + " shard is not U8");
            }
            ++k;
          }
          check(
              held >= total / size_t(world) && held <= total / size_t(world) + total / 20,
              fmt::format("rank holds {} bytes of {} 4-bit bytes on {} ranks", held, total, world));
          // In a layer's hooks only that layer's weights are whole, byte for byte.
          sh.before(-1, StepHooks::Forward);
          sh.before(0, StepHooks::Forward);
          size_t layer0 = 0;
          for (const auto& p : m->params())
            if (p.quant && p.name.rfind("model.layers.0.", 0) == 0) layer0 += p.quant->nbytes();
          check(layer0 > 0 && m->quantized_bytes() == layer0,
                fmt::format("{} bytes of 4-bit weights gathered in layer 0's hooks, layer 0 "
                            "has {}",
                            m->quantized_bytes(), layer0));
          sh.after(0, StepHooks::Forward);
          sh.before(1, StepHooks::Forward);
          sh.after(1, StepHooks::Forward);
          sh.after(-1, StepHooks::Forward);
          check(m->quantized_bytes() == 0, "4-bit tensors kept after their layer");
          sh.gather_all();
          check(stored(*m) == ref, "gathered 4-bit tensors differ from the unsharded model's");
          sh.release_all();
          check(m->quantized_bytes() == 0, "4-bit tensors kept after release_all");
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < world; ++r) EXPECT_EQ(errors[size_t(r)], "") << "world " << world;
  }
}

TEST(Parallel, ShardedQloraCheckpointResumesOnOtherWorldSizes) {
  const std::string base = test::temp_dir("par_reshard_qlora");
  const int64_t steps = 6;
  train_one(tiny(base + "/ref", "qlora", "sharded", 1, steps));
  // 2 ranks stop after 2 steps, 4 ranks continue to 4, one process finishes.
  const std::string run = base + "/run";
  reshard_run(
      run, steps, 2, 4, [&](int world) { return tiny(run, "qlora", "sharded", world, steps); },
      [](const std::string& dir) {
        // The shards hold the adapters and their optimizer state, never the 4-bit base (it is
        // rebuilt from the model folder); the layout names the 4-bit units.
        auto f = SafeTensorsFile::open(dir + "/shard-1-of-2.safetensors");
        for (const auto& t : f.tensors())
          EXPECT_EQ(t.name.find("frozen"), std::string::npos) << t.name;
        bool four_bit_unit = false;
        const nlohmann::json layout = load_checkpoint(dir).state["sharded"];
        for (const auto& u : layout["units"])
          if (u.value("four_bit", false) && u["name"] == "layer.1.frozen_4bit") four_bit_unit = true;
        EXPECT_TRUE(four_bit_unit);
      });
  expect_close_runs(base + "/ref", run, "qlora", size_t(steps), abs_tolerance("qlora"));
}

TEST(Parallel, ShardedQloraGuardSkipsANanStepAndReloadsFlippedFrozenShards) {
  // The guard reads the 4-bit shards as bytes: a NaN step is blamed on the batch (skipped), not
  // on 4-bit codes that look like implausible floats; a flipped frozen shard is reloaded from the
  // model folder, 4-bit units included, and the run ends as a clean one.
  const std::string base = test::temp_dir("par_qlora_guard");
  const int64_t steps = 6;
  const std::string log =
      expect_guard_recovers(base, steps, "qlora", "inject=[bit-flip-frozen@3]",
                            [&](const std::string& dir, std::vector<std::string> more) {
                              return tiny(dir, "qlora", "sharded", 2, steps, 2, 8, more);
                            });
  // The flip hit the 4-bit bytes, the bulk of what QLoRA keeps frozen.
  EXPECT_NE(log.find("a byte of frozen 4-bit weights"), std::string::npos);
}

TEST(Parallel, ShardedWithActivationCheckpointingMatchesOneRank) {
  // The backward pass recomputes each layer's forward inside the layer's backward hooks.
  const std::string base = test::temp_dir("par_actckpt");
  train_one(tiny(base + "/w1", "full", "sharded", 1, 3));
  train_ranks(2, [&](int) {
    TrainConfig c = tiny(base + "/w2", "full", "sharded", 2, 3);
    c.activation_checkpointing = "full";
    return c;
  });
  expect_close_runs(base + "/w1", base + "/w2", "full", 3);
}

// ---- 8-bit AdamW, sharded -----------------------------------------------------------------------

namespace {

// A deterministic gradient for a tensor and a step (the same on every rank and world size).
Tensor test_grad(const std::string& name, int64_t n, int step) {
  Tensor g = Tensor::empty({n}, DType::F32, Device::cpu(), "grad");
  uint64_t h = std::hash<std::string>{}(name) ^ (uint64_t(step) * 0x9E3779B97F4A7C15ull);
  for (int64_t i = 0; i < n; ++i) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    // Spread over several decades, so the blocks' absmax and the dynamic codes both matter.
    const double u = double(h >> 11) / double(1ull << 53);
    g.f32()[i] = float((u - 0.5) * std::pow(10.0, -3.0 + 3.0 * double((h >> 3) % 1000) / 1000.0));
  }
  return g;
}

// The largest differences between two runs: losses (relative) and final weights (absolute).
struct RunDiff {
  double loss_rel = 0, weight_abs = 0;
  int64_t moved = 0, total = 0;  // weights more than 1e-5 apart, of all
  std::string where;
};
RunDiff diff_runs(const std::string& ref, const std::string& got, const std::string& method,
                  size_t steps) {
  RunDiff d;
  auto a = losses(ref), b = losses(got);
  EXPECT_EQ(a.size(), steps) << ref;
  EXPECT_EQ(b.size(), steps) << got;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d.loss_rel = std::max(d.loss_rel, std::abs(a[i] - b[i]) / std::abs(a[i]));
  auto fa = SafeTensorsFile::open(final_file(ref, method)),
       fb = SafeTensorsFile::open(final_file(got, method));
  for (const auto& t : fa.tensors()) {
    Tensor x = fa.get_f32(t.name), y = fb.get_f32(t.name);
    EXPECT_EQ(x.numel(), y.numel()) << t.name;
    for (int64_t i = 0; i < std::min(x.numel(), y.numel()); ++i) {
      const double e = std::abs(double(x.f32()[i]) - double(y.f32()[i]));
      d.moved += e > 1e-5;
      ++d.total;
      if (e > d.weight_abs) {
        d.weight_abs = e;
        d.where = fmt::format("{}[{}]: {} vs {}", t.name, i, x.f32()[i], y.f32()[i]);
      }
    }
  }
  return d;
}

// 8-bit runs of the tiny fixture. Full: min_8bit_size 4096, so q, o, the MLP and the embeddings
// are 8-bit and k, v (2048) and the norms float32, in the same units. LoRA: every adapter 8-bit
// (min_8bit_size 0), most of them one partial block.
TrainConfig tiny8(const std::string& out, const std::string& method, int world, int64_t steps,
                  std::vector<std::string> more = {}) {
  more.push_back("optimizer.name=adamw8bit");
  if (method == "lora") more.push_back("optimizer.min_8bit_size=0");
  return tiny(out, method, "sharded", world, steps, 2, 8, more);
}

// One rank's gradients and N ranks' differ in float32 reduction order; a moment that sits near
// the middle between two 8-bit codes then rounds to the other one, and that element's later
// updates differ by up to the code's relative gap (a few %) of a step (lr 1e-2). data-parallel
// 8-bit runs show the same (measured with the same tiny runs: 2 ranks identical to sharded's,
// 4 ranks 4e-4 and 19 elements). So: the losses as for float32, and at most 2 weights in 1000
// moved (2 -> 4 -> 1 ranks: 159 of 214336), each by at most a quarter of a step.
void expect_close_8bit(const RunDiff& d, const std::string& what) {
  EXPECT_LE(d.loss_rel, 1e-5) << what;
  EXPECT_LE(d.weight_abs, 2.5e-3) << what << ": " << d.where;
  EXPECT_LE(d.moved * 500, d.total) << what << ": " << d.moved << " weights moved";
}

}  // namespace

TEST(Parallel, Sharded8BitAdamWStepsEqualOneRankBitForBit) {
  // Every tensor starts a block in the flat units and shards hold whole blocks, so the ranks'
  // steps on the same gradients give the 1-rank weights bit for bit, and a rank holds 1/world of
  // the 8-bit state (plus under a block per tensor).
  const std::string dir = kSrc + "/tests/data/hf/tiny-llama3/model";
  OptimizerConfig oc;
  oc.lr = 1e-2f;
  oc.weight_decay = 0.1f;
  oc.max_grad_norm = 0;
  oc.eight_bit = true;
  const int steps = 3;
  for (int64_t min8 : {int64_t(4096), int64_t(0)}) {
    oc.min_8bit_size = min8;
    auto ref = LlamaModel::load(dir);
    ref->zero_grad();
    AdamW one(oc);
    for (int s = 1; s <= steps; ++s) {
      for (auto& p : ref->params())
        p.grad.copy_from(test_grad(p.name, p.value.numel(), s).reshape(p.value.shape()));
      one.clip_and_step(ref->params(), oc.lr, 0.0);
    }
    std::map<std::string, Tensor> want;
    for (const auto& p : ref->params()) want[p.name] = p.value;
    const size_t one_bytes = one.state_bytes();
    for (int world : {2, 4}) {
      dist::StoreServer server(0);
      std::vector<std::thread> ts;
      std::vector<std::string> errors(static_cast<size_t>(world));
      std::vector<size_t> held(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r)
        ts.emplace_back([&, r] {
          try {
            auto store =
                std::make_shared<dist::Store>("127.0.0.1", server.port(), r, dist::Millis(30000));
            dist::CommOptions o;
            o.timeout = 30s;
            auto comm = dist::make_gloo(store, r, world, o);
            auto m = LlamaModel::load(dir);
            AdamW opt(oc);
            Sharded sh(*comm, *m, &opt);
            for (int s = 1; s <= steps; ++s) {
              size_t k = 0;
              for (const auto& u : sh.units()) {
                if (!u.trainable) continue;
                EXPECT_EQ(u.align, 256) << u.name;
                const dist::FlatShard fs = u.shard_of(world);
                const auto offs = u.offsets();
                const int64_t b = fs.begin(r), e = b + fs.valid(r);
                Tensor g = Tensor::zeros({fs.shard}, DType::F32, Device::cpu(), "grad");
                for (size_t j = 0; j < u.params.size(); ++j) {
                  const int64_t n = u.params[j].second, lo = std::max(b, offs[j]),
                                hi = std::min(e, offs[j] + n);
                  if (lo < hi)
                    g.slice_rows(lo - b, hi - b)
                        .copy_from(test_grad(u.params[j].first, n, s)
                                       .slice_rows(lo - offs[j], hi - offs[j]));
                }
                sh.params()[k++].grad.copy_from(g);
              }
              opt.clip_and_step(sh.params(), oc.lr, 0.0);
            }
            held[size_t(r)] = opt.state_bytes();
            sh.gather_all();
            for (const auto& p : m->params()) {
              const Tensor& w = want.at(p.name);
              if (p.value.numel() != w.numel() ||
                  std::memcmp(p.value.raw(), w.raw(), w.nbytes()) != 0)
                throw std::runtime_error(p.name + " differs from the 1-rank step");
            }
          } catch (const std::exception& e) {
            errors[size_t(r)] = e.what();
          }
        });
      for (auto& t : ts) t.join();
      size_t total = 0;
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(errors[size_t(r)], "") << "world " << world << ", min_8bit_size " << min8;
        total += held[size_t(r)];
        // Shards are even in elements; with float32-moment tensors (8 bytes an element against
        // 2) among the 8-bit ones, the ranks that hold k and v hold more bytes.
        EXPECT_LE(double(held[size_t(r)]), (min8 == 0 ? 1.05 : 1.35) * double(one_bytes) / world)
            << "rank " << r << " of " << world << " holds " << held[size_t(r)] << " bytes of "
            << one_bytes;
      }
      EXPECT_GE(total, one_bytes);
      std::printf(
          "[ 8-bit  ] min_8bit_size %lld, %d ranks: state %zu bytes on one rank, %zu..%zu "
          "per rank\n",
          (long long)min8, world, one_bytes, *std::min_element(held.begin(), held.end()),
          *std::max_element(held.begin(), held.end()));
    }
  }
}

TEST(Parallel, Sharded8BitAdamWTwoAndFourRanksMatchOneRank) {
  const std::string base = test::temp_dir("par_8bit");
  const int64_t steps = 4;
  for (const std::string method : {"full", "lora"}) {
    train_one(tiny8(base + "/" + method + "1", method, 1, steps));
    for (int world : {2, 4}) {
      const std::string out = base + fmt::format("/{}{}", method, world);
      train_ranks(world, [&](int) { return tiny8(out, method, world, steps); });
      const RunDiff d = diff_runs(base + "/" + method + "1", out, method, size_t(steps));
      std::printf(
          "[ 8-bit  ] %s, %d ranks: losses within %.3g (relative), weights within %.3g "
          "(%lld of %lld beyond 1e-5): %s\n",
          method.c_str(), world, d.loss_rel, d.weight_abs, (long long)d.moved, (long long)d.total,
          d.where.c_str());
      expect_close_8bit(d, fmt::format("{} on {} ranks", method, world));
    }
  }
}

TEST(Parallel, Sharded8BitCheckpointResumesOnOtherWorldSizes) {
  const std::string base = test::temp_dir("par_8bit_reshard");
  const int64_t steps = 6;
  train_one(tiny8(base + "/ref", "full", 1, steps));
  // 2 ranks stop after 2 steps, 4 ranks continue to 4, one process finishes.
  const std::string run = base + "/run";
  reshard_run(
      run, steps, 2, 4, [&](int world) { return tiny8(run, "full", world, steps); },
      [](const std::string& dir) {
        auto f = SafeTensorsFile::open(dir + "/shard-0-of-2.safetensors");
        EXPECT_TRUE(f.has("adamw8bit.mq.layer.0.decay"));
        EXPECT_TRUE(f.has("adamw.m.layer.0.decay")) << "k_proj and v_proj keep float32 moments";
        EXPECT_EQ(load_checkpoint(dir).state["sharded"]["units"][0].value("align", 0), 256);
      });
  RunDiff d = diff_runs(base + "/ref", run, "full", size_t(steps));
  std::printf(
      "[ 8-bit  ] resumed 2 -> 4 -> 1 ranks: losses within %.3g, weights within %.3g (%lld "
      "of %lld beyond 1e-5)\n",
      d.loss_rel, d.weight_abs, (long long)d.moved, (long long)d.total);
  expect_close_8bit(d, "2 -> 4 -> 1 ranks");

  // A one-process checkpoint (named per-tensor 8-bit state) resumed sharded on 2 ranks.
  const std::string run2 = base + "/run2";
  int polls = 0;
  train_one(tiny8(run2, "lora", 1, steps), [&] { return ++polls > 3; });
  train_ranks(2, [&](int) { return tiny8(run2, "lora", 2, steps); });
  train_one(tiny8(base + "/ref_lora", "lora", 1, steps));
  d = diff_runs(base + "/ref_lora", run2, "lora", size_t(steps));
  std::printf(
      "[ 8-bit  ] resumed 1 -> 2 ranks (LoRA): losses within %.3g, weights within %.3g (%lld "
      "of %lld beyond 1e-5)\n",
      d.loss_rel, d.weight_abs, (long long)d.moved, (long long)d.total);
  expect_close_8bit(d, "1 -> 2 ranks");
}

TEST(Parallel, Sharded8BitGuardSkipsANanStepAndRollsBackAFlippedShard) {
  // The skip leaves the 8-bit state alone; the rollback reloads it from the 2-rank checkpoint,
  // and the run ends as the clean one.
  const std::string base = test::temp_dir("par_8bit_guard");
  const int64_t steps = 6;
  expect_guard_recovers(base, steps, "full", "inject=[bit-flip@4:1]",
                        [&](const std::string& dir, std::vector<std::string> more) {
                          return tiny8(dir, "full", 2, steps, std::move(more));
                        });
}

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
  train_ranks(2, [&](int) { return tiny(base + "/run", "lora", "ddp", 2, steps); }, [](int) {
    TrainHooks h;
    auto polls = std::make_shared<int>(0);
    h.should_stop = [polls] { return ++*polls > 2; };
    return h;
  });
  EXPECT_EQ(latest_checkpoint(base + "/run")->step, 2);
  train_one(tiny(base + "/run", "lora", "ddp", 1, steps));
  expect_close_runs(base + "/ref", base + "/run", "lora", size_t(steps));

  // Packed rows: the ranks' data positions differ, so another world size cannot re-split them.
  TrainConfig packed = tiny(base + "/packed", "lora", "ddp", 2, steps);
  packed.packing = true;
  packed.sequence_len = 512;  // several samples per row, a different number on each rank
  train_ranks(2, [&](int) { return packed; }, [](int) {
    TrainHooks h;
    auto polls = std::make_shared<int>(0);
    h.should_stop = [polls] { return ++*polls > 1; };
    return h;
  });
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
      2, [&](int) { return tiny(run, "full", "sharded", 2, 3); },
      [](int) {
        TrainHooks h;
        auto polls = std::make_shared<int>(0);
        h.should_stop = [polls] { return ++*polls > 1; };
        return h;
      });
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
  train_ranks(2, [&](int) { return tiny(run, "full", "sharded", 2, 3); }, [](int) {
    TrainHooks h;
    auto polls = std::make_shared<int>(0);
    h.should_stop = [polls] { return ++*polls > 1; };
    return h;
  });
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

// ---- no communication on accumulation micro-steps
// -------------------------------------------------

namespace {

// Forwards to a real communicator and counts all-reduce calls.
class CountingComm : public dist::Communicator {
 public:
  CountingComm(std::unique_ptr<dist::Communicator> inner, std::atomic<int>* count)
      : inner_(std::move(inner)), count_(count) {}
  int rank() const override { return inner_->rank(); }
  int world() const override { return inner_->world(); }
  dist::Backend backend() const override { return inner_->backend(); }
  Device device() const override { return inner_->device(); }
  dist::WorkPtr all_reduce_async(const Tensor& t, dist::ReduceOp op) override {
    if (inner_->rank() == 0) ++*count_;
    return inner_->all_reduce_async(t, op);
  }
  dist::WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out,
                                     dist::ReduceOp op) override {
    return inner_->reduce_scatter_async(in, out, op);
  }
  dist::WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override {
    return inner_->all_gather_async(in, out);
  }
  dist::WorkPtr broadcast_async(const Tensor& t, int root) override {
    return inner_->broadcast_async(t, root);
  }
  dist::WorkPtr barrier_async() override { return inner_->barrier_async(); }

 private:
  std::unique_ptr<dist::Communicator> inner_;
  std::atomic<int>* count_;
};

}  // namespace

TEST(Parallel, DataParallelCommunicatesOncePerOptimizerStep) {
  const std::string base = test::temp_dir("par_nosync");
  const int64_t steps = 3;
  auto count_for = [&](int64_t accum) {
    std::atomic<int> n{0};
    const std::string out = base + fmt::format("/accum{}", accum);
    train_ranks(
        2, [&](int) { return tiny(out, "lora", "ddp", 2, steps, accum, 8); }, {},
        [&](std::unique_ptr<dist::Communicator> c) -> std::unique_ptr<dist::Communicator> {
          return std::make_unique<CountingComm>(std::move(c), &n);
        });
    return n.load();
  };
  // Per step: the global token count, one bucket (the tiny model's gradients fit in one), the
  // logged loss. Accumulating 4 micro-steps adds nothing.
  EXPECT_EQ(count_for(4), 3 * steps);
  EXPECT_EQ(count_for(1), 3 * steps);
}

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
// start within 30 s.
Launch start_training(const std::string& args, const std::string& out) {
  const pid_t pid = test::spawn_rig(args, out + "/log");
  if (pid > 0 && test::wait_for_nonempty(out + "/run/metrics.jsonl", 30))
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
    std::string all = std::string(1, '\0') + std::string((std::istreambuf_iterator<char>(env)),
                                                         std::istreambuf_iterator<char>());
    if (all.find(std::string("\0RANK=1\0", 8)) != std::string::npos) rank1 = w;
  }
  ASSERT_NE(rank1, 0);
  const auto t0 = std::chrono::steady_clock::now();
  kill(rank1, SIGKILL);
  const int st = test::wait_status(pid);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string log = read_file(out + "/log");
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << log;
  EXPECT_LT(secs, 20.0) << "the survivor must notice well within the timeout";
  EXPECT_NE(log.find("rig launch: rank 1 (pid"), std::string::npos) << log;
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

TEST(Parallel, RankThatThrowsIsNamedByTheOthers) {
  const std::string run = test::temp_dir("par_throw");
  try {
    train_ranks(
        3, [&](int) { return tiny(run, "lora", "ddp", 3, 50, 1, 3); },
        [](int r) {
          TrainHooks h;
          auto polls = std::make_shared<int>(0);
          h.should_stop = [polls, r] {
            if (r == 1 && ++*polls == 3) throw std::runtime_error("injected failure");
            return false;
          };
          return h;
        });
    FAIL() << "training went on without rank 1";
  } catch (const std::runtime_error& e) {
    // Rank 0 reports first: it names rank 1 rather than hanging until the timeout.
    std::string msg = e.what();
    EXPECT_NE(msg.find("rank 0:"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1 exited or lost its connection"), std::string::npos) << msg;
  }
}

TEST(Parallel, BadStrategyIsAClearError) {
  const std::string kBase = "model: /models/m\ndatasets: [{path: d.jsonl}]\nmax_steps: 10\n";
  try {
    parse_train_config(kBase + "strategy: zero2\n", "run.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("run.yaml"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("strategy"), std::string::npos) << e.what();
  }
  try {
    parse_train_config(kBase + "dist: {timeout_s: 0}\n", "run.yaml");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("dist.timeout_s"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_train_config(kBase + "strategy: fsdp\n", "run.yaml").strategy, "sharded");
}

TEST(Parallel, PowerSgdStillLearnsTheTinyModel) {
  // Lossy by design: not equal to the exact run, but it must learn about as well.
  const std::string base = test::temp_dir("par_powersgd");
  const int64_t steps = 12;
  train_ranks(2, [&](int) { return tiny(base + "/exact", "full", "ddp", 2, steps); });
  train_ranks(2, [&](int) {
    TrainConfig c = tiny(base + "/psgd", "full", "ddp", 2, steps);
    c.dist.powersgd_rank = 2;
    return c;
  });
  auto a = losses(base + "/exact"), b = losses(base + "/psgd");
  ASSERT_EQ(a.size(), size_t(steps));
  ASSERT_EQ(b.size(), size_t(steps));
  auto mean = [](const std::vector<double>& v, size_t from, size_t to) {
    double s = 0;
    for (size_t i = from; i < to; ++i) s += v[i];
    return s / double(to - from);
  };
  const double first = mean(b, 0, 3), last = mean(b, b.size() - 5, b.size()),
               exact_last = mean(a, a.size() - 5, a.size());
  fmt::print("powersgd: first {:.4f} last {:.4f}; exact last {:.4f}\n", first, last, exact_last);
  EXPECT_NE(a.back(), b.back()) << "the gradients were not compressed";
  EXPECT_LT(last, 0.8 * first);
  EXPECT_LT(last, 1.15 * exact_last);
}
