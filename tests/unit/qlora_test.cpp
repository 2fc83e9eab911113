// QLoRA on the CPU against tests/data/bnb-nf4 (made by bitsandbytes 0.50.1 and transformers 5.17):
// a bitsandbytes 4-bit folder loads and runs as bitsandbytes decodes it, quantizing while loading
// and `rig quantize` reproduce transformers' files byte for byte, LoRA on 4-bit weights is LoRA on
// the dequantized weights, and the tools (inspect, debug forward-backward, merge, train) work on
// it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/train/metrics.h"
#include "rig/train/train_config.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string fix(const std::string& rel) {
  return test::data_path("bnb-nf4/" + rel);
}
const std::string kBnb = fix("tiny_llama_bnb4"), kBf16 = fix("tiny_llama_bf16");

const SafeTensorsFile& reference() {
  static const SafeTensorsFile f = SafeTensorsFile::open(fix("tiny_llama_reference.safetensors"));
  return f;
}

TokenBatch ref_batch() {
  Tensor ids = reference().get("input_ids").clone();
  return TokenBatch{ids, ids.clone(), {}, {}};
}

Tensor logits_of(LlamaModel& m, const TokenBatch& b) {
  Tensor logits;
  StepOptions o;
  o.backward = false;
  o.logits = &logits;
  m.step(b, o);
  return logits;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double d = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    d = std::max(d, std::fabs(double(a.f32()[i]) - b.f32()[i]));
  return d;
}

double rel_err(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.f32()[i]) - b.f32()[i];
    num += d * d;
    den += double(b.f32()[i]) * b.f32()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

std::string file_bytes(const std::string& p) {
  return read_file(p);
}

// LoRA on all seven projections with B set non-zero (deterministically), so gradients flow
// through the base weights into A.
void add_test_lora(LlamaModel& m, float dropout = 0.0f) {
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
  lc.dropout = dropout;
  lc.targets = kProjections;
  m.add_lora(lc, 11);
  int k = 0;
  for (auto& p : m.params()) {
    if (p.name.find("lora_B") == std::string::npos) continue;
    ++k;
    for (int64_t i = 0; i < p.value.numel(); ++i)
      p.value.f32()[i] = 0.02f * std::sin(0.37f * float(i) + float(k));
  }
}

// The 14 quantized linear weights of the tiny model.
std::vector<std::string> linear_keys() {
  std::vector<std::string> out;
  for (int l = 0; l < 2; ++l)
    for (const char* p : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
      out.push_back(fmt::format("model.layers.{}.{}.weight", l, p));
  return out;
}

}  // namespace

TEST(QLoRA, BitsandbytesFolderStays4BitAndDecodesAsBitsandbytes) {
  auto m = LlamaModel::load(kBnb);
  ASSERT_TRUE(m->is_quantized());
  auto bf16 = WeightFiles::open_dir(kBf16);
  auto bnb = WeightFiles::open_dir(kBnb);
  size_t want_bytes = 0;
  int quantized = 0;
  for (auto& p : m->params()) {
    if (!p.quant) {
      // Embeddings, norms and lm_head: the bf16 values, unquantized.
      EXPECT_TRUE(same_bytes(p.value, bf16.get_f32(p.name))) << p.name;
      continue;
    }
    ++quantized;
    EXPECT_FALSE(p.value.defined()) << p.name << ": no float copy of a 4-bit weight";
    EXPECT_FALSE(p.trainable) << p.name;
    EXPECT_EQ(p.quant->type, quant::QuantType::NF4);
    EXPECT_EQ(p.quant->blocksize, 64);
    EXPECT_TRUE(p.quant->nested);
    // In memory: everything but the JSON quant state.
    for (const auto& [k, t] : quant::state_dict(p.name, *p.quant))
      if (k.find("quant_state") == std::string::npos)
        want_bytes += bnb.info(k).end - bnb.info(k).begin;
    // Decoded as bitsandbytes decodes it: bnb's own dequantized bf16 weight, bit for bit.
    Tensor out = Tensor::empty(p.shape(), DType::BF16);
    quant::dequantize_4bit(*p.quant, out);
    EXPECT_TRUE(same_bytes(out, reference().get("dequant_bf16." + p.name))) << p.name;
  }
  EXPECT_EQ(quantized, 14);
  EXPECT_EQ(m->quantized_bytes(), want_bytes);
  EXPECT_EQ(m->num_parameters(false), m->config().num_parameters());
}

