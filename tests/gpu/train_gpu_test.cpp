// The model and the training loop on the GPU (float32 and bf16) against the Hugging Face fixtures
// and the CPU oracle. Skipped with the reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "rig/core/allocator.h"
#include "rig/dist/communicator.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/lora.h"
#include "rig/model/llama.h"
#ifdef RIG_WITH_CUDA
#include "rig/ops/cuda/cuda_ops.h"
#include "rig/ops/cuda/sdpa_cudnn.h"
#endif
#include "../unit/hf_reference.h"
#include "rig/optim/adamw.h"
#include "rig/train/metrics.h"
#include "rig/train/trainer.h"

using namespace rig;

namespace {

#define REQUIRE_GPU() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA GPU visible: GPU training tests run on a GPU machine"

// The paths compiled in, unless the environment moves them (a bundle run elsewhere).
std::string env_or(const char* name, const char* def) {
  const char* v = std::getenv(name);
  return v ? v : def;
}
std::string data(const std::string& rel) { return env_or("RIG_TEST_DATA", RIG_TEST_DATA) + "/" + rel; }

double rel_err(const Tensor& a_any, const Tensor& b) {
  Tensor a = a_any.to(Device::cpu());
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double d = double(a.f32()[i]) - b.f32()[i];
    num += d * d;
    den += double(b.f32()[i]) * b.f32()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

class GpuGolden : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(GpuGolden, ForwardBackwardMatchesTransformers) {
  REQUIRE_GPU();
  auto m = LlamaModel::load(data("hf/" + GetParam() + "/model"));
  m->to_device(Device::cuda(0));
  auto ref = SafeTensorsFile::open(data("hf/" + GetParam() + "/forward_backward.safetensors"));
  m->zero_grad();
  Tensor logits;
  StepOptions opt;
  opt.logits = &logits;
  auto r = m->step(TokenBatch{ref.get("input_ids").clone(), ref.get("labels").clone(), {}, {}}, opt);
  EXPECT_NEAR(r.loss(), ref.get_f32("loss").f32()[0], 1e-5 * std::fabs(ref.get_f32("loss").f32()[0]));
  EXPECT_LT(rel_err(logits, ref.get_f32("logits")), 1e-5);
  for (auto& p : m->params()) {
    ASSERT_TRUE(p.grad.device().is_cuda());
    EXPECT_LT(rel_err(p.grad, ref.get_f32("grad." + p.name)), 1e-4) << p.name;
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, GpuGolden,
                         ::testing::Values("tiny-llama3", "tiny-qwen2", "tiny-qwen3"));

// Replays the fixture's 300-step run and returns the worst relative difference from
// transformers' losses; fails at the first step past `tol`.
static double replay_loss_curve(LlamaModel& m, double tol) {
  return test::replay_loss_curve(
      m, data("hf/tiny-llama3/"), [tol](int64_t s, double rel, double loss, double want) {
        if (rel < tol) return true;
        ADD_FAILURE() << "step " << s << ": loss " << loss << " vs " << want;
        return false;
      });
}

TEST(GpuTraining, LossCurveFollowsTransformers) {
  REQUIRE_GPU();
  auto m = LlamaModel::load(data("hf/tiny-llama3/model"));
  m->to_device(Device::cuda(0));
  std::printf("GPU fp32 loss curve: worst relative difference %.2e\n", replay_loss_curve(*m, 1e-3));
}

#ifdef RIG_WITH_CUDA
// bf16 weights and activations, fp32 master weights and optimizer state: the curve stays within a
// few percent of transformers' float32 one at every step, with cuDNN's and the reference attention.
TEST(GpuTraining, Bf16LossCurveFollowsTransformers) {
  REQUIRE_GPU();
  // (rig's flash kernel starts at head_dim 64: FlashAttentionTrainsPackedRowsLikeTheCpu covers it.)
  for (std::string impl : {"cudnn", "reference"}) {
    if (impl == "cudnn" && ops::cuda::sdpa_cudnn::runtime_version() < 90000) continue;
    ops::cuda::set_attention_impl(impl);
    auto m = LlamaModel::load(data("hf/tiny-llama3/model"));
    m->set_compute_dtype(DType::BF16);
    m->to_device(Device::cuda(0));
    std::printf("GPU bf16 loss curve, %s attention: worst relative difference %.2e\n", impl.c_str(),
                replay_loss_curve(*m, 3e-2));
    EXPECT_EQ(ops::cuda::last_attention_impl(false), impl);
    EXPECT_EQ(ops::cuda::last_attention_impl(true), impl);
  }
  ops::cuda::set_attention_impl("auto");
}

// rig's flash kernel in training: packed rows (segments and restarting positions), head_dim 64
// (the tiny fixtures' 16 is below what the kernel compiles for), bf16 on the GPU against the CPU
// oracle in float32, full and LoRA, step by step.
TEST(GpuTraining, FlashAttentionTrainsPackedRowsLikeTheCpu) {
  REQUIRE_GPU();
  const ModelConfig cfg = ModelConfig::from_json(
      {{"model_type", "llama"}, {"vocab_size", 97}, {"hidden_size", 256}, {"intermediate_size", 512},
       {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}},
      "flash test shape");
  ops::cuda::set_attention_impl("flash");
  const int64_t B = 2, T = 160;
  for (bool lora : {false, true}) {
    std::vector<double> losses[2];
    for (int gpu = 0; gpu < 2; ++gpu) {
      auto m = LlamaModel::random(cfg, 3);
      if (lora) m->add_lora(LoraConfig{}, 7);
      if (gpu) {
        m->set_compute_dtype(DType::BF16);
        m->to_device(Device::cuda(0));
      }
      OptimizerConfig oc;
      oc.lr = lora ? 3e-3f : 1e-3f;
      AdamW opt(oc);
      for (int s = 0; s < 30; ++s) {
        TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64),
                     Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64)};
        for (int64_t r = 0; r < B; ++r) {
          int64_t seg = 1, start = 0, len = 5 + (r * 17 + s) % 40;
          for (int64_t t = 0; t < T; ++t) {
            if (t - start == len) {
              ++seg;
              start = t;
              len = 1 + (t * 7 + r + s) % 70;
            }
            const int64_t i = r * T + t, p = t - start;
            b.input_ids.data<int64_t>()[i] = b.labels.data<int64_t>()[i] = (seg * 11 + p * (1 + seg % 3)) % 97;
            b.position_ids.data<int64_t>()[i] = p;
            b.segment_ids.data<int64_t>()[i] = seg;
          }
        }
        m->zero_grad();
        losses[gpu].push_back(m->step(b, StepOptions{}).loss());
        opt.clip_and_step(m->params(), oc.lr);
        m->refresh_compute_weights();
      }
    }
    EXPECT_EQ(ops::cuda::last_attention_impl(false), "flash");
    EXPECT_EQ(ops::cuda::last_attention_impl(true), "flash");
    double worst = 0;
    for (size_t s = 0; s < losses[0].size(); ++s) {
      const double rel = std::fabs(losses[1][s] - losses[0][s]) / losses[0][s];
      EXPECT_LT(rel, 5e-2) << (lora ? "lora" : "full") << " step " << s << ": " << losses[1][s] << " vs " << losses[0][s];
      worst = std::max(worst, rel);
    }
    EXPECT_LT(losses[1].back(), 0.95 * losses[1].front()) << "the loss must fall";
    std::printf("flash attention, packed, %s: loss %.3f -> %.3f (CPU %.3f -> %.3f), worst step difference %.2e\n",
                lora ? "LoRA" : "full", losses[1].front(), losses[1].back(), losses[0].front(),
                losses[0].back(), worst);
  }
  ops::cuda::set_attention_impl("auto");
}
#endif  // RIG_WITH_CUDA

