// rig plan: every expected number is computed here by hand from the formula or the documents'
// constants, never copied from rig's output.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/model/loss_chunk.h"
#include "rig/plan/models.h"
#include "rig/plan/planner.h"
#include "test_util.h"

using namespace rig::plan;

namespace {

// Awkward sizes so that no term hides behind a power of two.
rig::ModelConfig tiny() {
  rig::ModelConfig m;
  m.vocab_size = 333;
  m.hidden_size = 96;
  m.intermediate_size = 250;
  m.num_layers = 3;
  m.num_heads = 6;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  return m;
}

PlanInput doc_70b_input() {
  PlanInput in;
  in.model = builtin_model("llama3-70b");
  in.model_name = "llama3-70b";
  in.setup.method = Method::qlora;
  in.setup.lora_rank = 64;
  in.setup.lora_targets = 127;
  in.setup.optimizer = Optimizer::adamw8bit;
  in.setup.strategy = Strategy::sharded;
  in.setup.checkpointing = Checkpointing::full;
  in.setup.seq_len = 2048;
  in.setup.micro_batch = 1;
  in.gpus = "4x4090";
  in.platform = "z790";
  return in;
}

}  // namespace

TEST(PlanModels, BuiltinShapesMatchPublishedParameterCounts) {
  // Parameter counts published on each model's Hugging Face page.
  const std::pair<const char*, int64_t> published[] = {
      {"llama3-1b", 1'235'814'400},    {"llama3-3b", 3'212'749'824},
      {"llama3-8b", 8'030'261'248},    {"llama3-70b", 70'553'706'496},
      {"qwen2.5-7b", 7'615'616'512},   {"qwen2.5-14b", 14'770'033'664},
      {"qwen2.5-32b", 32'763'876'352}, {"qwen2.5-72b", 72'706'203'648},
      {"qwen3-8b", 8'190'735'360},    {"mistral-7b", 7'248'023'552}};
  for (auto [name, n] : published) {
    auto m = builtin_model(name);
    EXPECT_EQ(m.num_parameters(), n) << name;
    EXPECT_EQ(count_params(m, TrainSetup{}).total(), n) << name;
  }
  EXPECT_THROW(builtin_model("llama3-9b"), rig::InputError);
}

TEST(PlanMemory, Nf4DoubleQuantizationBits) {
  // 4-bit codes + 8-bit absmax per 64 + fp32 absmax-of-absmax per 256 blocks.
  EXPECT_DOUBLE_EQ(nf4_bits_per_weight(true), 4 + 8.0 / 64 + 32.0 / (64 * 256));
  // The documents' "double quantization saves ~0.4 bit/param": 0.5 - 0.127 = 0.373. Right.
  EXPECT_NEAR(nf4_bits_per_weight(false) - nf4_bits_per_weight(true), 0.373, 0.001);
}

TEST(PlanMemory, FullFineTuneTermsByHand) {
  auto m = tiny();
  TrainSetup s;
  s.method = Method::full;
  s.checkpointing = Checkpointing::none;
  s.micro_batch = 3;
  s.seq_len = 111;
  const double h = 96, f = 250, q = 96, kv = 32, V = 333, L = 3, heads = 6, BT = 333;
  const double per_layer_params = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h;
  const double N = L * per_layer_params + 2 * V * h + h;
  auto e = estimate_memory(m, s);
  EXPECT_DOUBLE_EQ(e.params.total(), N);
  EXPECT_DOUBLE_EQ(e.weights, 2 * N);
  EXPECT_DOUBLE_EQ(e.gradients, 2 * N);
  EXPECT_DOUBLE_EQ(e.master, 4 * N);
  EXPECT_DOUBLE_EQ(e.optimizer, 8 * N);
  EXPECT_DOUBLE_EQ(e.lora, 0);
  // Per layer: BT·(a·(2h + 2q + 2kv + 3f) + 8h + 8 + 4·heads): the two residuals (x, h1) are
  // float32 whatever the activation dtype.
  const double layer = BT * (2 * (2 * h + 2 * q + 2 * kv + 3 * f) + 4 * 2 * h + 8 + 4 * heads);
  EXPECT_DOUBLE_EQ(e.per_layer.saved_none, layer);
  // Plus the final norm's float32 input, its bf16 output and rstd.
  EXPECT_DOUBLE_EQ(e.activations, L * layer + BT * (h * 4 + h * 2 + 4));
  // Full checkpointing keeps only each layer's input and recomputes one layer at a time.
  s.checkpointing = Checkpointing::full;
  auto c = estimate_memory(m, s);
  EXPECT_DOUBLE_EQ(c.activations, L * BT * h * 4 + BT * (h * 4 + h * 2 + 4));
  EXPECT_DOUBLE_EQ(c.layer_peak, layer - BT * h * 4 + e.per_layer.backward_work);
  // Full on the first layer only: the other two keep what selective keeps.
  s.recompute_layers = 1;
  auto c1 = estimate_memory(m, s);
  EXPECT_DOUBLE_EQ(c1.activations,
                   BT * h * 4 + 2 * (layer - BT * 2 * (2 * h + f)) + BT * (h * 4 + h * 2 + 4));
  s.recompute_layers = -1;
  // Selective drops the two normed inputs and the SwiGLU product.
  s.checkpointing = Checkpointing::selective;
  auto sel = estimate_memory(m, s);
  EXPECT_DOUBLE_EQ(sel.per_layer.saved_selective, layer - BT * 2 * (2 * h + f));
  // Loss chunk: the engine's default rows (here more than BT) of bf16 logits, the gradient in
  // place.
  ASSERT_GT(rig::loss_chunk_rows_for(int64_t(V), 2), int64_t(BT));
  EXPECT_DOUBLE_EQ(e.logits, BT * V * 2);
  s.loss_chunk_tokens = 16;
  EXPECT_DOUBLE_EQ(estimate_memory(m, s).logits, 16 * V * 2);
}

