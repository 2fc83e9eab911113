// The 4-bit dequantization kernel (ops/cuda/nf4.cu) and QLoRA on the GPU, against the CPU oracle
// and the bitsandbytes fixtures (tests/data/bnb-nf4). Skipped with the reason when no GPU is
// visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "rig/core/allocator.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/optim/adamw.h"
#include "rig/quant/nf4.h"

using namespace rig;
namespace fs = std::filesystem;

namespace {

#define REQUIRE_GPU()    \
  if (!cuda_available()) \
  GTEST_SKIP() << "no CUDA GPU visible: the QLoRA GPU tests run on a GPU machine"

std::string env_or(const char* name, const char* def) {
  const char* v = std::getenv(name);
  return v ? v : def;
}
std::string data(const std::string& rel) {
  return env_or("RIG_TEST_DATA", RIG_TEST_DATA) + "/" + rel;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

int64_t differing(const Tensor& a, const Tensor& b) {
  const size_t es = a.dtype() == DType::F32 ? 4 : 2;
  int64_t n = 0;
  for (int64_t i = 0; i < a.numel(); ++i)
    n += std::memcmp(static_cast<const char*>(a.raw()) + i * es,
                     static_cast<const char*>(b.raw()) + i * es, es) != 0;
  return n;
}

double rel_err(const Tensor& a_any, const Tensor& b) {
  Tensor a = a_any.device().is_cpu() ? a_any : a_any.to(Device::cpu());
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.f32()[i]) - b.f32()[i];
    num += d * d;
    den += double(b.f32()[i]) * b.f32()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// GPU decode of q into `dt` against the CPU oracle's, element for element.
void expect_gpu_equals_cpu(const quant::QuantizedWeight& q, const std::string& what) {
  const quant::QuantizedWeight qd = q.to(Device::cuda(0));
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor cpu = Tensor::empty(q.shape, dt);
    quant::dequantize_4bit(q, cpu);
    Tensor gpu = Tensor::empty(q.shape, dt, Device::cuda(0));
    quant::dequantize_4bit(qd, gpu);
    Tensor back = gpu.to(Device::cpu());
    EXPECT_TRUE(same_bytes(back, cpu))
        << what << " " << dtype_name(dt) << ": " << differing(back, cpu) << " of " << cpu.numel()
        << " differ";
  }
}

Tensor random_weight(const Shape& s, DType dt, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  Tensor t = Tensor::empty(s, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(rng);
  return dt == DType::F32 ? t : t.to_dtype(dt);
}

TokenBatch ref_batch() {
  auto f = SafeTensorsFile::open(data("bnb-nf4/tiny_llama_reference.safetensors"));
  Tensor ids = f.get("input_ids").clone();
  return TokenBatch{ids, ids.clone(), {}, {}};
}

void add_test_lora(LlamaModel& m) {
  LoraConfig lc;
  lc.r = 4;
  lc.alpha = 8;
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

}  // namespace

// Every fixture case (odd sizes, partial blocks, blocksize 128, FP4, with and without double
// quantization): the kernel's scalar path, bit for bit the CPU's (which is bitsandbytes').
TEST(Nf4Gpu, DequantizeEqualsTheCpuOnEveryFixtureCase) {
  REQUIRE_GPU();
  const auto cases = nlohmann::json::parse(read_file(data("bnb-nf4/cases.json")))["cases"];
  int checked = 0;
  for (const auto& c : cases) {
    const std::string path = data("bnb-nf4/" + c["file"].get<std::string>());
    if (!fs::exists(path)) continue;  // the one large case kept out of the repository
    auto w = WeightFiles::open_file(path);
    expect_gpu_equals_cpu(quant::load_quantized(w, "weight", c["shape"].get<Shape>()), c["name"]);
    ++checked;
  }
  EXPECT_GE(checked, 15);
}

// Shapes of real models take the 16-byte vector path; awkward ones the scalar path.
TEST(Nf4Gpu, DequantizeEqualsTheCpuOnModelShapes) {
  REQUIRE_GPU();
  struct Case {
    Shape s;
    DType dt;
    int64_t bs;
    bool dq;
  };
  const Case cases[] = {
      {{4096, 4096}, DType::BF16, 64, true}, {{1024, 14336}, DType::BF16, 64, true},
      {{512, 4096}, DType::F32, 128, true},  {{768, 2048}, DType::F16, 64, false},
      {{1000, 999}, DType::BF16, 64, true},  {{111, 989}, DType::F32, 64, false},
      {{64, 96}, DType::BF16, 32, true},     {{3, 5}, DType::BF16, 64, true}};
  uint64_t seed = 1;
  for (const auto& c : cases) {
    auto q =
        quant::quantize_4bit(random_weight(c.s, c.dt, seed++), quant::QuantType::NF4, c.bs, c.dq);
    expect_gpu_equals_cpu(q, shape_str(c.s));
  }
}

// The tiny 4-bit model on the GPU in float32: the fixture's logits and the CPU's LoRA gradients.
TEST(QloraGpu, Fp32MatchesTheFixtureAndTheCpu) {
  REQUIRE_GPU();
  auto cpu = LlamaModel::load(data("bnb-nf4/tiny_llama_bnb4"));
  auto gpu = LlamaModel::load(data("bnb-nf4/tiny_llama_bnb4"));
  add_test_lora(*cpu);
  add_test_lora(*gpu);
  gpu->to_device(Device::cuda(0));
  auto ref = SafeTensorsFile::open(data("bnb-nf4/tiny_llama_reference.safetensors"));
  for (auto* m : {cpu.get(), gpu.get()}) m->zero_grad();
  Tensor lc, lg;
  StepOptions oc, og;
  oc.logits = &lc;
  og.logits = &lg;
  cpu->step(ref_batch(), oc);
  gpu->step(ref_batch(), og);
  EXPECT_LT(rel_err(lg, lc), 1e-5);
  int checked = 0;
  for (size_t i = 0; i < cpu->params().size(); ++i) {
    const Param &a = cpu->params()[i], &b = gpu->params()[i];
    if (!a.grad.defined()) continue;
    ASSERT_TRUE(b.grad.device().is_cuda()) << b.name;
    EXPECT_LT(rel_err(b.grad, a.grad), 1e-4) << a.name;
    ++checked;
  }
  EXPECT_EQ(checked, 28);
  // Without LoRA: transformers' logits on bitsandbytes' dequantized weights.
  auto plain = LlamaModel::load(data("bnb-nf4/tiny_llama_bnb4"));
  plain->to_device(Device::cuda(0));
  StepOptions fo;
  fo.backward = false;
  fo.logits = &lg;
  plain->step(ref_batch(), fo);
  EXPECT_LT(rel_err(lg, ref.get_f32("logits_dequant_bf16_fwd_f32")), 1e-5);
}

// bf16 compute: within bf16 of the CPU oracle (the tolerances of train_gpu_test.cpp's bf16 tests),
// and a few AdamW steps follow the CPU.
TEST(QloraGpu, Bf16WithinBf16OfTheCpu) {
  REQUIRE_GPU();
  std::vector<double> losses[2];
  std::unique_ptr<LlamaModel> ms[2];
  for (int g = 0; g < 2; ++g) {
    ms[g] = LlamaModel::load(data("bnb-nf4/tiny_llama_bnb4"));
    add_test_lora(*ms[g]);
    if (g) {
      ms[g]->set_compute_dtype(DType::BF16);
      ms[g]->to_device(Device::cuda(0));
    }
    ms[g]->zero_grad();
    ms[g]->step(ref_batch(), StepOptions{});
  }
  for (size_t i = 0; i < ms[0]->params().size(); ++i) {
    const Param &a = ms[0]->params()[i], &b = ms[1]->params()[i];
    if (!a.grad.defined()) continue;
    EXPECT_LT(rel_err(b.grad, a.grad), 6e-2) << a.name;
  }
  for (int g = 0; g < 2; ++g) {
    OptimizerConfig oc;
    oc.lr = 3e-3f;
    AdamW opt(oc);
    for (int s = 0; s < 20; ++s) {
      ms[g]->zero_grad();
      losses[g].push_back(ms[g]->step(ref_batch(), StepOptions{}).loss());
      opt.clip_and_step(ms[g]->params(), oc.lr);
      ms[g]->refresh_compute_weights();
    }
  }
  for (size_t s = 0; s < losses[0].size(); ++s)
    EXPECT_LT(std::fabs(losses[1][s] - losses[0][s]) / losses[0][s], 5e-2) << "step " << s;
  EXPECT_LT(losses[1].back(), 0.95 * losses[1].front());
  std::printf("QLoRA bf16 20 steps: loss %.4f -> %.4f (CPU fp32 %.4f -> %.4f)\n", losses[1].front(),
              losses[1].back(), losses[0].front(), losses[0].back());
}

// The device never holds a bf16 copy of the model's linear weights: after loading it holds the
// 4-bit weights and the bf16 rest; a step adds one dequantized weight (the largest) and
// activations.
TEST(QloraGpu, HoldsNoBf16CopyOfTheModel) {
  REQUIRE_GPU();
  ModelConfig cfg = ModelConfig::from_json({{"model_type", "llama"},
                                            {"vocab_size", 512},
                                            {"hidden_size", 1024},
                                            {"intermediate_size", 4096},
                                            {"num_hidden_layers", 4},
                                            {"num_attention_heads", 8},
                                            {"num_key_value_heads", 8}},
                                           "test");
  auto m = LlamaModel::random(cfg, 5);
  m->quantize_weights();
  LoraConfig lc;
  lc.r = 8;
  m->add_lora(lc, 1);
  m->set_compute_dtype(DType::BF16);
  Allocator& a = allocator_for(Device::cuda(0));
  const size_t before = a.in_use();
  m->to_device(Device::cuda(0));
  const size_t held = a.in_use() - before;
  int64_t linear = 0, largest = 0, other = 0;
  for (const auto& p : m->params()) {
    if (p.quant) {
      linear += p.numel();
      largest = std::max(largest, p.numel());
    } else {
      other += p.numel();
    }
  }
  // 4-bit weights + the rest (bf16 embeddings/lm_head, float32 norms and LoRA with its bf16 copy).
  EXPECT_LE(held, m->quantized_bytes() + size_t(other) * 6 + (1 << 20));
  EXPECT_LT(held, size_t(linear));  // half the bytes of a bf16 copy of the linear weights
  TokenBatch b{Tensor::zeros({1, 16}, DType::I64), Tensor::zeros({1, 16}, DType::I64), {}, {}};
  a.reset_peak();
  const size_t base = a.in_use();
  m->zero_grad();
  m->step(b, StepOptions{});
  const size_t step_peak = a.peak() - base;
  std::printf(
      "QLoRA GPU: 4-bit weights %zu B for %lld parameters; step peak +%zu B (largest weight in "
      "bf16 %lld B)\n",
      m->quantized_bytes(), (long long)linear, step_peak, (long long)(largest * 2));
  EXPECT_LT(step_peak, size_t(largest) * 2 + (size_t(24) << 20));
}