// ---- bf16 mixed precision against the float32 references --------------------------------------
// bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3); a few layers of products and
// norms compound that to about 1e-2 on logits and a few 1e-2 on gradients. The tolerances below
// are that, not fitted to one run: a wrong kernel or a missing cast is off by far more.

namespace {

TokenBatch fixture_batch(const SafeTensorsFile& f, const std::string& suffix = "") {
  return TokenBatch{f.get("input_ids" + suffix).clone(), f.get("labels" + suffix).clone(), {}, {}};
}

using test::optimizer_from;

std::unique_ptr<LlamaModel> bf16_model(const std::string& name, bool lora) {
  auto m = LlamaModel::load(data("hf/" + name + "/model"));
  if (lora) m->load_adapter(data("hf/" + name + "/lora_adapter"));
  m->set_compute_dtype(DType::BF16);
  m->to_device(Device::cuda(0));
  return m;
}

class GpuBf16 : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(GpuBf16, ForwardBackwardWithinBf16OfTransformers) {
  REQUIRE_GPU();
  for (bool lora : {false, true}) {
    auto m = bf16_model(GetParam(), lora);
    auto fb = SafeTensorsFile::open(data("hf/" + GetParam() + "/forward_backward.safetensors"));
    auto ref = lora ? SafeTensorsFile::open(data("hf/" + GetParam() + "/lora_forward_backward.safetensors")) : fb;
    m->zero_grad();
    Tensor logits;
    StepOptions opt;
    opt.logits = &logits;
    auto r = m->step(fixture_batch(fb), opt);
    const double want = ref.get_f32("loss").f32()[0];
    const double e_logits = rel_err(logits, ref.get_f32("logits"));
    EXPECT_NEAR(r.loss(), want, 1e-2 * want) << (lora ? "lora" : "full");
    EXPECT_LT(e_logits, 2e-2) << (lora ? "lora" : "full");
    double worst = 0;
    int checked = 0;
    for (auto& p : m->params()) {
      if (!p.trainable) continue;
      ASSERT_EQ(p.grad.dtype(), DType::F32) << p.name;
      const double e = rel_err(p.grad, ref.get_f32("grad." + p.name));
      EXPECT_LT(e, 6e-2) << p.name;
      worst = std::max(worst, e);
      ++checked;
    }
    EXPECT_GT(checked, 0);
    std::printf("%s bf16 %s: loss %.6f vs %.6f, logits error %.2e, worst gradient error %.2e over %d\n",
                GetParam().c_str(), lora ? "LoRA" : "full", r.loss(), want, e_logits, worst, checked);
  }
}

TEST_P(GpuBf16, AdamWFiveStepsWithinBf16OfTorch) {
  REQUIRE_GPU();
  const auto refj = nlohmann::json::parse(read_file(data("hf/" + GetParam() + "/reference.json")));
  auto batches = SafeTensorsFile::open(data("hf/" + GetParam() + "/adamw_5steps.safetensors"));
  for (bool lora : {false, true}) {
    auto m = bf16_model(GetParam(), lora);
    const auto cfg = lora ? refj["lora"]["adamw"] : refj["adamw_5steps"];
    OptimizerConfig oc = optimizer_from(cfg);
    AdamW opt(oc);
    double worst_loss = 0;
    for (int s = 0; s < 5; ++s) {
      m->zero_grad();
      const double loss = m->step(fixture_batch(batches, "." + std::to_string(s)), StepOptions{}).loss();
      const double want = cfg["losses"][s].get<double>();
      EXPECT_NEAR(loss, want, 1e-2 * want) << (lora ? "lora" : "full") << " step " << s;
      worst_loss = std::max(worst_loss, std::fabs(loss - want) / want);
      opt.clip_and_step(m->params(), oc.lr);
      m->refresh_compute_weights();
    }
    // The float32 master weights after five steps. Adam's update is a normalised gradient, so
    // the weights carry the gradients' bf16 error, compounded over the steps.
    auto ref = SafeTensorsFile::open(
        data("hf/" + GetParam() + (lora ? "/lora_forward_backward.safetensors" : "/adamw_5steps.safetensors")));
    double worst = 0;
    for (auto& p : m->params()) {
      if (!p.trainable) continue;
      ASSERT_EQ(p.value.dtype(), DType::F32) << p.name;
      const double e = rel_err(p.value, ref.get_f32((lora ? "trained." : "param.") + p.name));
      EXPECT_LT(e, 8e-2) << p.name;
      worst = std::max(worst, e);
    }
    std::printf("%s bf16 %s AdamW 5 steps: worst loss difference %.2e, worst weight error %.2e\n",
                GetParam().c_str(), lora ? "LoRA" : "full", worst_loss, worst);
  }
}

// Longer runs on a learnable sequence: the GPU in bf16 against the CPU oracle in float32, LoRA and
// full, step by step.
TEST_P(GpuBf16, LongerRunFollowsTheCpu) {
  REQUIRE_GPU();
  for (bool lora : {false, true}) {
    std::vector<double> losses[2];
    for (int gpu = 0; gpu < 2; ++gpu) {
      auto m = LlamaModel::load(data("hf/" + GetParam() + "/model"));
      if (lora) m->add_lora(LoraConfig{}, 7);
      if (gpu) {
        m->set_compute_dtype(DType::BF16);
        m->to_device(Device::cuda(0));
      }
      OptimizerConfig oc;
      oc.lr = lora ? 3e-3f : 1e-3f;
      AdamW opt(oc);
      const int64_t B = 4, T = 48, V = m->config().vocab_size;
      for (int s = 0; s < 60; ++s) {
        TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64), {}, {}};
        for (int64_t i = 0; i < B * T; ++i)  // each row counts up by a row-specific stride
          b.input_ids.data<int64_t>()[i] = b.labels.data<int64_t>()[i] = ((i / T + s) * 7 + (i % T) * (1 + (i / T + s) % 3)) % std::min<int64_t>(V, 97);
        m->zero_grad();
        losses[gpu].push_back(m->step(b, StepOptions{}).loss());
        opt.clip_and_step(m->params(), oc.lr);
        m->refresh_compute_weights();
      }
    }
    double worst = 0;
    for (size_t s = 0; s < losses[0].size(); ++s) {
      const double rel = std::fabs(losses[1][s] - losses[0][s]) / losses[0][s];
      EXPECT_LT(rel, 5e-2) << (lora ? "lora" : "full") << " step " << s << ": " << losses[1][s] << " vs " << losses[0][s];
      worst = std::max(worst, rel);
    }
    EXPECT_LT(losses[1].back(), 0.95 * losses[1].front()) << "the loss must fall";
    std::printf("%s bf16 %s 60 steps: loss %.3f -> %.3f (CPU fp32 %.3f -> %.3f), worst step difference %.2e\n",
                GetParam().c_str(), lora ? "LoRA" : "full", losses[1].front(), losses[1].back(),
                losses[0].front(), losses[0].back(), worst);
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, GpuBf16,
                         ::testing::Values("tiny-llama3", "tiny-qwen2", "tiny-qwen3"));