TEST(PlanMemory, Fp32PrecisionPredictsTheCpuEngine) {
  auto m = tiny();
  TrainSetup s;
  s.method = Method::full;
  s.precision = Precision::fp32;
  s.context_bytes = s.gemm_workspace_bytes = 0;
  s.checkpointing = Checkpointing::none;
  s.micro_batch = 1;
  s.seq_len = 37;
  auto e = estimate_memory(m, s);
  const double N = double(m.num_parameters());
  EXPECT_DOUBLE_EQ(e.weights, 4 * N);
  EXPECT_DOUBLE_EQ(e.gradients, 4 * N);
  EXPECT_DOUBLE_EQ(e.master, 0);  // fp32 weights are their own master copy
  EXPECT_DOUBLE_EQ(e.context, 0);
  EXPECT_DOUBLE_EQ(e.workspace, 0);
  const double h = 96, f = 250, q = 96, kv = 32;
  EXPECT_DOUBLE_EQ(e.per_layer.saved_none, 37 * (4 * (4 * h + 2 * q + 2 * kv + 3 * f) + 8 + 4 * 6));
}

TEST(PlanMemory, LoraParameterCount70B) {
  auto m = builtin_model("llama3-70b");
  TrainSetup s;
  s.method = Method::lora;
  s.lora_rank = 64;
  s.lora_targets = parse_lora_targets("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
  // r·(in+out) per target: q,o 8192+8192; k,v 8192+1024; gate,up,down 8192+28672.
  const int64_t per_layer = 64 * (2 * 16384 + 2 * 9216 + 3 * 36864);
  EXPECT_EQ(count_params(m, s).lora_total(), 80 * per_layer);
  EXPECT_EQ(80 * per_layer, 828'375'040);
}

TEST(PlanMemory, QloraWeightsAndLoraActivations8B) {
  auto m = builtin_model("llama3-8b");
  TrainSetup s;  // qlora r=16 q,k,v,o, full checkpointing
  auto e = estimate_memory(m, s);
  const double linear = 32.0 * (4096.0 * 4096 * 2 + 2 * 4096.0 * 1024 + 3 * 4096.0 * 14336);
  const double rest = 32.0 * 2 * 4096 + 2 * 128256.0 * 4096 + 4096;
  EXPECT_DOUBLE_EQ(e.weights, linear * (4 + 8.0 / 64 + 32.0 / 16384) / 8 + rest * 2);
  // LoRA saves x·A for each of its 4 targets and keeps xn1 but not xn2 or the SwiGLU product.
  const double BT = 2048, h = 4096, f = 14336, q = 4096, kv = 1024;
  EXPECT_DOUBLE_EQ(e.per_layer.saved_none,
                   BT * (2 * (h + 2 * q + 2 * kv + 2 * f + 4 * 16) + 4 * 2 * h + 8 + 4 * 32));
}

TEST(PlanMemory, ShardingDividesStateByWorld) {
  auto m = tiny();
  TrainSetup s;
  s.method = Method::full;
  auto one = estimate_memory(m, s);
  s.world_size = 4;
  s.strategy = Strategy::sharded;
  auto four = estimate_memory(m, s);
  EXPECT_DOUBLE_EQ(four.weights, one.weights / 4);
  EXPECT_DOUBLE_EQ(four.optimizer, one.optimizer / 4);
  EXPECT_DOUBLE_EQ(four.master, one.master / 4);
  // Gather buffer: (1 + prefetch) × the largest unit, here a decoder layer (its 7 linears and
  // 2 norms, larger than the 333×96 embedding), plus a reduce-scatter buffer of one unit's
  // gradient and NCCL's buffers.
  const double layer = 96 * 96 * 2 + 2 * 96 * 32 + 3 * 96 * 250 + 2 * 96;
  ASSERT_GT(layer, 333 * 96);
  EXPECT_DOUBLE_EQ(four.comm_buffers, s.nccl_bytes + 2 * layer * 2 + layer * 2);
}

TEST(PlanScenario, Llama8BQloraOnOne4090) {
  PlanInput in;
  in.model = builtin_model("llama3-8b");
  in.model_name = "llama3-8b";
  in.setup.micro_batch = 2;  // the document's "max batch size" at 2048 on 24 GB
  in.setup.seq_len = 2048;
  in.gpus = "1x4090";
  auto p = make_plan(in, Catalog::builtin());
  EXPECT_TRUE(p.fits);
  EXPECT_GE(p.max_micro_batch, 2);  // with checkpointing, 2 is far from the limit
  EXPECT_EQ(p.comm_s, 0);
  // tokens/s = 165.2e12 · efficiency / FLOPs per token; the 4090 was not measured: its QLoRA
  // efficiency is the H200's carried over by peak and bandwidth, and the plan says so.
  const auto& ql = builtin_efficiencies()[2];
  ASSERT_EQ(ql.method, Method::qlora);
  const double e = ql.efficiency /
                   ((1 - ql.memory_share) + ql.memory_share * (165.2 / 989.4) * (4800.0 / 1008.0));
  EXPECT_NEAR(p.groups[0].efficiency, e, 1e-12);
  EXPECT_TRUE(p.groups[0].efficiency_estimate);
  EXPECT_NEAR(p.tokens_per_s, 165.2e12 * e / p.flops.per_token(), 1e-6);
  bool warned = false;
  for (const auto& w : p.warnings) warned |= w.rfind("speed on rtx4090 is an estimate", 0) == 0;
  EXPECT_TRUE(warned);
  // --efficiency replaces it on every card.
  in.efficiency = 0.35;
  EXPECT_NEAR(make_plan(in, Catalog::builtin()).tokens_per_s, 165.2e12 * 0.35 / p.flops.per_token(),
              1e-6);
  in.efficiency = 0;
  // Without checkpointing it still fits at 2 × 2048? The memory model's answer must agree with
  // the sum of its terms against 24564 MiB.
  in.setup.checkpointing = Checkpointing::none;
  auto q = make_plan(in, Catalog::builtin());
  EXPECT_EQ(q.fits, q.memory.total() <= 24564.0 * 1048576);
}

TEST(PlanScenario, Llama70BQloraOn4x4090Sharded) {
  PlanInput in = doc_70b_input();
  auto p = make_plan(in, Catalog::builtin());
  EXPECT_TRUE(p.fits) << p.to_text();
  // Weights per card: NF4 linears + bf16 embedding, head and norms, over 4 ranks. The document's
  // "~35GB (9GB/card)" counts the NF4 part only and leaves out ~4.2 GB of bf16 embedding + head.
  const double linear = 80.0 * (8192.0 * 8192 * 2 + 2 * 8192.0 * 1024 + 3 * 8192.0 * 28672);
  const double rest = 80.0 * 2 * 8192 + 2 * 128256.0 * 8192 + 8192;
  EXPECT_NEAR(p.memory.weights, (linear * nf4_bits_per_weight() / 8 + rest * 2) / 4, 1);
  EXPECT_NEAR(linear * nf4_bits_per_weight() / 8 / 1e9, 35.3, 0.1);  // the document's ~35 GB
  // 8-bit AdamW: 2 bytes per LoRA parameter (+ an fp32 absmax per 256 of each moment), not the
  // document's "fp32 m + v".
  EXPECT_NEAR(p.memory.optimizer, 828'375'040.0 * (2 + 8.0 / 256) / 4, 1);
  EXPECT_EQ(p.world, 4);
  // The same job does not fit one 4090.
  in.gpus = "1x4090";
  EXPECT_FALSE(make_plan(in, Catalog::builtin()).fits);
}

TEST(PlanSpeed, FlopsPerTokenByHand) {
  auto m = builtin_model("llama3-8b");
  TrainSetup s;
  s.seq_len = 4096;
  const double n_layers = 32.0 * (4096.0 * 4096 * 2 + 2 * 4096.0 * 1024 + 3 * 4096.0 * 14336);
  const double N = n_layers + 128256.0 * 4096;
  const double lora = 32.0 * 16 * (2 * 8192 + 2 * 5120);
  const double attn = 12.0 * 32 * 4096 * 4096;
  auto f = flops_per_token(m, s);  // qlora, full checkpointing
  EXPECT_DOUBLE_EQ(f.per_token(), 4 * N + 6 * lora + attn + 2 * n_layers + 2 * lora + attn / 3);
  s.method = Method::full;
  s.checkpointing = Checkpointing::none;
  EXPECT_DOUBLE_EQ(flops_per_token(m, s).per_token(), 6 * N + attn);
}

TEST(PlanComm, BusBandwidthAndTheDocumentsAllReduceTable) {
  // 1 GB all-reduce over 4 cards. The document divides size by bandwidth (41.7 ms at 24 GB/s),
  // which treats 24 GB/s as algbw; at 24 GB/s of link (bus) bandwidth it is 1.5× longer.
  EXPECT_NEAR(allreduce_seconds(1e9, 4, 24), 1e9 * 2 * 3 / 4 / 24e9, 1e-12);
  EXPECT_NEAR(allreduce_seconds(1e9, 4, 24), 0.0625, 1e-9);
  EXPECT_NEAR(allreduce_seconds(1e9, 4, 4.8), 0.3125, 1e-9);  // RoCE 40G: not 208 ms
  EXPECT_NEAR(allgather_seconds(1e9, 4, 24), 1e9 * 3 / 4 / 24e9, 1e-12);
  EXPECT_EQ(allreduce_seconds(1e9, 1, 24), 0);

  // Data-parallel LoRA on 4×4090 in a Z790: the slowest link is a gen4 x4 chipset slot.
  PlanInput in;
  in.model = builtin_model("llama3-8b");
  in.model_name = "llama3-8b";
  in.gpus = "4x4090";
  in.platform = "z790";
  auto p = make_plan(in, Catalog::builtin());
  EXPECT_NEAR(p.busbw_gbs, 4 * 1.969 * 0.75, 1e-9);
  const double grads = double(count_params(in.model, in.setup).lora_total()) * 2;
  EXPECT_NEAR(p.comm_s, grads * 1.5 / (4 * 1.969 * 0.75e9), 1e-9);
  EXPECT_NEAR(p.comm_share, p.comm_s / (p.comm_s + p.step_compute_s), 1e-12);
}

TEST(PlanPcie, PlatformLanes) {
  double uplink = 0;
  auto z = platform_links("z790", 4, &uplink);  // the document's x8/x8/x4/x4
  ASSERT_EQ(z.size(), 4u);
  EXPECT_EQ(z[0].width, 8);
  EXPECT_EQ(z[1].width, 8);
  EXPECT_EQ(z[2].width, 4);
  EXPECT_TRUE(z[3].via_chipset);
  EXPECT_NEAR(uplink, 8 * 1.969, 1e-12);
  EXPECT_EQ(platform_links("z790", 1, &uplink)[0].width, 16);
  EXPECT_THROW(platform_links("z790", 5, &uplink), rig::InputError);
  EXPECT_EQ(platform_links("w3300", 4, &uplink)[3].width, 16);
  // PCIe 4.0 x8 ≈ 16 GB/s per direction, as the document says.
  EXPECT_NEAR(pcie_lane_gbs(4) * 8, 15.75, 0.01);
  auto l = parse_pcie("gen4x16,gen4x8,gen3x4c", 3);
  EXPECT_EQ(l[2].gen, 3);
  EXPECT_TRUE(l[2].via_chipset);
  EXPECT_THROW(parse_pcie("gen4x3", 1), rig::InputError);
  auto g = parse_gpus("2x4090,1x3090");
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].count, 2);
  EXPECT_EQ(g[1].gpu, "3090");
}

