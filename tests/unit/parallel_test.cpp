// Training on 2 and 4 ranks (Gloo over 127.0.0.1) against 1 rank: ddp, sharded, QLoRA, PowerSGD.
#include "rig/train/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel_test_util.h"
#include "rig/dist/communicator.h"
#include "rig/dist/store.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/train/checkpoint.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;
using namespace rig::test::parallel;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

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

// A float32 folder, a bf16 one (quantized while loading) and a bitsandbytes 4-bit one (read).
class ShardedQloraFolder : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardedQloraFolder, RankHoldsItsPartOfThe4BitBytesAndGathersThemExactly) {
  const std::string dir = test::data_path(GetParam());
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
  int64_t weights = 0;
  for (const auto& p : ref_model->params()) weights += p.quant ? 1 : 0;
  // Quantized whole while loading, then sliced; or (defer_quantize, what a sharded run does)
  // quantized on demand, each rank only the weights its slices cover.
  for (const auto& [world, defer] : std::vector<std::pair<int, bool>>{{2, false}, {4, false},
                                                                      {2, true}, {4, true}}) {
    lo.defer_quantize = defer;
    std::vector<int64_t> quantized(size_t(world), 0);
    dist::StoreServer server(0);
    std::vector<std::thread> ts;
    std::vector<std::string> errors(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r)
      ts.emplace_back([&, r] {
        try {
          auto comm = gloo_rank(server.port(), r, world);
          auto m = LlamaModel::load(dir, lo);
          m->add_lora(LoraConfig{}, 1);
          Sharded sh(*comm, *m);
          auto check = [&](bool ok, const std::string& what) {
            if (!ok && errors[size_t(r)].empty()) errors[size_t(r)] = what;
          };
          quantized[size_t(r)] = m->deferred_quantized();
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
          // The frozen input embedding is gathered for its lookup only, the head for the loss
          // (after the last layer's forward, not beside the layers' weights).
          auto whole = [&](const char* name) { return m->find_param(name)->value.defined(); };
          sh.before(-1, StepHooks::Forward);
          check(whole("model.embed_tokens.weight"), "embedding not gathered for its lookup");
          check(!whole("lm_head.weight") && !whole("model.norm.weight"),
                "head gathered at the start of the step, beside the layers");
          sh.outer_done(StepHooks::Embedding);
          check(!whole("model.embed_tokens.weight"), "the embedding is kept after its lookup");
          // In a layer's hooks only that layer's weights are whole, byte for byte.
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
          check(!whole("lm_head.weight"), "head gathered while a layer runs");
          sh.after(1, StepHooks::Forward);
          sh.outer_needed(StepHooks::Head);
          check(whole("lm_head.weight") && whole("model.norm.weight"),
                "head not gathered for the final norm and the loss");
          sh.outer_done(StepHooks::Head);
          check(!whole("lm_head.weight") && !whole("model.norm.weight"), "head kept after the loss");
          sh.after(-1, StepHooks::Forward);
          check(m->quantized_bytes() == 0, "4-bit tensors kept after their layer");
          // The final output of a LoRA run: the adapters gathered, the 4-bit base left sharded.
          sh.gather_all(/*trainable_only=*/true);
          check(m->quantized_bytes() == 0, "4-bit tensors gathered for the adapter's output");
          for (const auto& p : m->params())
            if (p.trainable) check(p.value.defined(), p.name + " not gathered for the output");
          sh.release_all();
          sh.gather_all();
          check(stored(*m) == ref, "gathered 4-bit tensors differ from the unsharded model's");
          sh.release_all();
          check(m->quantized_bytes() == 0, "4-bit tensors kept after release_all");
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(errors[size_t(r)], "") << "world " << world << (defer ? ", deferred" : "");
    if (!defer) continue;
    // The model's quantization done once in all, not once per rank: a weight is quantized twice
    // only where a slice boundary of its layer's unit cuts it.
    const int64_t layers = ref_model->config().num_layers;
    int64_t sum = 0;
    for (int64_t q : quantized) {
      EXPECT_GT(q, 0);
      EXPECT_LT(q, weights);
      sum += q;
    }
    EXPECT_GE(sum, weights);
    EXPECT_LE(sum, weights + layers * (world - 1)) << "world " << world;
  }
}

INSTANTIATE_TEST_SUITE_P(Folders, ShardedQloraFolder,
                         ::testing::Values("hf/tiny-llama3/model", "bnb-nf4/tiny_llama_bf16",
                                           "bnb-nf4/tiny_llama_bnb4"),
                         [](const auto& info) {
                           std::string n = info.param.substr(info.param.find('/') + 1);
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

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

// A random QLoRA model (init: random) draws its 4-bit codes per byte: sharded ranks draw only
// their own bytes and must end with the very weights one process draws whole.
TEST(Parallel, ShardedRandomQloraRanksDrawTheirOwnBytesOfTheSameModel) {
  const std::string base = test::temp_dir("par_random_qlora");
  const int64_t steps = 4;
  auto cfg = [&](const std::string& out, const std::string& strategy, int world) {
    return tiny(out, "qlora", strategy, world, steps, 2, 8, {"init=random"});
  };
  train_one(cfg(base + "/one", "sharded", 1));
  train_ranks(2, [&](int) { return cfg(base + "/two", "sharded", 2); });
  train_ranks(4, [&](int) { return cfg(base + "/four", "sharded", 4); });
  train_ranks(2, [&](int) { return cfg(base + "/ddp", "ddp", 2); });
  for (const char* run : {"/two", "/four", "/ddp"})
    expect_close_runs(base + "/one", base + run, "qlora", size_t(steps), abs_tolerance("qlora"));
  // The random base is not the fixture's: the first loss differs from a run on the real weights.
  train_one(tiny(base + "/real", "qlora", "sharded", 1, steps));
  EXPECT_GT(std::abs(losses(base + "/one")[0] - losses(base + "/real")[0]), 1e-3);
}

// A frozen lm_head in slices of vocabulary rows (RIG_HEAD_SLICE_BYTES: 300 of the tiny model's
// 1000 float32 rows a slice, the last 100): the loss folds each slice's logits into running
// statistics and the backward gathers the slices again. Two ranks end as one rank whose head is
// read whole.
TEST(Parallel, ShardedHeadInSlicesMatchesOneRank) {
  for (const std::string method : {"lora", "qlora"}) {
    const std::string base = test::temp_dir("par_head_slices_" + method);
    const int64_t steps = 3;
    train_one(tiny(base + "/w1", method, "sharded", 1, steps));
    setenv("RIG_HEAD_SLICE_BYTES", "76800", 1);
    train_ranks(2, [&](int) {
      return tiny(base + "/w2", method, "sharded", 2, steps, 2, 8, {"save.every=3"});
    });
    unsetenv("RIG_HEAD_SLICE_BYTES");
    std::vector<std::string> slices;
    const nlohmann::json layout =
        load_checkpoint(latest_checkpoint(base + "/w2")->dir).state["sharded"];
    for (const auto& u : layout["units"])
      if (u["name"].get<std::string>().rfind("outer.lm_head.", 0) == 0)
        slices.push_back(u["params"][0][0].get<std::string>());
    EXPECT_EQ(slices,
              (std::vector<std::string>{"lm_head.weight[0:300]", "lm_head.weight[300:600]",
                                        "lm_head.weight[600:900]", "lm_head.weight[900:1000]"}));
    expect_close_runs(base + "/w1", base + "/w2", method, size_t(steps), abs_tolerance(method));
  }
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

// ---- failures and options ---------------------------------------------------------------------

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