TEST(GpuTraining, DemoLearnsOnTheGpu) {
  REQUIRE_GPU();
  const std::string src = env_or("RIG_SOURCE_DIR", RIG_SOURCE_DIR);
  const std::string out = env_or("RIG_BUILD_DIR", RIG_BUILD_DIR) + "/test-tmp/gpu-demo";
  std::filesystem::remove_all(out);
  auto c = load_train_config(src + "/configs/demo.yaml",
                             {"output_dir=" + out, "device=cuda", "max_steps=200", "eval.every=200",
                              "eval.generate=60", "save.every=0",
                              "tokenizer=" + src + "/data/demo/tokenizer.json",
                              "datasets.0.path=" + src + "/data/demo/reverse.jsonl"});
  auto r = train(c, TrainHooks{{}, true});
  EXPECT_GT(r.exact_match, 0.5);
  auto rows = read_metrics(out + "/metrics.jsonl").rows;
  ASSERT_FALSE(rows.empty());
  std::printf("GPU demo: exact match %.2f, last tokens/s %.0f, peak %.1f MiB\n", r.exact_match,
              rows.back().value("tokens_per_s", 0.0), rows.back().value("peak_memory_bytes", 0.0) / 1048576);
}

// The distributed path on one GPU: NCCL with a world of one, data-parallel and sharded, against the
// same run without a communicator. In float32: bf16 runs are not bitwise reproducible (the
// embedding gradient's atomics add in any order, and bf16 rounding amplifies the difference over
// steps), so only float32 can tell a strategy's error from that noise.
TEST(GpuTraining, NcclWorldOfOneMatchesTheSingleProcessRun) {
  REQUIRE_GPU();
  if (!dist::nccl_built()) GTEST_SKIP() << "this build has no NCCL";
  const std::string src = env_or("RIG_SOURCE_DIR", RIG_SOURCE_DIR);
  const std::string base = env_or("RIG_BUILD_DIR", RIG_BUILD_DIR) + "/test-tmp/gpu-nccl1";
  for (const std::string strategy : {"ddp", "sharded"}) {
    std::vector<double> losses[2];
    for (int with_comm = 0; with_comm < 2; ++with_comm) {
      const std::string out = base + "-" + strategy + std::to_string(with_comm);
      std::filesystem::remove_all(out);
      auto c = load_train_config(src + "/configs/demo.yaml",
                                 {"output_dir=" + out, "device=cuda", "max_steps=50", "eval.every=0",
                                  "eval.generate=0", "save.every=0", "strategy=" + strategy,
                                  "precision=fp32",
                                  "tokenizer=" + src + "/data/demo/tokenizer.json",
                                  "datasets.0.path=" + src + "/data/demo/reverse.jsonl"});
      TrainHooks h{{}, true};
      std::unique_ptr<dist::StoreServer> server;
      std::unique_ptr<dist::Communicator> comm;
      if (with_comm) {
        server = std::make_unique<dist::StoreServer>(0);
        auto store = std::make_shared<dist::Store>("127.0.0.1", server->port(), 0, std::chrono::seconds(30));
        comm = dist::make_nccl(store, 0, 1, 0);
        h.comm = comm.get();
      }
      train(c, h);
      for (auto& row : read_metrics(out + "/metrics.jsonl").rows)
        if (row.contains("loss") && !row.contains("eval_loss")) losses[with_comm].push_back(row["loss"].get<double>());
    }
    ASSERT_EQ(losses[0].size(), 50u) << strategy;
    ASSERT_EQ(losses[1].size(), 50u) << strategy;
    double worst = 0;
    for (size_t i = 0; i < losses[0].size(); ++i)
      worst = std::max(worst, std::fabs(losses[1][i] - losses[0][i]) / losses[0][i]);
    // Only the order of float32 atomics in the embedding gradient may differ between the runs.
    EXPECT_LT(worst, 1e-4) << strategy;
    std::printf("NCCL world of one, %s: 50 steps, loss %.4f -> %.4f, worst difference from the single run %.2e\n",
                strategy.c_str(), losses[1].front(), losses[1].back(), worst);
  }
}