TEST(PlanPower, TheDocuments1600WattSupply) {
  PlanInput in = doc_70b_input();
  in.psu_w = 1600;
  auto p = make_plan(in, Catalog::builtin());
  EXPECT_DOUBLE_EQ(p.sustained_w, 4 * 450 + 300);  // the document's 2100 W
  EXPECT_EQ(p.full_load_cards, 2);                 // floor((1600 - 300) / 450)
  bool warned = false;
  for (auto& w : p.warnings) warned |= w.find("cannot carry full load") != std::string::npos;
  EXPECT_TRUE(warned);
  EXPECT_DOUBLE_EQ(p.transient_w, 4 * 450 * 1.7 + 300);
  EXPECT_DOUBLE_EQ(p.psu_recommended_w, std::max(2100 * 1.3, (4 * 450 * 1.7 + 300) / 2));
  // The documents' 400 W limit: 4 × 50 W saved, throughput × (400/450)^0.2.
  in.power_limit_w = 400;
  auto q = make_plan(in, Catalog::builtin());
  EXPECT_DOUBLE_EQ(q.power_saving_w, 200);
  EXPECT_DOUBLE_EQ(q.sustained_w, 4 * 400 + 300);
  EXPECT_NEAR(q.groups[0].tflops, 165.2 * q.groups[0].efficiency * std::pow(400.0 / 450, 0.2),
              1e-9);
  EXPECT_NEAR(q.groups[0].tflops / p.groups[0].tflops, std::pow(400.0 / 450, 0.2), 1e-12);
}