TEST(QLoRA, LogitsMatchTheFixture) {
  auto m = LlamaModel::load(kBnb);
  Tensor logits = logits_of(*m, ref_batch());
  // transformers' float32 forward on bitsandbytes' dequantized (bf16) weights.
  Tensor want = reference().get_f32("logits_dequant_bf16_fwd_f32");
  EXPECT_LT(max_abs_diff(logits, want), 2e-5);
  EXPECT_LT(rel_err(logits, want), 1e-5);
  // Not the unquantized model's logits: the 4-bit weights are what ran.
  EXPECT_GT(max_abs_diff(logits, reference().get_f32("logits_orig_bf16_fwd_f32")), 1e-2);
}

TEST(QLoRA, GradientsEqualLoraOnTheDequantizedWeights) {
  LoadOptions deq;
  deq.dequantize = true;
  for (float dropout : {0.0f, 0.1f})
    for (auto ck : {Checkpointing::None, Checkpointing::Full}) {
      SCOPED_TRACE(fmt::format("dropout {} checkpointing {}", dropout, int(ck)));
      auto q = LlamaModel::load(kBnb);
      auto f = LlamaModel::load(kBnb, deq);
      ASSERT_FALSE(f->is_quantized());
      add_test_lora(*q, dropout);
      add_test_lora(*f, dropout);
      q->zero_grad();
      f->zero_grad();
      StepOptions o;
      o.checkpointing = ck;
      o.dropout_seed = 99;
      auto rq = q->step(ref_batch(), o);
      auto rf = f->step(ref_batch(), o);
      EXPECT_EQ(rq.loss_sum, rf.loss_sum);
      int lora = 0;
      ASSERT_EQ(q->params().size(), f->params().size());
      for (size_t i = 0; i < q->params().size(); ++i) {
        const Param &a = q->params()[i], &b = f->params()[i];
        ASSERT_EQ(a.name, b.name);
        ASSERT_EQ(a.grad.defined(), b.grad.defined()) << a.name;
        if (!a.grad.defined()) continue;
        lora += a.name.find(".lora_") != std::string::npos;
        EXPECT_TRUE(same_bytes(a.grad, b.grad)) << a.name;
      }
      EXPECT_EQ(lora, 28);
    }
}

TEST(QLoRA, QuantizeWhileLoadingReproducesTheBitsandbytesFolder) {
  LoadOptions lo;
  lo.quantize = true;
  auto m = LlamaModel::load(kBf16, lo);
  auto bnb = WeightFiles::open_dir(kBnb);
  int n = 0;
  for (const auto& key : linear_keys()) {
    Param* p = m->find_param(key);
    ASSERT_TRUE(p && p->quant) << key;
    for (const auto& [k, t] : quant::state_dict(key, *p->quant)) {
      EXPECT_TRUE(same_bytes(t, bnb.get(k))) << k;
      ++n;
    }
  }
  EXPECT_EQ(n, 14 * 6);
  // And the saved folder is transformers' file, byte for byte.
  const std::string dir = test::temp_dir("qlora_save");
  m->save_pretrained(dir, DType::BF16);
  EXPECT_EQ(file_bytes(dir + "/model.safetensors"), file_bytes(kBnb + "/model.safetensors"));
  json cfg = json::parse(read_file(dir + "/config.json"));
  json want = json::parse(read_file(kBnb + "/config.json"));
  EXPECT_EQ(cfg["quantization_config"], want["quantization_config"]);
  // What rig wrote loads back to the same weights.
  auto back = LlamaModel::load(dir);
  for (const auto& key : linear_keys())
    for (const auto& [k, t] : quant::state_dict(key, *back->find_param(key)->quant))
      EXPECT_TRUE(same_bytes(t, bnb.get(k))) << k;
}

