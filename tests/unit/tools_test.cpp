// rig generate / eval / merge through the CLI.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/ops/profile.h"
#include "test_util.h"

using namespace rig;

TEST(Tools, MergeMatchesAdapterLogitsAndEvalRuns) {
  const std::string dir = test::temp_dir("merge");
  const std::string model = test::data_path("hf/tiny-llama3/model"), adapter = test::data_path("hf/tiny-llama3/lora_adapter");
  auto r = test::run_rig("merge --model " + model + " --adapter " + adapter + " --out " + dir + "/merged");
  ASSERT_EQ(r.code, 0) << r.out;
  // PEFT's logits for the adapter on the fixture batch, reproduced by the merged model.
  auto ref = SafeTensorsFile::open(test::data_path("hf/tiny-llama3/lora_forward_backward.safetensors"));
  auto fb = SafeTensorsFile::open(test::data_path("hf/tiny-llama3/forward_backward.safetensors"));
  auto m = LlamaModel::load(dir + "/merged");
  Tensor logits;
  StepOptions so;
  so.backward = false;
  so.logits = &logits;
  m->step(TokenBatch{fb.get("input_ids").clone(), fb.get("labels").clone(), {}, {}}, so);
  Tensor want = ref.get_f32("logits");
  double num = 0, den = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    double d = logits.f32()[i] - want.f32()[i];
    num += d * d;
    den += double(want.f32()[i]) * want.f32()[i];
  }
  EXPECT_LT(std::sqrt(num / den), 1e-5);
  r = test::run_rig("merge --model " + model + " --adapter " + dir + "/missing --out " + dir + "/x");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("adapter_config.json"), std::string::npos) << r.out;
}

TEST(Tools, GenerateAndEvalOnTheDemoTokenizer) {
  // A random model: the commands must run and report, whatever they generate.
  const std::string dir = test::temp_dir("gen");
  auto m = LlamaModel::random(ModelConfig::from_json({{"model_type", "llama"}, {"vocab_size", 264}, {"hidden_size", 32},
                                                      {"intermediate_size", 64}, {"num_hidden_layers", 1},
                                                      {"num_attention_heads", 2}}, "t"), 1);
  m->save_pretrained(dir + "/m");
  const std::string tok = std::string(RIG_SOURCE_DIR) + "/data/demo/tokenizer.json";
  auto r = test::run_rig("generate --model " + dir + "/m --tokenizer " + tok + " --prompt 'reverse abc' --max-new-tokens 5");
  EXPECT_EQ(r.code, 0) << r.out;
  r = test::run_rig("eval --model " + dir + "/m --tokenizer " + tok + " --data " + RIG_SOURCE_DIR +
                    "/data/demo/reverse.jsonl --seq 64 --batch 64");
  EXPECT_EQ(r.code, 0) << r.out;
  // An untrained model over 264 tokens: perplexity near the vocabulary size.
  double loss = std::stod(r.out.substr(r.out.find("loss ") + 5));
  EXPECT_NEAR(loss, std::log(264.0), 0.5) << r.out;
}

TEST(Tools, BenchTrainRejectsSizesBelowOne) {
  // No timed steps would divide 0 tokens by 0 seconds; a negative size would reach the tensor
  // allocator. Both are one line naming the flag, and a non-zero exit.
  const std::vector<std::pair<std::string, std::string>> tiny = {
      {"--hidden", "32"},       {"--layers", "1"},
      {"--heads", "2"},         {"--kv-heads", "1"},
      {"--intermediate", "64"}, {"--vocab", "64"},
      {"--batch", "1"},         {"--seq", "8"},
      {"--steps", "1"},         {"--loss-chunk-rows", "1024"}};
  auto args = [&](const std::string& flag, const std::string& value) {
    std::string a = "bench train";
    for (const auto& [f, v] : tiny) a += " " + f + " " + (f == flag ? value : v);
    return a;
  };
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--steps", "0"},
                                                        {"--seq", "-5"},
                                                        {"--batch", "0"},
                                                        {"--layers", "0"},
                                                        {"--loss-chunk-rows", "0"}}) {
    auto r = test::run_rig(args(flag, value));
    EXPECT_NE(r.code, 0) << flag << ": " << r.out;
    EXPECT_EQ(r.out.rfind("rig bench train: " + flag + " must be a whole number from 1 to ", 0), 0u)
        << flag << ": " << r.out;
    EXPECT_NE(r.out.find(", got " + value + "\n"), std::string::npos) << flag << ": " << r.out;
    EXPECT_EQ(r.out.find("nan"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find(".cpp"), std::string::npos) << "an internal check: " << r.out;
  }
  auto ok = test::run_rig(args("", ""));
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("tokens/s"), std::string::npos) << ok.out;
}