TEST(PlanReliability, FitArithmeticAndYoungDaly) {
  PlanInput in = doc_70b_input();
  in.job_hours = 65 * 24;  // the document's 65-day 70B run
  in.checkpoint_seconds = 30;
  auto p = make_plan(in, Catalog::builtin());
  // 1500 FIT/GB × 24 GB = 36,000 FIT: one error per 1e9/36000 = 27,778 h, not the document's
  // 3,174 h; four cards: 6,944 h, not ~800 h.
  EXPECT_DOUBLE_EQ(p.fit_total, 4 * 1500 * 24);
  EXPECT_NEAR(p.mtbf_hours, 1e9 / 144000, 1e-9);
  EXPECT_NEAR(1e9 / 36000, 27778, 1);
  EXPECT_NEAR(p.expected_bit_errors, 144000 * 1560 / 1e9, 1e-12);
  EXPECT_NEAR(p.p_bit_error, 1 - std::exp(-0.22464), 1e-5);
  EXPECT_NEAR(p.young_daly_s, std::sqrt(2 * 30 * (1e9 / 144000) * 3600), 1e-6);
  // Other failures add their rate: 1/MTBF = 1/6944 + 1/500.
  in.other_mtbf_hours = 500;
  auto q = make_plan(in, Catalog::builtin());
  EXPECT_NEAR(q.failure_mtbf_hours, 1 / (144000 / 1e9 + 1.0 / 500), 1e-9);
  // ECC cards: no silent errors counted.
  in.gpus = "4xa100-40gb";
  in.platform.clear();
  EXPECT_EQ(make_plan(in, Catalog::builtin()).fit_total, 0);
}

TEST(PlanCost, TheDocumentsCloudComparison) {
  // Section 6.1: ¥75,000 node, 70B QLoRA in 65 days; 4×A100 cloud does it in 12 days. The
  // document bills the cloud for 90 days (¥216,000 = 2160 h × 4 × ¥25) though the job takes 12.
  PlanInput in = doc_70b_input();
  in.currency = "CNY";
  in.hardware_cost = 75000;
  in.resale_fraction = 0;
  in.kwh_price = 0.6;
  in.job_hours = 65 * 24;
  in.cloud_gpu = "a100-40gb";
  in.cloud_price = 216000.0 / (90 * 24 * 4);  // ¥25 per GPU-hour, from the document
  in.cloud_job_hours = 12 * 24;
  auto p = make_plan(in, Catalog::builtin());
  EXPECT_NEAR(p.cloud_price, 25, 1e-12);
  EXPECT_NEAR(p.cloud_total, 288 * 4 * 25, 1e-6);  // ¥28,800, not ¥216,000
  EXPECT_NEAR(p.electricity, 2.1 * 1560 * 0.6, 1e-6);
  EXPECT_NEAR(p.buy_total, 75000 + 2.1 * 1560 * 0.6, 1e-6);
  // Break-even: H · (28,800/1560 − 2.1·0.6) = 75,000 → about 4,400 h (~6 months of own
  // running), not "about 2 months".
  const double H = 75000 / (28800.0 / 1560 - 2.1 * 0.6);
  EXPECT_NEAR(p.break_even_hours, H, 1e-6);
  EXPECT_GT(H / 24, 180);
  // With half the hardware resold it halves.
  in.resale_fraction = 0.5;
  EXPECT_NEAR(make_plan(in, Catalog::builtin()).break_even_hours, H / 2, 1e-6);
}

