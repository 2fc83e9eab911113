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
  bool lora;
  bool ckpt;
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
  s.method = c.lora ? plan::Method::lora : plan::Method::full;
  s.lora_rank = 16;
  s.lora_targets = plan::parse_lora_targets("all");
  s.seq_len = T;
  s.micro_batch = B;
  s.checkpointing = c.ckpt ? plan::Checkpointing::full : plan::Checkpointing::none;
  s.precision = plan::Precision::fp32;
  s.context_bytes = 0;
  s.gemm_workspace_bytes = 0;
  s.loss_chunk_tokens = 1024;
  const double predicted = plan::estimate_memory(cfg, s).allocator_peak();

  Allocator& a = cpu_allocator();
  const size_t base = a.in_use();
  a.reset_peak();
  {
    auto m = LlamaModel::random(cfg, 1);
    if (c.lora) {
      LoraConfig lc;
      lc.r = 16;
      lc.alpha = 32;
      m->add_lora(lc, 2);
    }
    std::mt19937_64 rng(3);
    TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64), {}, {}};
    for (int64_t i = 0; i < B * T; ++i)
      b.input_ids.data<int64_t>()[i] = b.labels.data<int64_t>()[i] = int64_t(rng() % 2048);
    AdamW opt(OptimizerConfig{});
    StepOptions so;
    so.checkpointing = c.ckpt ? Checkpointing::Full : Checkpointing::None;
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

INSTANTIATE_TEST_SUITE_P(CpuEngine, PlanMeasured,
                         ::testing::Values(Case{"full", false, false}, Case{"full_ckpt", false, true},
                                           Case{"lora", true, false}, Case{"lora_ckpt", true, true}),
                         [](const auto& i) { return std::string(i.param.name); });
