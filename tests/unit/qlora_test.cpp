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
  Tensor orig = reference().get_f32("logits_orig_bf16_fwd_f32");
  EXPECT_GT(max_abs_diff(logits, orig), 1e-2);
  // Which the bf16 folder gives.
  auto bf16 = LlamaModel::load(kBf16);
  EXPECT_LT(max_abs_diff(logits_of(*bf16, ref_batch()), orig), 2e-5);
  // And the weights decoded straight to float32 (no rounding to bf16): the fixture's third set.
  LoadOptions deq;
  deq.dequantize = true;
  auto f32 = LlamaModel::load(kBnb, deq);
  auto w = WeightFiles::open_dir(kBnb);
  for (const auto& key : linear_keys())
    quant::dequantize_4bit_f32(quant::load_quantized(w, key), f32->find_param(key)->value);
  EXPECT_LT(
      max_abs_diff(logits_of(*f32, ref_batch()), reference().get_f32("logits_dequant_f32_fwd_f32")),
      2e-5);
  // The batch is the reference JSON's.
  json ids = json::parse(read_file(fix("tiny_llama_reference.json")))["input_ids"];
  const Tensor& t = ref_batch().input_ids;
  for (int64_t i = 0; i < t.numel(); ++i)
    EXPECT_EQ(t.data<int64_t>()[i], ids[size_t(i / 16)][size_t(i % 16)]);
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

// Deferred (what a sharded rank does): nothing is quantized or read at load; made on demand, a
// weight is still bitsandbytes' bytes, from the bf16 folder and from the 4-bit one.
TEST(QLoRA, DeferredQuantizationMakesTheBitsandbytesBytesOnDemand) {
  auto bnb = WeightFiles::open_dir(kBnb);
  for (const std::string& dir : {kBf16, kBnb}) {
    LoadOptions lo;
    lo.quantize = lo.defer_quantize = true;
    auto m = LlamaModel::load(dir, lo);
    EXPECT_TRUE(m->codes_deferred()) << dir;
    EXPECT_EQ(m->offsets_pending(), dir == kBf16) << "a 4-bit folder's offsets are in its files";
    EXPECT_EQ(m->quantized_bytes(), 0u) << dir;
    // A range of one weight's packed codes, then the whole model.
    const size_t i = size_t(m->find_param(linear_keys()[3]) - m->params().data());
    std::vector<uint8_t> part(40);
    m->deferred_4bit_bytes(i, &quant::QuantizedWeight::packed, 100, 140, part.data());
    const Tensor want = bnb.get(linear_keys()[3]);
    EXPECT_EQ(std::memcmp(part.data(), static_cast<const uint8_t*>(want.raw()) + 100, 40), 0);
    EXPECT_EQ(m->deferred_quantized(), 1);
    m->materialize_4bit(Device::cpu());
    EXPECT_FALSE(m->codes_deferred());
    for (const auto& key : linear_keys())
      for (const auto& [k, t] : quant::state_dict(key, *m->find_param(key)->quant))
        EXPECT_TRUE(same_bytes(t, bnb.get(k))) << dir << ": " << k;
  }
}