TEST(PlanCatalog, FileMatchesCompiledInAndOverrides) {
  std::string file = rig::read_file(std::string(RIG_SOURCE_DIR) + "/configs/catalog/gpus.yaml");
  EXPECT_EQ(file, builtin_catalog_yaml()) << "regenerate src/rig/plan/catalog_data.cpp";
  auto c = Catalog::builtin();
  for (const char* k :
       {"rtx3090", "rtx4090", "rtx5090", "a6000", "l40s", "a100-40gb", "a100-80gb", "h100", "h200"})
    EXPECT_NO_THROW(c.find(k)) << k;
  EXPECT_EQ(c.find("4090").key, "rtx4090");
  EXPECT_EQ(c.find("RTX 4090").key, "rtx4090");
  EXPECT_FALSE(c.find("4090").p2p);
  // Section 1.1's bandwidths are right; its "82.6 TFLOPS" is the 4090's non-tensor rate, the
  // tensor-core bf16 rate with fp32 accumulate is twice that.
  EXPECT_EQ(c.find("4090").bandwidth_gbs, 1008);
  EXPECT_EQ(c.find("a100-40gb").bandwidth_gbs, 1555);
  EXPECT_EQ(c.find("h100").bandwidth_gbs, 3350);
  EXPECT_NEAR(c.find("4090").bf16_tflops, 2 * 82.6, 0.01);
  EXPECT_EQ(c.find("a100-40gb").tdp_w, 400);  // SXM4, not the table's 300 W
  c.merge_yaml(
      "gpus:\n  rtx4090:\n    price_usd: 1800\n  mycard:\n    memory_mib: 1000\n"
      "    bf16_tflops: 10\n    tdp_w: 100\n",
      "user.yaml");
  EXPECT_EQ(c.find("4090").price_usd, 1800);
  EXPECT_EQ(c.find("4090").tdp_w, 450);  // untouched fields stay
  EXPECT_EQ(c.find("mycard").bf16_tflops, 10);
  try {
    c.merge_yaml("gpus:\n  x:\n    memroy_mib: 3\n", "bad.yaml");
    FAIL();
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.yaml: gpus.x: unknown field 'memroy_mib' (line 3)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(c.find("voodoo5"), rig::InputError);
}

TEST(PlanCli, JsonAndErrors) {
  auto r = rig::test::run_rig("plan --model llama3-8b --gpus 2x4090,1x3090 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["setup"]["world_size"], 3);
  EXPECT_EQ(j["gpus"].size(), 2u);
  for (const char* k : {"weights", "lora", "gradients", "master", "optimizer", "activations",
                        "logits", "comm_buffers", "workspace"})
    EXPECT_TRUE(j["memory"]["per_gpu_bytes"].contains(k)) << k;
  // The 3090 (71 TFLOPS) sets the pace of the mixed set, at its own (estimated) efficiency.
  EXPECT_EQ(j["gpus"][1]["gpu"], "rtx3090");
  const double e3090 = j["gpus"][1]["efficiency"].get<double>();
  EXPECT_GT(e3090, 0.3);
  EXPECT_LT(e3090, 1);
  EXPECT_EQ(j["speed"]["efficiency"], e3090);
  EXPECT_NEAR(j["speed"]["step_compute_s"].get<double>(),
              2048 / (71e12 * e3090 / j["speed"]["flops_per_token"]["total"].get<double>()), 1e-9);
  auto bad = rig::test::run_rig("plan --gpus 4xvoodoo5");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.out.find("rig: GPU 'voodoo5' is not in the catalog"), std::string::npos) << bad.out;
  auto txt = rig::test::run_rig(
      "plan --model llama3-70b --gpus 4x4090 --strategy sharded "
      "--rank 64 --targets all --optimizer adamw8bit --psu 1600");
  EXPECT_EQ(txt.code, 0);
  EXPECT_NE(txt.out.find("PSU 1600 W cannot carry full load 2100 W"), std::string::npos) << txt.out;
}

// --config plans the job a training config describes: the same numbers as the flags that say
// the same, flags still winning.
TEST(PlanCli, ConfigFillsTheJobAndFlagsWin) {
  const std::string cfg = std::string(RIG_SOURCE_DIR) + "/configs/llama3-8b-qlora-24gb.yaml";
  auto from_cfg = rig::test::run_rig("plan --config " + cfg + " --json");
  ASSERT_EQ(from_cfg.code, 0) << from_cfg.out;
  auto by_flags = rig::test::run_rig(
      "plan --model llama3-8b --method qlora --rank 64 --targets all --seq 4096 --micro-batch 2 "
      "--grad-accum 8 --checkpointing full --optimizer adamw --strategy ddp --max-memory 22GiB "
      "--json");
  ASSERT_EQ(by_flags.code, 0) << by_flags.out;
  auto a = nlohmann::json::parse(from_cfg.out), b = nlohmann::json::parse(by_flags.out);
  EXPECT_EQ(a["memory"], b["memory"]);
  EXPECT_EQ(a["setup"], b["setup"]);
  auto seq = rig::test::run_rig("plan --config " + cfg + " --seq 1024 --json");
  ASSERT_EQ(seq.code, 0) << seq.out;
  EXPECT_EQ(nlohmann::json::parse(seq.out)["setup"]["seq_len"], 1024);
  auto bad = rig::test::run_rig("plan --config " + std::string(RIG_SOURCE_DIR) + "/README.md");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.out.find("README.md"), std::string::npos) << bad.out;
}

// Every shipped recipe fits the max_memory it sets on the cards it is written for, by the
// planner's prediction with 10% to spare (the planner has been 6-8% under rig's measured
// reserved peaks: docs/plan.md). Two recipes overran their budget before this check.
TEST(PlanCli, EveryRecipeFitsItsOwnBudget) {
  const std::map<std::string, std::string> gpus = {
      {"llama3-8b-lora-24gb.yaml", "1x4090"},
      {"llama3-8b-qlora-24gb.yaml", "1x4090"},
      {"qwen3-8b-qlora-24gb.yaml", "1x4090"},
      {"llama3-70b-qlora-4x24gb.yaml", "4x4090"},
  };
  size_t seen = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(RIG_SOURCE_DIR) + "/configs")) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".yaml" || name == "demo.yaml") continue;
    ++seen;
    auto it = gpus.find(name);
    ASSERT_NE(it, gpus.end()) << name << ": a new recipe; add it here with the cards it is for";
    auto r = rig::test::run_rig("plan --config " + e.path().string() + " --gpus " + it->second +
                                " --json");
    ASSERT_EQ(r.code, 0) << name << ": " << r.out;
    auto j = nlohmann::json::parse(r.out);
    const double peak = j["memory"]["allocator_peak"].get<double>();
    const double budget = j["gpus"][0]["budget_bytes"].get<double>();
    EXPECT_LT(budget, 23.0 * (1ull << 30)) << name << " sets no max_memory";
    EXPECT_LE(1.10 * peak, budget) << name << ": rig plan predicts " << peak / (1ull << 30)
                                   << " GiB against max_memory " << budget / (1ull << 30);
  }
  EXPECT_EQ(seen, gpus.size());
}