namespace {

// Byte-level tokenizer without added tokens (256 ids, the tiny model's vocabulary) and a small
// text corpus to learn.
std::pair<std::string, std::string> tiny_data(const std::string& dir) {
  json tok = json::parse(read_file(test::data_path("data/byte_tokenizer.json")));
  tok["added_tokens"] = json::array();
  write_file_atomic(dir + "/tokenizer.json", tok.dump());
  std::string lines;
  const char* words[] = {"alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"};
  for (int i = 0; i < 64; ++i)
    lines += json{{"text", fmt::format("{} {} {} {}", words[i % 8], words[(i + 1) % 8],
                                       words[(i + 3) % 8], words[(i + 5) % 8])}}
                 .dump() +
             "\n";
  write_file_atomic(dir + "/data.jsonl", lines);
  return {dir + "/tokenizer.json", dir + "/data.jsonl"};
}

TrainConfig tiny_config(const std::string& model, const std::string& method_lines,
                        const std::string& dir, const std::string& out) {
  auto [tok, data] = tiny_data(dir);
  std::string yaml =
      "model: " + model + "\n" + method_lines +
      "lora: {r: 4, alpha: 8, dropout: 0.0, targets: [q_proj, k_proj, v_proj, o_proj, "
      "gate_proj, up_proj, down_proj]}\n"
      "tokenizer: " +
      tok + "\n" + "datasets:\n  - {path: " + data +
      ", format: text}\n"
      "sequence_len: 32\nmicro_batch_size: 4\nmax_steps: 24\n"
      "optimizer: {name: adamw, lr: 2.0e-2}\n"
      "schedule: {name: constant, warmup_steps: 0}\n"
      "eval: {every: 0, split: 0.0}\nsave: {every: 0, keep_last: 1}\n"
      "device: cpu\nseed: 3\noutput_dir: " +
      out + "\n";
  return parse_train_config(yaml, dir + "/config.yaml");
}

std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  for (const auto& row : read_metrics(run + "/metrics.jsonl").rows)
    if (row.contains("loss") && !row.contains("eval_loss")) out.push_back(row["loss"]);
  return out;
}

}  // namespace

TEST(QLoRATrain, LossFallsAndTheAdapterIsLoraOnTheDequantizedBase) {
  const std::string dir = test::temp_dir("qlora_train");
  TrainHooks quiet;
  quiet.quiet = true;
  // QLoRA on transformers' 4-bit folder.
  auto rq = train(tiny_config(kBnb, "method: qlora\n", dir, dir + "/qlora"), quiet);
  EXPECT_EQ(rq.steps, 24);
  const auto lq = losses(dir + "/qlora");
  ASSERT_EQ(lq.size(), 24u);
  EXPECT_LT((lq[21] + lq[22] + lq[23]) / 3, 0.92 * lq[0]) << lq[0] << " -> " << lq[23];
  ASSERT_TRUE(fs::exists(dir + "/qlora/final/adapter_config.json"));
  // LoRA on a float32 folder of the dequantized weights: the same run, bit for bit.
  LoadOptions deq;
  deq.dequantize = true;
  LlamaModel::load(kBnb, deq)->save_pretrained(dir + "/dequantized", DType::F32);
  train(tiny_config(dir + "/dequantized", "method: lora\n", dir, dir + "/lora"), quiet);
  EXPECT_EQ(losses(dir + "/lora"), lq);
  auto a = SafeTensorsFile::open(dir + "/qlora/final/adapter_model.safetensors");
  auto b = SafeTensorsFile::open(dir + "/lora/final/adapter_model.safetensors");
  ASSERT_EQ(a.tensors().size(), 28u);
  for (const auto& t : a.tensors()) EXPECT_TRUE(same_bytes(a.get(t.name), b.get(t.name))) << t.name;
  // axolotl's spelling on the bf16 folder: quantized while loading, the same 4-bit weights, the
  // same adapter.
  train(tiny_config(kBf16, "adapter: lora\nload_in_4bit: true\n", dir, dir + "/axolotl"), quiet);
  EXPECT_EQ(losses(dir + "/axolotl"), lq);
  auto c = SafeTensorsFile::open(dir + "/axolotl/final/adapter_model.safetensors");
  for (const auto& t : a.tensors()) EXPECT_TRUE(same_bytes(a.get(t.name), c.get(t.name))) << t.name;
}

TEST(QLoRATrain, MethodsAndStrategiesThatCannotTrain4BitWeightsSaySo) {
  const std::string dir = test::temp_dir("qlora_refuse");
  TrainHooks quiet;
  quiet.quiet = true;
  try {
    train(tiny_config(kBnb, "method: lora\n", dir, dir + "/run"), quiet);
    ADD_FAILURE() << "LoRA on a 4-bit folder trained";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("method: qlora"), std::string::npos) << e.what();
  }
}