TEST(Tools, BenchTrainPacksRowsAsRigTrainDoes) {
  const std::string shape =
      "bench train --hidden 32 --layers 2 --heads 2 --kv-heads 1 --intermediate 64 --vocab 64 "
      "--batch 2 --seq 64 --steps 1 --json";
  auto plain = test::run_rig(shape);
  auto packed = test::run_rig(shape + " --packed 8");
  ASSERT_EQ(plain.code, 0) << plain.out;
  ASSERT_EQ(packed.code, 0) << packed.out;
  const auto p = nlohmann::json::parse(plain.out.substr(plain.out.find('{')));
  const auto q = nlohmann::json::parse(packed.out.substr(packed.out.find('{')));
  EXPECT_EQ(p["packed"], 0);
  EXPECT_EQ(p["attention_len"].get<double>(), 64.0);
  EXPECT_EQ(q["packed"], 8);
  // Documents of 1..15 tokens: a token attends over sum(L^2) / sum(L) of them, about 10.
  EXPECT_GT(q["attention_len"].get<double>(), 5.0);
  EXPECT_LT(q["attention_len"].get<double>(), 15.0);
  // Same tokens; segments, positions and the targets at document starts change the loss.
  for (const auto& l : q["losses"]) EXPECT_TRUE(std::isfinite(l.get<double>()));
  EXPECT_NE(p["losses"][0].get<double>(), q["losses"][0].get<double>());
  EXPECT_LT(q["tflops"].get<double>() / q["tokens_per_s"].get<double>(),
            p["tflops"].get<double>() / p["tokens_per_s"].get<double>());
  for (const std::string v : {"-3", "1"}) {  // 1: one-token documents, nothing to train
    auto bad = test::run_rig(shape + " --packed " + v);
    EXPECT_NE(bad.code, 0) << bad.out;
    EXPECT_EQ(bad.out,
              "rig bench train: --packed must be 0 (whole rows) or a whole number from 2 to "
              "16777216, got " +
                  v + "\n");
  }
}

TEST(Tools, BenchTrainProfileBreaksTheStepDownPerOp) {
  // The per-op table that bench/op_table.py reads: every recorded op with its time and calls.
  auto r = test::run_rig(
      "bench train --hidden 32 --layers 2 --heads 2 --kv-heads 1 --intermediate 64 --vocab 64 "
      "--batch 1 "
      "--seq 8 --steps 1 --json --profile");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  const auto& ops = j.at("breakdown").at("ops");
  ASSERT_TRUE(ops.contains("attention_forward")) << ops.dump();
  EXPECT_EQ(ops["attention_forward"]["calls"].get<int>(), 2);  // one per layer
  EXPECT_GT(ops["attention_forward"]["ms"].get<double>(), 0.0);
  double total = 0;
  for (const auto& [op, v] : ops.items()) total += v["ms"].get<double>();
  EXPECT_LE(total, j["breakdown"]["step_ms"].get<double>() * 1.01);
  const double between = j["breakdown"]["between_ops_ms"].get<double>();
  EXPECT_GE(between, 0.0);
  EXPECT_LE(between, j["breakdown"]["step_ms"].get<double>());
}

TEST(Tools, ProfileCountsTheTimeBetweenOps) {
  // Overlapping and nested spans cover their union; the uncovered stretches are the gaps.
  ops::Profile p;
  for (auto [a, b] : {std::pair{3.0, 4.0}, {0.0, 1.0}, {0.5, 2.0}, {3.5, 3.6}, {5.0, 6.0}})
    p.spans.push_back({"op", "matmul", a, b});
  EXPECT_DOUBLE_EQ(p.between_ops_ms(), 1.0 + 1.0);
  EXPECT_EQ(ops::Profile{}.between_ops_ms(), 0.0);
}