// ---- Speed from measured efficiency, and --calibrate -----------------------------------------

namespace {

// A `rig bench train --json` line as today's rig writes it for llama3-8b LoRA r16 q,k,v,o at
// 4096 × 2 with full checkpointing on 10 layers (numbers invented, fields as cmd_bench_train.cpp).
nlohmann::json bench_line(double tokens_per_s, const std::string& gpu = "NVIDIA H200") {
  auto m = builtin_model("llama3-8b");
  TrainSetup s;
  s.method = Method::lora;
  const auto c = count_params(m, s);
  nlohmann::json j = {{"device", "cuda:0"},
                      {"gpu", gpu},
                      {"config", m.to_json()},
                      {"precision", "bf16"},
                      {"method", "lora"},
                      {"lora_r", 16},
                      {"lora_targets", "q_proj,k_proj,v_proj,o_proj"},
                      {"parameters", c.total() + c.lora_total()},
                      {"trainable_parameters", c.lora_total()},
                      {"batch", 2},
                      {"seq", 4096},
                      {"packed", 0},
                      {"attention_len", 4096.0},
                      {"checkpointing", "full"},
                      {"recompute_layers", 10},
                      {"optimizer", "adamw"},
                      {"tokens_per_s", tokens_per_s},
                      {"step_ms", 8192e3 / tokens_per_s}};
  if (gpu.empty()) j.erase("gpu");
  return j;
}

std::string write_lines(const std::string& name, const std::vector<std::string>& lines) {
  const std::string path = rig::test::temp_dir("plan_calibrate") + "/" + name;
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  rig::write_file_atomic(path, text);
  return path;
}

PlanInput row0_on(const std::string& gpus) {
  PlanInput in;
  in.model = builtin_model("llama3-8b");
  in.model_name = "llama3-8b";
  in.setup.method = Method::lora;
  in.setup.seq_len = 4096;
  in.setup.micro_batch = 2;
  in.setup.checkpointing = Checkpointing::full;
  in.setup.recompute_layers = 10;
  in.gpus = gpus;
  return in;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const rig::InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

}  // namespace

TEST(PlanCalibrate, GoodLineGivesTokensTimesFlopsOverPeak) {
  const auto c = Catalog::builtin();
  const std::string path = write_lines("good.jsonl", {bench_line(12000).dump()});
  auto m = read_calibration(path, Method::lora, "rtx4090", c);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].gpu, "h200");  // the record's card, not the default
  // FLOPs per token of the run by hand (plan_test's FlopsPerTokenByHand terms): 4N + 6·lora +
  // attention + 10/32 of (2·N_layers + 2·lora + attention forward).
  const double n_layers = 32.0 * (4096.0 * 4096 * 2 + 2 * 4096.0 * 1024 + 3 * 4096.0 * 14336);
  const double N = n_layers + 128256.0 * 4096;
  const double lora = 32.0 * 16 * (2 * 8192 + 2 * 5120);
  const double attn = 12.0 * 32 * 4096 * 4096;
  const double fpt = 4 * N + 6 * lora + attn + 10.0 / 32 * (2 * n_layers + 2 * lora + attn / 3);
  EXPECT_NEAR(m[0].efficiency, 12000 * fpt / 989.4e12, 1e-12);
  EXPECT_NE(m[0].source.find(path + ":1"), std::string::npos) << m[0].source;
  // No breakdown in the line: the memory share is the built-in table's for LoRA.
  EXPECT_EQ(m[0].memory_share, builtin_efficiencies()[0].memory_share);
  // A line without "gpu" is taken as the default card (and says so).
  auto d = read_calibration(write_lines("nogpu.jsonl", {bench_line(3000, "").dump()}), Method::lora,
                            "rtx4090", c);
  EXPECT_EQ(d[0].gpu, "rtx4090");
  EXPECT_NEAR(d[0].efficiency, 3000 * fpt / 165.2e12, 1e-12);
  EXPECT_NE(d[0].source.find("names no GPU"), std::string::npos) << d[0].source;
  // Driver names find their catalog card.
  for (auto [name, key] :
       {std::pair{"NVIDIA H100 80GB HBM3", "h100"}, std::pair{"NVIDIA GeForce RTX 4090", "rtx4090"},
        std::pair{"NVIDIA GeForce RTX 3090", "rtx3090"},
        std::pair{"NVIDIA A100-SXM4-40GB", "a100-40gb"},
        std::pair{"NVIDIA A100 80GB PCIe", "a100-80gb"}, std::pair{"NVIDIA RTX A6000", "a6000"},
        std::pair{"NVIDIA L40S", "l40s"}}) {
    auto r = read_calibration(write_lines("name.jsonl", {bench_line(500, name).dump()}),
                              Method::lora, "h200", c);
    EXPECT_EQ(r[0].gpu, key) << name;
  }
  // The old records (no config, no gpu, checkpointing as a boolean) read through the parameter
  // count; several lines are several measurements.
  auto old = bench_line(10000, "");
  old.erase("config");
  old.erase("recompute_layers");
  old["checkpointing"] = true;
  auto two = read_calibration(write_lines("two.jsonl", {old.dump(), "", bench_line(9000).dump()}),
                              Method::lora, "h200", c);
  ASSERT_EQ(two.size(), 2u);
  const double fpt_all = 4 * N + 6 * lora + attn + 2 * n_layers + 2 * lora + attn / 3;
  EXPECT_NEAR(two[0].efficiency, 10000 * fpt_all / 989.4e12, 1e-12);
  EXPECT_NE(two[1].source.find(":3 "), std::string::npos) << two[1].source;
}

