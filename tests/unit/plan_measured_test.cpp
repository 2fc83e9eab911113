// The planner against measurements: its memory model against the CPU engine's allocator peak, for
// every configuration the CPU engine runs (full and LoRA, with and without checkpointing), and its
// speed model against `rig bench train` records of an H200 (bench/results).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <random>
#include <tuple>

#include "rig/core/allocator.h"
#include "rig/model/llama.h"
#include "rig/optim/adamw.h"
#include "rig/plan/memory.h"
#include "rig/plan/models.h"
#include "rig/plan/planner.h"
#include "test_util.h"

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

// ---- Speed: the plan's tokens/s against `rig bench train` on an H200 -------------------------
//
// The rows of bench/rig_vs_hf.sh that `rig bench train` measured with today's code, each record
// named by file and line. The built-in efficiency table (src/rig/plan/speed.cpp) must be what
// these records give, and the plan must predict them within 15%; the leave-one-out check predicts
// each row from the others only (docs/plan.md, "Speed").

namespace {

struct BenchRecord {
  const char* file;  // under bench/results
  int line;
};

struct BenchRow {
  int row;
  const char* model;
  plan::Method method;
  const char* targets;  // LoRA targets
  int64_t seq, batch;
  plan::Checkpointing ckpt;
  int64_t recompute_layers;
  std::vector<BenchRecord> records;
};

const std::vector<BenchRow>& bench_rows() {
  static const std::vector<BenchRow> rows = {
      {0,
       "llama3-8b",
       plan::Method::lora,
       "q,k,v,o",
       4096,
       2,
       plan::Checkpointing::full,
       10,
       {{"2026-12-04-rig-vs-hf.jsonl", 1},
        {"2026-12-04-night-rig-vs-hf.jsonl", 1},
        {"2026-12-04-night-packed-training.jsonl", 3}}},
      {2,
       "llama3-8b",
       plan::Method::lora,
       "all",
       4096,
       2,
       plan::Checkpointing::selective,
       -1,
       {{"2026-12-03-evening-rig-vs-hf.jsonl", 2}, {"2026-12-03-night-rig-vs-hf.jsonl", 2}}},
      {3,
       "llama3-1b",
       plan::Method::full,
       "",
       2048,
       8,
       plan::Checkpointing::none,
       -1,
       {{"2026-12-04-rig-vs-hf.jsonl", 2},
        {"2026-12-04-night-rig-vs-hf.jsonl", 2},
        {"2026-12-04-night-packed-training.jsonl", 4}}},
  };
  return rows;
}

nlohmann::json record_at(const BenchRecord& r) {
  std::ifstream in(rig::test::source_dir() + "/bench/results/" + r.file);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n)
    if (n == r.line) return nlohmann::json::parse(line);
  ADD_FAILURE() << r.file << ":" << r.line << " is missing";
  return {};
}

plan::PlanInput row_input(const BenchRow& r) {
  plan::PlanInput in;
  in.model = plan::builtin_model(r.model);
  in.model_name = r.model;
  in.gpus = "1xh200";
  in.setup.method = r.method;
  if (r.method != plan::Method::full) in.setup.lora_targets = plan::parse_lora_targets(r.targets);
  in.setup.lora_rank = 16;
  in.setup.seq_len = r.seq;
  in.setup.micro_batch = r.batch;
  in.setup.checkpointing = r.ckpt;
  in.setup.recompute_layers = r.recompute_layers;
  return in;
}

struct RowMeasured {
  double tokens_per_s = 0, efficiency = 0, memory_share = 0;  // means over the row's records
};

RowMeasured measured(const BenchRow& r, const plan::Catalog& c) {
  RowMeasured m;
  for (const auto& rec : r.records) {
    const nlohmann::json j = record_at(rec);
    EXPECT_EQ(j["row"], r.row) << rec.file << ":" << rec.line;
    EXPECT_EQ(j.value("packed", 0), 0) << rec.file << ":" << rec.line;
    // The record read back as `rig plan --calibrate` reads it: the shape from its parameter
    // count (these records predate "config"), the H200 as the card (they predate "gpu").
    auto e = plan::efficiency_from_record(j, fmt::format("{}:{}", rec.file, rec.line), r.method,
                                          "h200", c);
    m.tokens_per_s += j["tokens_per_s"].get<double>() / double(r.records.size());
    m.efficiency += e.efficiency / double(r.records.size());
    m.memory_share += e.memory_share / double(r.records.size());
  }
  return m;
}

}  // namespace