// Activation checkpointing on the GPU is exact, as on the CPU: recomputing the element-wise work
// (selective) or each layer's forward (full, on every layer or the first three) gives
// bit-identical gradients (every kernel is deterministic given its inputs; dropout masks come from
// the seed), in float32 and in bf16, each mode with a lower allocator peak than the one before.
TEST(GpuTraining, ActivationCheckpointingIsExact) {
  REQUIRE_GPU();
  const nlohmann::json arch = {{"model_type", "llama"},       {"vocab_size", 512},
                               {"hidden_size", 128},          {"intermediate_size", 256},
                               {"num_hidden_layers", 6},      {"num_attention_heads", 4},
                               {"num_key_value_heads", 2}};
  const int64_t B = 4, T = 256;
  TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64), {}, {}};
  // Ids repeat about 17 times each: the embedding backward must sum them in a fixed order.
  for (int64_t i = 0; i < B * T; ++i)
    b.input_ids.data<int64_t>()[i] = b.labels.data<int64_t>()[i] = (i * 37 + 11) % 61;
  Allocator& alloc = allocator_for(Device::cuda(0));
  struct Mode {
    Checkpointing ck;
    int64_t recompute_layers;
    const char* name;
  };
  const Mode modes[] = {{Checkpointing::None, -1, "none"},
                        {Checkpointing::Selective, -1, "selective"},
                        {Checkpointing::Full, 3, "full on 3 of 6 layers"},
                        {Checkpointing::Full, -1, "full"}};
  for (DType dt : {DType::F32, DType::BF16})
    for (bool lora : {false, true}) {
      auto m = LlamaModel::random(ModelConfig::from_json(arch, "test"), 3);
      if (lora) {
        LoraConfig lc;
        lc.dropout = 0.1f;
        m->add_lora(lc, 4);
      }
      m->set_compute_dtype(dt);
      m->to_device(Device::cuda(0));
      const std::string what =
          std::string(dt == DType::F32 ? "fp32" : "bf16") + (lora ? " LoRA" : " full");
      std::vector<Tensor> first;
      double first_loss = 0;
      size_t prev_peak = 0;
      for (const Mode& mode : modes) {
        m->zero_grad();
        StepOptions so;
        so.checkpointing = mode.ck;
        so.recompute_layers = mode.recompute_layers;
        so.dropout_seed = 99;
        alloc.reset_peak();
        const double loss = m->step(b, so).loss();
        const size_t peak = alloc.peak();
        std::vector<Tensor> grads;
        for (auto& p : m->params())
          if (p.trainable) grads.push_back(p.grad.to(Device::cpu()));
        if (first.empty()) {
          first = grads;
          first_loss = loss;
        } else {
          EXPECT_EQ(first_loss, loss) << what << ", " << mode.name;
          ASSERT_EQ(first.size(), grads.size());
          for (size_t i = 0; i < grads.size(); ++i)
            EXPECT_EQ(std::memcmp(first[i].raw(), grads[i].raw(), grads[i].nbytes()), 0)
                << what << ", " << mode.name << ": gradient " << i;
          EXPECT_LT(peak, prev_peak) << what << ", " << mode.name;
        }
        std::printf("checkpointing %s, %s: peak %.1f MiB\n", what.c_str(), mode.name,
                    double(peak) / 1048576);
        prev_peak = peak;
      }
    }
}