TEST(PlanCalibrate, BadInputNamesFileAndLine) {
  const auto c = Catalog::builtin();
  auto read = [&](const std::string& path, Method m = Method::lora) {
    return error_of([&] { read_calibration(path, m, "h200", c); });
  };
  const std::string good = bench_line(12000).dump();
  // Missing file.
  EXPECT_EQ(read("/nonexistent/bench.jsonl"),
            "calibration file /nonexistent/bench.jsonl: no such file");
  // Malformed JSON on line 3 (line 2 blank).
  std::string p = write_lines("malformed.jsonl", {good, "", "{\"tokens_per_s\": 1,"});
  EXPECT_EQ(read(p).rfind(p + ":3: not a JSON line: parse error", 0), 0u) << read(p);
  // Not a bench train record: transformers' line of bench/rig_vs_hf.sh.
  p = write_lines("hf.jsonl", {R"({"row": 0, "side": "hf", "preset": "llama3-8b", "mode": "lora",)"
                               R"( "seq": 4096, "bs": 2, "tokens_per_s": 9314})"});
  EXPECT_EQ(read(p).rfind(p + ":1: not a `rig bench train --json` record (no 'method')", 0), 0u)
      << read(p);
  p = write_lines("array.jsonl", {"[1, 2]"});
  EXPECT_EQ(read(p), p + ":1: expected a JSON object, got array");
  // A record of another method.
  p = write_lines("method.jsonl", {good});
  EXPECT_EQ(read(p, Method::full).rfind(p + ":1: a lora record; this plan is for --method full", 0),
            0u)
      << read(p, Method::full);
  // A CPU record, a failed run, a card the catalog does not know, a number that is not one.
  auto cpu = bench_line(100);
  cpu["device"] = "cpu";
  p = write_lines("cpu.jsonl", {good, cpu.dump()});
  EXPECT_EQ(read(p).rfind(p + ":2: measured on the CPU", 0), 0u) << read(p);
  auto failed = bench_line(12000);
  failed["rc"] = 1;
  EXPECT_EQ(read(write_lines("rc.jsonl", {failed.dump()})).find("the run failed (rc 1)") !=
                std::string::npos,
            true);
  p = write_lines("b200.jsonl", {bench_line(12000, "NVIDIA B200").dump()});
  EXPECT_EQ(read(p).rfind(p + ":1: GPU 'NVIDIA B200' is not in the catalog", 0), 0u) << read(p);
  auto text = bench_line(12000);
  text["tokens_per_s"] = "fast";
  p = write_lines("text.jsonl", {text.dump()});
  EXPECT_EQ(read(p), p + ":1: 'tokens_per_s' is \"fast\", expected a number");
  // Faster than the card's peak: the record is from another card.
  p = write_lines("fast.jsonl", {bench_line(90000, "NVIDIA GeForce RTX 4090").dump()});
  EXPECT_NE(read(p).find("% of rtx4090's dense bf16 peak"), std::string::npos) << read(p);
  // An empty file.
  p = write_lines("empty.jsonl", {"", " "});
  EXPECT_EQ(read(p), "calibration file " + p + ": no records (it is empty)");
}

TEST(PlanSpeed, TokensPerSecondIsLinearInTheCalibratedEfficiency) {
  const auto c = Catalog::builtin();
  PlanInput in = row0_on("1xh200");
  in.calibration = read_calibration(write_lines("one.jsonl", {bench_line(5000).dump()}),
                                    Method::lora, "h200", c);
  const Plan p1 = make_plan(in, c);
  // Closed form: one card, no communication: tokens/s = peak × efficiency / FLOPs per token,
  // and the measured run had this plan's configuration, so the plan gives back its tokens/s.
  EXPECT_NEAR(p1.tokens_per_s, 989.4e12 * in.calibration[0].efficiency / p1.flops.per_token(),
              1e-6);
  EXPECT_NEAR(p1.tokens_per_s, 5000, 1e-6);
  EXPECT_NE(p1.groups[0].efficiency_source.find("calibrated"), std::string::npos);
  // Twice the measured tokens/s: twice the efficiency, twice the plan's tokens/s.
  in.calibration = read_calibration(write_lines("two.jsonl", {bench_line(10000).dump()}),
                                    Method::lora, "h200", c);
  EXPECT_NEAR(make_plan(in, c).tokens_per_s / p1.tokens_per_s, 2, 1e-12);
  // Two lines on the card: their mean.
  in.calibration = read_calibration(
      write_lines("mean.jsonl", {bench_line(5000).dump(), bench_line(10000).dump()}), Method::lora,
      "h200", c);
  EXPECT_NEAR(make_plan(in, c).tokens_per_s, 7500, 1e-6);
  // Another configuration on the same card keeps the efficiency, not the tokens/s.
  in.setup.checkpointing = Checkpointing::none;
  const Plan p3 = make_plan(in, c);
  EXPECT_NEAR(p3.tokens_per_s * p3.flops.per_token() / (7500 * p1.flops.per_token()), 1, 1e-12);
  // A calibration on the H200 carries to a 4090 as the built-in table's does (an estimate).
  in.setup.checkpointing = Checkpointing::full;
  in.gpus = "1x4090";
  const Plan p4 = make_plan(in, c);
  MeasuredEfficiency ref = in.calibration[0];
  ref.efficiency = (in.calibration[0].efficiency + in.calibration[1].efficiency) / 2;
  EXPECT_NEAR(p4.groups[0].efficiency, extrapolate_efficiency(ref, c.find("h200"), c.find("4090")),
              1e-12);
  EXPECT_TRUE(p4.groups[0].efficiency_estimate);
  // Without a calibration the built-in table's H200 entry: measured, not an estimate.
  in.calibration.clear();
  in.gpus = "1xh200";
  const Plan p5 = make_plan(in, c);
  EXPECT_EQ(p5.groups[0].efficiency, builtin_efficiencies()[0].efficiency);
  EXPECT_FALSE(p5.groups[0].efficiency_estimate);
  EXPECT_NE(p5.groups[0].efficiency_source.find("measured"), std::string::npos);
}