// The table's numbers are the records' (docs/plan.md, "Speed"): the lora entry the mean of rows 0
// and 2, the full entry row 3's; the rounding of the table (4 digits) is the only difference.
TEST(PlanMeasuredSpeed, BuiltinTableIsTheRecordsEfficiency) {
  const auto c = plan::Catalog::builtin();
  std::map<int, RowMeasured> m;
  for (const auto& r : bench_rows()) m[r.row] = measured(r, c);
  auto entry = [](plan::Method method) {
    for (const auto& e : plan::builtin_efficiencies())
      if (e.gpu == "h200" && e.method == method) return e;
    ADD_FAILURE() << "no h200 entry for " << plan::to_string(method);
    return plan::MeasuredEfficiency{};
  };
  const auto lora = entry(plan::Method::lora), full = entry(plan::Method::full);
  EXPECT_NEAR(lora.efficiency, (m[0].efficiency + m[2].efficiency) / 2, 1e-4);
  EXPECT_NEAR(lora.memory_share, (m[0].memory_share + m[2].memory_share) / 2, 1e-4);
  EXPECT_NEAR(full.efficiency, m[3].efficiency, 1e-4);
  EXPECT_NEAR(full.memory_share, m[3].memory_share, 1e-4);

  // QLoRA: the two runs of docs/qlora.md ("Measured", H200, 2026-12-03), as the records
  // `rig bench train --json` printed for them (LoRA r16 on q,k,v,o, full checkpointing).
  double qlora = 0;
  for (auto [model, seq, batch, tokens] :
       {std::tuple{"llama3-8b", 4096, 2, 10953.0}, std::tuple{"llama3-70b", 2048, 1, 1218.7}}) {
    plan::TrainSetup s;
    s.method = plan::Method::qlora;
    const auto counts = plan::count_params(plan::builtin_model(model), s);
    const nlohmann::json j = {{"tokens_per_s", tokens},
                              {"method", "qlora"},
                              {"seq", seq},
                              {"batch", batch},
                              {"parameters", counts.total() + counts.lora_total()},
                              {"trainable_parameters", counts.lora_total()},
                              {"checkpointing", "full"},
                              {"device", "cuda:0"},
                              {"precision", "bf16"}};
    qlora += plan::efficiency_from_record(j, model, plan::Method::qlora, "h200", c).efficiency / 2;
  }
  const auto q = entry(plan::Method::qlora);
  EXPECT_NEAR(q.efficiency, qlora, 1e-4);
  EXPECT_EQ(q.memory_share, lora.memory_share);  // no breakdown was recorded: LoRA's
}

// The plan, with nothing but the built-in table, against each row's measured tokens/s: within
// 15% of the row's mean and of every record.
TEST(PlanMeasuredSpeed, PlanPredictsRigBenchTrainWithinFifteenPercent) {
  const auto c = plan::Catalog::builtin();
  for (const auto& r : bench_rows()) {
    const auto p = plan::make_plan(row_input(r), c);
    const RowMeasured m = measured(r, c);
    std::printf("row %d: plan %.0f tokens/s, bench %.0f (mean of %zu), plan/bench %.3f\n", r.row,
                p.tokens_per_s, m.tokens_per_s, r.records.size(), p.tokens_per_s / m.tokens_per_s);
    EXPECT_NEAR(p.tokens_per_s / m.tokens_per_s, 1, 0.15) << "row " << r.row;
    for (const auto& rec : r.records)
      EXPECT_NEAR(p.tokens_per_s / record_at(rec)["tokens_per_s"].get<double>(), 1, 0.15)
          << rec.file << ":" << rec.line;
    EXPECT_FALSE(p.groups[0].efficiency_estimate);
  }
}

// Not circular: each row predicted from an efficiency derived from the other rows only (the
// mean of their efficiencies, whatever their method).
TEST(PlanMeasuredSpeed, LeaveOneOutWithinFifteenPercent) {
  const auto c = plan::Catalog::builtin();
  std::map<int, RowMeasured> m;
  for (const auto& r : bench_rows()) m[r.row] = measured(r, c);
  for (const auto& r : bench_rows()) {
    double others = 0;
    int n = 0;
    for (const auto& [row, x] : m)
      if (row != r.row) others += x.efficiency, ++n;
    auto in = row_input(r);
    in.efficiency = others / n;
    const auto p = plan::make_plan(in, c);
    std::printf("row %d left out: efficiency %.4f from the others, plan %.0f, bench %.0f, %.3f\n",
                r.row, in.efficiency, p.tokens_per_s, m[r.row].tokens_per_s,
                p.tokens_per_s / m[r.row].tokens_per_s);
    EXPECT_NEAR(p.tokens_per_s / m[r.row].tokens_per_s, 1, 0.15) << "row " << r.row;
  }
}