// A frozen bf16 base loaded as bf16 (LoadOptions::frozen_bf16) ends as the float32 detour ends
// after set_compute_dtype(BF16): every parameter the same dtype and bytes, LoRA and QLoRA.
TEST(QLoRA, FrozenBf16BaseLoadsAsTheFloat32DetourEnds) {
  for (bool quantize : {false, true}) {
    LoadOptions lo;
    lo.quantize = quantize;
    auto detour = LlamaModel::load(kBf16, lo);
    lo.frozen_bf16 = true;
    auto direct = LlamaModel::load(kBf16, lo);
    const Param* emb = direct->find_param("model.embed_tokens.weight");
    ASSERT_TRUE(emb);
    EXPECT_EQ(emb->value.dtype(), DType::BF16) << "no float32 copy of the embedding on the host";
    for (auto* m : {detour.get(), direct.get()}) {
      m->add_lora(LoraConfig{}, 3);
      m->set_compute_dtype(DType::BF16);
    }
    ASSERT_EQ(detour->params().size(), direct->params().size());
    for (size_t i = 0; i < detour->params().size(); ++i) {
      const Param &a = detour->params()[i], &b = direct->params()[i];
      ASSERT_EQ(a.name, b.name);
      EXPECT_EQ(a.value.defined(), b.value.defined()) << a.name;
      if (a.value.defined()) {
        EXPECT_TRUE(same_bytes(a.value, b.value)) << a.name;
      }
      EXPECT_EQ(a.compute.defined(), b.compute.defined()) << a.name;
      if (a.compute.defined()) {
        EXPECT_TRUE(same_bytes(a.compute, b.compute)) << a.name;
      }
      if (a.quant) {
        ASSERT_TRUE(b.quant) << a.name;
        EXPECT_TRUE(same_bytes(a.quant->packed, b.quant->packed)) << a.name;
      }
    }
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

// A random model quantized as it is drawn (what rig bench train and init: random do for QLoRA, so a
// 70B shape never exists in float32) is the random model quantized afterwards, byte for byte.
TEST(QLoRA, RandomModelQuantizedWhileDrawnEqualsQuantizedAfterwards) {
  const ModelConfig cfg = ModelConfig::from_json({{"model_type", "llama"},
                                                  {"vocab_size", 300},
                                                  {"hidden_size", 96},
                                                  {"intermediate_size", 200},
                                                  {"num_hidden_layers", 2},
                                                  {"num_attention_heads", 4},
                                                  {"num_key_value_heads", 2}},
                                                 "test");
  auto after = LlamaModel::random(cfg, 5);
  after->quantize_weights();
  LoadOptions lo;
  lo.quantize = true;
  auto drawn = LlamaModel::random(cfg, 5, lo);
  ASSERT_EQ(after->params().size(), drawn->params().size());
  int four_bit = 0;
  for (size_t i = 0; i < after->params().size(); ++i) {
    const Param &a = after->params()[i], &b = drawn->params()[i];
    ASSERT_EQ(a.name, b.name);
    ASSERT_EQ(bool(a.quant), bool(b.quant)) << a.name;
    EXPECT_EQ(a.trainable, b.trainable) << a.name;
    if (!a.quant) {
      EXPECT_EQ(0, std::memcmp(a.value.raw(), b.value.raw(), a.value.nbytes())) << a.name;
      continue;
    }
    ++four_bit;
    for (auto [x, y] :
         {std::pair{&a.quant->packed, &b.quant->packed}, {&a.quant->absmax, &b.quant->absmax}}) {
      ASSERT_EQ(x->nbytes(), y->nbytes()) << a.name;
      EXPECT_EQ(0, std::memcmp(x->raw(), y->raw(), x->nbytes())) << a.name;
    }
  }
  EXPECT_EQ(four_bit, 2 * 7);
  EXPECT_EQ(after->quantized_bytes(), drawn->quantized_bytes());
}

TEST(QuantizeCli, WritesTransformersFolderByteForByte) {
  const std::string dir = test::temp_dir("quantize_cli");
  auto r = test::run_rig("quantize --model " + kBf16 + " --out " + dir + "/q");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("quantized 14 linear weights"), std::string::npos) << r.out;
  EXPECT_EQ(file_bytes(dir + "/q/model.safetensors"), file_bytes(kBnb + "/model.safetensors"));
  EXPECT_EQ(json::parse(read_file(dir + "/q/config.json")),
            json::parse(read_file(kBnb + "/config.json")));
  EXPECT_EQ(file_bytes(dir + "/q/generation_config.json"),
            file_bytes(kBf16 + "/generation_config.json"));
  // In shards of ~40 kB: an index and several files, loading to the same model.
  r = test::run_rig("quantize --model " + kBf16 + " --out " + dir + "/s --max-shard-size 0.00004");
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_TRUE(fs::exists(dir + "/s/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir + "/s/model.safetensors"));
  auto whole = LlamaModel::load(kBnb), sharded = LlamaModel::load(dir + "/s");
  for (const auto& key : linear_keys()) {
    auto a = quant::state_dict(key, *whole->find_param(key)->quant);
    auto b = quant::state_dict(key, *sharded->find_param(key)->quant);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(same_bytes(a[i].second, b[i].second)) << a[i].first;
  }
  EXPECT_TRUE(same_bytes(logits_of(*whole, ref_batch()), logits_of(*sharded, ref_batch())));
  // A 4-bit folder is not quantized twice.
  r = test::run_rig("quantize --model " + kBnb + " --out " + dir + "/twice");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("quantized already"), std::string::npos) << r.out;
}

TEST(QLoRACli, InspectShowsTheQuantization) {
  auto r = test::run_rig("inspect " + kBnb + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  json j = json::parse(r.out);
  ASSERT_TRUE(j.contains("quantization")) << r.out;
  const json& q = j["quantization"];
  EXPECT_EQ(q["method"], "bitsandbytes");
  EXPECT_EQ(q["quant_type"], "nf4");
  EXPECT_EQ(q["blocksize"], 64);
  EXPECT_EQ(q["double_quant"], true);
  EXPECT_EQ(q["compute_dtype"], "bfloat16");
  EXPECT_EQ(q["quantized_tensors"], 14);
  // 2 layers x (q 64x64 + k, v 32x64 + o 64x64 + gate, up, down 128x64).
  const int64_t linear = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192);
  EXPECT_EQ(q["quantized_parameters"], linear);
  EXPECT_EQ(j["parameters"], linear + 2 * 256 * 64 + 5 * 64);
  // Packed nibbles, one byte per 64 weights, the maps and the JSON of each weight.
  size_t bytes = 0;
  auto w = WeightFiles::open_dir(kBnb);
  for (const auto& name : w.names())
    if (name.find("_proj.weight") != std::string::npos)
      bytes += w.info(name).end - w.info(name).begin;
  EXPECT_EQ(q["quantized_bytes"], bytes);
  r = test::run_rig("inspect " + kBnb);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(
      r.out.find("quantization: bitsandbytes nf4, blocks of 64, double quantization; 14 weights"),
      std::string::npos)
      << r.out;
}

TEST(QLoRACli, DebugForwardBackwardRunsOnA4BitFolder) {
  const std::string dir = test::temp_dir("qlora_fb");
  TokenBatch b = ref_batch();
  save_safetensors(dir + "/batch.safetensors", {{"input_ids", b.input_ids}, {"labels", b.labels}});
  // Without an adapter: the fixture's logits.
  auto r = test::run_rig("debug forward-backward --model " + kBnb + " --batch " + dir +
                         "/batch.safetensors --out " + dir + "/out.safetensors");
  ASSERT_EQ(r.code, 0) << r.out;
  auto out = SafeTensorsFile::open(dir + "/out.safetensors");
  EXPECT_LT(max_abs_diff(out.get_f32("logits").reshape({2, 16, 256}),
                         reference().get_f32("logits_dequant_bf16_fwd_f32")),
            2e-5);
  // With an adapter: the LoRA gradients, as the library computes them in-process.
  auto m = LlamaModel::load(kBnb);
  add_test_lora(*m);
  m->save_adapter(dir + "/adapter");
  r = test::run_rig("debug forward-backward --model " + kBnb + " --adapter " + dir +
                    "/adapter --batch " + dir + "/batch.safetensors --out " + dir +
                    "/out2.safetensors");
  ASSERT_EQ(r.code, 0) << r.out;
  auto out2 = SafeTensorsFile::open(dir + "/out2.safetensors");
  auto again = LlamaModel::load(kBnb);
  again->load_adapter(dir + "/adapter");
  again->zero_grad();
  again->step(b, StepOptions{});
  int lora = 0;
  for (auto& p : again->params()) {
    if (!p.grad.defined()) continue;
    ASSERT_TRUE(out2.has("grad." + p.name)) << p.name;
    EXPECT_TRUE(same_bytes(out2.get("grad." + p.name), p.grad)) << p.name;
    lora += p.name.find(".lora_") != std::string::npos;
  }
  EXPECT_EQ(lora, 28);
}

TEST(QLoRACli, MergeOntoA4BitBaseDequantizesAndWritesBf16) {
  const std::string dir = test::temp_dir("qlora_merge");
  auto m = LlamaModel::load(kBnb);
  add_test_lora(*m);
  m->save_adapter(dir + "/adapter");
  Tensor want = logits_of(*m, ref_batch());
  auto r = test::run_rig("merge --model " + kBnb + " --adapter " + dir + "/adapter --out " + dir +
                         "/merged");
  ASSERT_EQ(r.code, 0) << r.out;
  json cfg = json::parse(read_file(dir + "/merged/config.json"));
  EXPECT_FALSE(cfg.contains("quantization_config"));
  EXPECT_EQ(cfg["torch_dtype"], "bfloat16");
  auto w = WeightFiles::open_dir(dir + "/merged");
  for (const auto& name : w.names()) {
    EXPECT_EQ(w.info(name).dtype, DType::BF16) << name;
    EXPECT_EQ(name.find("absmax"), std::string::npos) << name;
  }
  auto merged = LlamaModel::load(dir + "/merged");
  EXPECT_FALSE(merged->is_quantized());
  // bf16 rounding of the merged weights is the only difference.
  EXPECT_LT(rel_err(logits_of(*merged, ref_batch()), want), 1e-2);
  r = test::run_rig("merge --model " + kBnb + " --adapter " + dir + "/adapter --out " + dir +
                    "/merged32 --dtype f32");
  ASSERT_EQ(r.code, 0) << r.out;
  auto m32 = LlamaModel::load(dir + "/merged32");
  EXPECT_LT(rel_err(logits_of(*m32, ref_batch()), want), 1e-5);
}

TEST(QLoRACli, BenchTrainRunsQlora) {
  auto r = test::run_rig(
      "bench train --method qlora --hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 128 "
      "--vocab 256 --batch 2 --seq 16 --steps 3 --lora-r 4 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  json j = json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["method"], "qlora");
  // LoRA r=4 on the seven projections of two layers: r * (in + out) each.
  EXPECT_EQ(j["trainable_parameters"], 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128)));
  ASSERT_EQ(j["losses"].size(), 4u);
  for (const auto& l : j["losses"]) EXPECT_TRUE(std::isfinite(l.get<double>()));
  // The same shape from a 4-bit folder.
  r = test::run_rig("bench train --method qlora --model " + kBnb +
                    " --batch 2 --seq 16 --steps 2 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out.substr(r.out.find('{')))["method"], "qlora");
}

namespace {

// A copy of the 4-bit folder with its weights edited.
std::string edited_folder(
    const std::string& dir,
    const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  fs::create_directories(dir);
  for (const char* f : {"config.json", "generation_config.json"})
    fs::copy_file(kBnb + "/" + f, dir + "/" + f, fs::copy_options::overwrite_existing);
  auto src = SafeTensorsFile::open(kBnb + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const auto& t : src.tensors()) ts.emplace_back(t.name, src.get(t.name).clone());
  edit(ts);
  save_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
  return dir + "/model.safetensors";
}

std::string load_error(const std::string& dir) {
  try {
    LlamaModel::load(dir);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(QLoRACli, BadFoldersAreOneClearError) {
  const std::string base = test::temp_dir("qlora_bad");
  const std::string key = "model.layers.1.mlp.up_proj.weight";
  // A truncated absmax.
  std::string file = edited_folder(base + "/trunc", [&](auto& ts) {
    for (auto& [k, t] : ts)
      if (k == key + ".absmax") t = t.slice_rows(0, 100).clone();
  });
  std::string e = load_error(base + "/trunc");
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("'" + key + ".absmax'"), std::string::npos) << e;
  // Through the CLI: one line, non-zero exit.
  auto r = test::run_rig("debug forward-backward --model " + base + "/trunc --batch x --out y");
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.out.rfind("rig: ", 0), 0u) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  EXPECT_NE(r.out.find(key + ".absmax"), std::string::npos) << r.out;
  // A quant state whose shape is not the architecture's.
  file = edited_folder(base + "/shape", [&](auto& ts) {
    for (auto& [k, t] : ts)
      if (k == key + ".quant_state.bitsandbytes__nf4") {
        std::string s(static_cast<const char*>(t.raw()), t.nbytes());
        s.replace(s.find("[128, 64]"), 9, "[64, 128]");
        t = Tensor::empty({int64_t(s.size())}, DType::U8);
        std::memcpy(t.raw(), s.data(), s.size());
      }
  });
  e = load_error(base + "/shape");
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("[64, 128]"), std::string::npos) << e;
  EXPECT_NE(e.find(key), std::string::npos) << e;
  // A missing companion.
  file = edited_folder(base + "/missing", [&](auto& ts) {
    std::erase_if(ts, [&](const auto& kv) { return kv.first == key + ".nested_absmax"; });
  });
  e = load_error(base + "/missing");
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("'" + key + ".nested_absmax' is missing"), std::string::npos) << e;
  // Packed bytes without their quant state.
  file = edited_folder(base + "/nostate", [&](auto& ts) {
    std::erase_if(
        ts, [&](const auto& kv) { return kv.first == key + ".quant_state.bitsandbytes__nf4"; });
  });
  e = load_error(base + "/nostate");
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("'" + key + "' is U8"), std::string::npos) << e;
  EXPECT_NE(e.find("quant_state.bitsandbytes__nf4"), std::string::npos) << e;
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