TEST(PlanSpeed, ExtrapolationByPeakAndBandwidth) {
  const auto c = Catalog::builtin();
  MeasuredEfficiency ref{"h200", Method::lora, 0.5, 0.2, "test"};
  // e = 0.5 / (0.8 + 0.2 · (165.2/989.4) · (4800/1008))
  EXPECT_NEAR(extrapolate_efficiency(ref, c.find("h200"), c.find("4090")),
              0.5 / (0.8 + 0.2 * (165.2 / 989.4) * (4800.0 / 1008)), 1e-15);
  // The H100: the same peak, less bandwidth: a little less.
  EXPECT_NEAR(extrapolate_efficiency(ref, c.find("h200"), c.find("h100")),
              0.5 / (0.8 + 0.2 * 4800.0 / 3350), 1e-15);
  // Nothing memory-bound: the same fraction of peak everywhere.
  ref.memory_share = 0;
  EXPECT_EQ(extrapolate_efficiency(ref, c.find("h200"), c.find("3090")), 0.5);
}

TEST(PlanInputChecks, NanAndInfAreRefusedNamingTheField) {
  const auto c = Catalog::builtin();
  auto err = [&](const std::function<void(PlanInput&)>& set) {
    PlanInput in = row0_on("1xh200");
    set(in);
    return error_of([&] { make_plan(in, c); });
  };
  EXPECT_EQ(err([](PlanInput& in) { in.efficiency = NAN; }),
            "plan input efficiency: nan is not a finite number");
  EXPECT_EQ(err([](PlanInput& in) { in.overlap = INFINITY; }),
            "plan input overlap: inf is not a finite number");
  EXPECT_EQ(err([](PlanInput& in) { in.pcie_efficiency = -INFINITY; }),
            "plan input pcie_efficiency: -inf is not a finite number");
  EXPECT_EQ(err([](PlanInput& in) { in.tokens = NAN; }),
            "plan input tokens: nan is not a finite number");
  EXPECT_EQ(err([](PlanInput& in) { in.kwh_price = NAN; }),
            "plan input kwh_price: nan is not a finite number");
  EXPECT_EQ(err([](PlanInput& in) { in.power_perf_exponent = INFINITY; }),
            "plan input power_perf_exponent: inf is not a finite number");
  EXPECT_EQ(err([](PlanInput& in) { in.efficiency = 1.5; }),
            "plan input efficiency: 1.5 is not in (0, 1] (0: the measured one)");
  EXPECT_EQ(err([](PlanInput& in) { in.overlap = -0.1; }),
            "plan input overlap: -0.1 is not in [0, 1]");
  EXPECT_EQ(err([](PlanInput& in) {
              in.calibration = {{"h200", Method::lora, NAN, 0.2, "x.jsonl:1"}};
            }),
            "plan input calibration efficiency (x.jsonl:1): nan is not in (0, 1]");
  EXPECT_EQ(err([](PlanInput& in) {
              in.calibration = {{"h200", Method::lora, 0.5, INFINITY, "x.jsonl:1"}};
            }),
            "plan input calibration memory_share (x.jsonl:1): inf is not in [0, 1]");
  EXPECT_EQ(err([](PlanInput& in) { in.setup.context_bytes = NAN; }),
            "train setup context_bytes: nan is not a finite number >= 0");
  EXPECT_EQ(err([](PlanInput& in) {
              in.network = "roce:nan";
              in.nodes = 2;
            }),
            "--network 'roce:nan': 'nan' is not a finite number");
  // The catalog's numbers too.
  Catalog bad = c;
  EXPECT_EQ(error_of([&] { bad.merge_yaml("gpus:\n  h200:\n    bf16_tflops: .nan\n", "my.yaml"); }),
            "my.yaml: gpus.h200: field 'bf16_tflops' (line 3): expected a finite number");
}

TEST(PlanCli, Calibrate) {
  const std::string good = write_lines("cli-good.jsonl", {bench_line(5000).dump()});
  auto r = rig::test::run_rig(
      "plan --model llama3-8b --method lora --seq 4096 -b 2 "
      "--recompute-layers 10 --gpus h200 --json --calibrate " +
      good);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_NEAR(j["speed"]["tokens_per_s"].get<double>(), 5000, 1e-6);
  EXPECT_NE(j["speed"]["efficiency_source"].get<std::string>().find("calibrated: " + good + ":1"),
            std::string::npos);
  auto missing = rig::test::run_rig("plan --method lora --calibrate /nonexistent/b.jsonl");
  EXPECT_EQ(missing.code, 1);
  EXPECT_EQ(missing.out, "rig: calibration file /nonexistent/b.jsonl: no such file\n");
  auto other = rig::test::run_rig("plan --method full --calibrate " + good);
  EXPECT_EQ(other.code, 1);
  EXPECT_EQ(
      other.out.rfind("rig: " + good + ":1: a lora record; this plan is for --method full", 0), 0u)
      << other.out;
  auto both = rig::test::run_rig("plan --method lora --efficiency 0.3 --calibrate " + good);
  EXPECT_NE(both.code, 0);
  EXPECT_NE(both.out.find("excludes"), std::string::npos) << both.out;
  // The text names where the efficiency came from.
  auto txt = rig::test::run_rig("plan --model llama3-8b --gpus 1x4090");
  EXPECT_EQ(txt.code, 0);
  EXPECT_NE(txt.out.find("estimate: rtx4090 not measured"), std::string::npos) << txt.out;
}
