// The planner's memory model against the CPU engine's allocator peak, for every configuration
// the CPU engine runs (full and LoRA, with and without checkpointing).
#include <gtest/gtest.h>

#include <random>

#include "rig/core/allocator.h"
#include "rig/model/llama.h"
#include "rig/optim/adamw.h"
#include "rig/plan/memory.h"

using namespace rig;

namespace {

struct Case {
  const char* name;
  plan::Method method;
  plan::Checkpointing ckpt;
  int64_t recompute_layers = -1;
  bool adam8 = false;
};

class PlanMeasured : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(PlanMeasured, PeakWithinTenPercent) {
  const Case c = GetParam();
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 2048}, {"hidden_size", 256},
                      {"intermediate_size", 704}, {"num_hidden_layers", 4},
                      {"num_attention_heads", 8}, {"num_key_value_heads", 2}};
  ModelConfig cfg = ModelConfig::from_json(j, "plan-measured");
  const int64_t B = 4, T = 128;
  plan::TrainSetup s;
  s.method = c.method;
  s.lora_rank = 16;
  s.lora_targets = plan::parse_lora_targets("all");
  s.seq_len = T;
  s.micro_batch = B;
  s.checkpointing = c.ckpt;
  s.recompute_layers = c.recompute_layers;
  s.optimizer = c.adam8 ? plan::Optimizer::adamw8bit : plan::Optimizer::adamw;
  s.precision = plan::Precision::fp32;
  s.context_bytes = 0;
  s.gemm_workspace_bytes = 0;
  s.loss_chunk_tokens = 1024;
  const double predicted = plan::estimate_memory(cfg, s).allocator_peak();

  Allocator& a = cpu_allocator();
  const size_t base = a.in_use();
  a.reset_peak();
  {
    LoadOptions lo;
    lo.quantize = c.method == plan::Method::qlora;
    auto m = LlamaModel::random(cfg, 1, lo);
    if (c.method != plan::Method::full) {
      LoraConfig lc;
      lc.r = 16;
      lc.alpha = 32;
      m->add_lora(lc, 2);
    }
    std::mt19937_64 rng(3);
    TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64), {}, {}};
    for (int64_t i = 0; i < B * T; ++i)
      b.input_ids.data<int64_t>()[i] = b.labels.data<int64_t>()[i] = int64_t(rng() % 2048);
    OptimizerConfig oc;
    oc.eight_bit = c.adam8;
    AdamW opt(oc);
    StepOptions so;
    so.checkpointing = c.ckpt == plan::Checkpointing::full        ? Checkpointing::Full
                       : c.ckpt == plan::Checkpointing::selective ? Checkpointing::Selective
                                                                  : Checkpointing::None;
    so.recompute_layers = c.recompute_layers;
    so.loss_chunk_rows = 1024;
    for (int step = 0; step < 2; ++step) {
      m->zero_grad();
      m->step(b, so);
      opt.clip_and_step(m->params(), 1e-4f);
    }
  }
  const double measured = double(a.peak() - base);
  std::printf("%s: predicted %.2f MiB, measured %.2f MiB (%.1f%%)\n", c.name, predicted / 1048576,
              measured / 1048576, 100.0 * (predicted - measured) / measured);
  EXPECT_NEAR(predicted, measured, 0.10 * measured);
}

INSTANTIATE_TEST_SUITE_P(
    CpuEngine, PlanMeasured,
    ::testing::Values(Case{"full", plan::Method::full, plan::Checkpointing::none},
                      Case{"full_ckpt", plan::Method::full, plan::Checkpointing::full},
                      Case{"full_selective", plan::Method::full, plan::Checkpointing::selective},
                      Case{"full_ckpt_2_of_4", plan::Method::full, plan::Checkpointing::full, 2},
                      Case{"full_adamw8bit", plan::Method::full, plan::Checkpointing::none, -1,
                           true},
                      Case{"lora", plan::Method::lora, plan::Checkpointing::none},
                      Case{"lora_ckpt", plan::Method::lora, plan::Checkpointing::full},
                      Case{"lora_selective", plan::Method::lora, plan::Checkpointing::selective},
                      Case{"qlora_ckpt", plan::Method::qlora, plan::Checkpointing::full}),
    [](const auto& i) { return std::string(i.param.name); });
