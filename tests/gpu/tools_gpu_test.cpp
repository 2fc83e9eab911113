// rig eval, generate, merge and debug forward-backward on the GPU against the CPU (the float32
// oracle) on the tiny fixtures: the models placed as the commands place them
// (rig::place_for_inference), greedy generation through the device argmax, a 4-bit base kept
// 4-bit, the merge folded on the GPU, and the commands themselves with --device cuda. Skipped
// with the reason when no GPU is visible.
//
// Tolerances (the reasoning of decode_gpu_test.cpp and train_gpu_test.cpp): float32 on the GPU
// differs from the CPU by summation order only (cuBLASLt in true fp32): losses within 1e-5
// relative, merged weights within 1e-6. bf16 rounds weights and activations to 8 significant
// bits; over the fixtures' layers that is about 1e-2 of the logits and well under 1e-2 of a mean
// loss: losses within 1e-2 relative, logits within 2e-2 normalised. Greedy tokens must match up
// to the first step whose top-two gap is within twice the step's largest logit difference (a tie
// within the precision; later tokens may then differ legitimately).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "rig/core/allocator.h"
#include "rig/data/records.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/ops/ops.h"
#include "rig/train/inference.h"
#include "rig/train/trainer.h"

using namespace rig;
namespace fs = std::filesystem;

namespace {

#define REQUIRE_GPU()    \
  if (!cuda_available()) \
  GTEST_SKIP() << "no CUDA GPU visible: the GPU tool tests run on a GPU machine"

std::string env_or(const char* name, const char* def) {
  const char* v = std::getenv(name);
  return v && *v ? v : def;
}
std::string data(const std::string& rel) {
  return env_or("RIG_TEST_DATA", RIG_TEST_DATA) + "/" + rel;
}
std::string temp_dir(const std::string& name) {
  const fs::path p = fs::path(env_or("RIG_BUILD_DIR", RIG_BUILD_DIR)) / "test-tmp" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

double rel_err(const Tensor& a_any, const Tensor& b_any) {
  const Tensor a = a_any.to(Device::cpu()).to_dtype(DType::F32),
               b = b_any.to(Device::cpu()).to_dtype(DType::F32);
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.f32()[i]) - b.f32()[i];
    num += d * d;
    den += double(b.f32()[i]) * b.f32()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

struct Diff {
  double normalised = 0, max_abs = 0;
};
Diff diff(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  Diff d;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = double(got[i]) - want[i];
    num += e * e;
    den += double(want[i]) * want[i];
    d.max_abs = std::max(d.max_abs, std::fabs(e));
  }
  d.normalised = std::sqrt(num / std::max(den, 1e-30));
  return d;
}
double top_margin(std::vector<float> x) {
  std::partial_sort(x.begin(), x.begin() + 2, x.end(), std::greater<>());
  return double(x[0]) - x[1];
}

// Random samples over the vocabulary, the second half of each one trained (as a response).
TokenDataset random_dataset(int64_t vocab, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Sample> v;
  for (int i = 0; i < n; ++i) {
    Sample s;
    const int len = 6 + int(rng() % 50);
    for (int k = 0; k < len; ++k) {
      s.ids.push_back(int32_t(rng() % uint32_t(vocab)));
      s.train.push_back(k >= len / 2);
    }
    v.push_back(s);
  }
  return TokenDataset::from_samples(v);
}

std::vector<int32_t> random_prompt(int64_t vocab, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = int32_t(rng() % uint32_t(vocab));
  return p;
}

const char* dtype_label(DType dt) {
  return dt == DType::F32 ? "F32" : "BF16";
}

using Param2 = std::tuple<std::string, DType>;
class GpuTools : public ::testing::TestWithParam<Param2> {};

std::string param_name(const ::testing::TestParamInfo<Param2>& p) {
  return std::get<0>(p.param).substr(5) + "_" + dtype_label(std::get<1>(p.param));
}

}  // namespace

// rig eval's loss on the GPU, the model placed as the command places it: every matrix frozen, in
// the compute dtype only (no float32 master under bf16).
TEST_P(GpuTools, EvalLossMatchesTheCpu) {
  REQUIRE_GPU();
  const auto& [fixture, dt] = GetParam();
  const std::string dir = data("hf/" + fixture + "/model");
  auto cpu = LlamaModel::load(dir), gpu = LlamaModel::load(dir);
  place_for_inference(*gpu, ComputeTarget{Device::cuda(0), dt});
  for (const auto& p : gpu->params()) {
    EXPECT_FALSE(p.trainable) << p.name;
    EXPECT_FALSE(p.compute.defined()) << p.name << ": a second copy of a frozen weight";
    EXPECT_TRUE(p.value.device().is_cuda()) << p.name;
    if (p.compute_operand) EXPECT_EQ(p.value.dtype(), dt) << p.name;
  }
  const TokenDataset ds = random_dataset(cpu->config().vocab_size, 23, 11);
  const EvalResult want = evaluate(*cpu, ds, 64, 5), got = evaluate(*gpu, ds, 64, 5);
  EXPECT_EQ(got.tokens, want.tokens);
  const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
  EXPECT_NEAR(got.loss, want.loss, tol * want.loss);
  std::printf("%s %s eval loss: cpu %.6f gpu %.6f (relative %.2e, tolerance %.0e)\n",
              fixture.c_str(), dtype_label(dt), want.loss, got.loss,
              std::fabs(got.loss - want.loss) / want.loss, tol);
}

// Greedy generation on the GPU picks each token on the device (decode_greedy): the CPU's tokens
// up to the first tie within the precision; and, on the GPU itself, the device argmax picks what
// the host argmax of the same step's logits picks (wherever the top two are apart by more than
// the two runs' own rounding), with and without a vocabulary limit.
TEST_P(GpuTools, GreedyGenerationMatchesTheCpu) {
  REQUIRE_GPU();
  const auto& [fixture, dt] = GetParam();
  const std::string dir = data("hf/" + fixture + "/model");
  auto cpu = LlamaModel::load(dir), gpu = LlamaModel::load(dir);
  place_for_inference(*gpu, ComputeTarget{Device::cuda(0), dt});
  const int64_t V = cpu->config().vocab_size;
  const double tol = dt == DType::F32 ? 1e-5 : 2e-2;
  const std::vector<int32_t> prompt = random_prompt(V, 13, 3);
  GenerateOptions o;
  o.max_new_tokens = 8;
  GenerateStats st;
  const std::vector<int32_t> want = generate(*cpu, prompt, o);
  const std::vector<int32_t> got = generate(*gpu, prompt, o, &st);
  ASSERT_EQ(want.size(), size_t(8));
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(st.prompt_tokens, 13);
  EXPECT_EQ(st.new_tokens, 8);
  EXPECT_GT(st.decode_tokens_per_s(), 0.0);

  // The CPU's tokens replayed through both: logits within the tolerance, tokens up to a tie.
  auto cc = cpu->new_cache(32), gc = gpu->new_cache(32);
  std::vector<int64_t> feed(prompt.begin(), prompt.end());
  size_t agree_until = want.size();
  for (size_t s = 0; s < want.size(); ++s) {
    const std::vector<float> c = cpu->decode(cc, feed), g = gpu->decode(gc, feed);
    const Diff d = diff(g, c);
    EXPECT_LT(d.normalised, tol) << "step " << s;
    if (top_margin(c) <= 2 * d.max_abs && agree_until == want.size()) {
      agree_until = s;
      std::printf("%s %s: step %zu is a tie within the precision\n", fixture.c_str(),
                  dtype_label(dt), s);
    }
    feed = {want[s]};
  }
  for (size_t s = 0; s < agree_until; ++s) EXPECT_EQ(got[s], want[s]) << "token " << s;

  // Device argmax against the host argmax of the same model's logits, step by step.
  for (int64_t limit : {int64_t(0), V / 2 + 1}) {
    auto a = gpu->new_cache(40), b = gpu->new_cache(40);
    std::vector<int64_t> in(prompt.begin(), prompt.end());
    for (int s = 0; s < 10; ++s) {
      std::vector<float> logits = gpu->decode(a, in);
      const int64_t id = gpu->decode_greedy(b, in, limit);
      logits.resize(size_t(limit > 0 ? limit : V));
      const int64_t host = std::max_element(logits.begin(), logits.end()) - logits.begin();
      ASSERT_GE(id, 0);
      ASSERT_LT(id, int64_t(logits.size())) << "a pick past the limit";
      // Both steps run the same products on the same device and pick the first largest, so they
      // agree; should a product's algorithm differ between them, a different pick must be a
      // near-tie of the host logits within that rounding.
      double biggest = 0;
      for (float x : logits) biggest = std::max(biggest, double(std::fabs(x)));
      if (id != host)
        EXPECT_LE(logits[size_t(host)] - logits[size_t(id)],
                  (dt == DType::F32 ? 1e-5 : 2e-2) * biggest)
            << "step " << s << " limit " << limit << ": device " << id << ", host " << host;
      in = {host};
    }
  }
  std::printf("%s %s greedy: %zu of %zu tokens compared; decode %.0f tokens/s\n", fixture.c_str(),
              dtype_label(dt), agree_until, want.size(), st.decode_tokens_per_s());
}

// rig generate and rig eval in bf16 load a folder's bf16 base as it is (LoadOptions::frozen_bf16)
// instead of through float32 on the host: the same device weights, so the same logits, bit for
// bit, and the same tokens.
TEST(GpuToolsBf16, Bf16FolderLoadedAsBf16DecodesAsThroughFloat32) {
  REQUIRE_GPU();
  const std::string dir = temp_dir("gpu_bf16_generate") + "/model";
  LlamaModel::load(data("hf/tiny-llama3/model"))->save_pretrained(dir, DType::BF16);
  LoadOptions direct_opt;
  direct_opt.frozen_bf16 = true;
  auto detour = LlamaModel::load(dir), direct = LlamaModel::load(dir, direct_opt);
  const ComputeTarget t{Device::cuda(0), DType::BF16};
  place_for_inference(*detour, t);
  place_for_inference(*direct, t);
  const std::vector<int32_t> prompt = random_prompt(detour->config().vocab_size, 11, 5);
  auto a = detour->new_cache(24), b = direct->new_cache(24);
  std::vector<int64_t> feed(prompt.begin(), prompt.end());
  for (int s = 0; s < 6; ++s) {
    const std::vector<float> la = detour->decode(a, feed), lb = direct->decode(b, feed);
    ASSERT_EQ(la.size(), lb.size());
    EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0) << "step " << s;
    feed = {int64_t(std::max_element(la.begin(), la.end()) - la.begin())};
  }
  GenerateOptions o;
  o.max_new_tokens = 8;
  EXPECT_EQ(generate(*detour, prompt, o), generate(*direct, prompt, o));
}

INSTANTIATE_TEST_SUITE_P(TinyModels, GpuTools,
                         ::testing::Combine(::testing::Values("tiny-llama3", "tiny-qwen3"),
                                            ::testing::Values(DType::F32, DType::BF16)),
                         param_name);

// A bitsandbytes 4-bit folder stays 4-bit on the GPU for eval and generate (its weights decoded
// just before each product, as QLoRA trains), and gives the CPU's loss.
TEST(GpuToolsQlora, FourBitBaseStaysFourBitForEvalAndGenerate) {
  REQUIRE_GPU();
  const std::string dir = data("bnb-nf4/tiny_llama_bnb4");
  auto cpu = LlamaModel::load(dir);
  ASSERT_TRUE(cpu->is_quantized());
  const TokenDataset ds = random_dataset(cpu->config().vocab_size, 17, 5);
  const EvalResult want = evaluate(*cpu, ds, 48, 4);
  for (DType dt : {DType::F32, DType::BF16}) {
    auto gpu = LlamaModel::load(dir);
    const size_t packed = gpu->quantized_bytes();
    place_for_inference(*gpu, ComputeTarget{Device::cuda(0), dt});
    ASSERT_TRUE(gpu->is_quantized()) << dtype_label(dt);
    EXPECT_EQ(gpu->quantized_bytes(), packed);
    int four_bit = 0;
    for (const auto& p : gpu->params())
      if (p.quant) {
        EXPECT_TRUE(p.quant->packed.device().is_cuda()) << p.name;
        EXPECT_FALSE(p.value.defined()) << p.name << ": a decoded copy kept";
        ++four_bit;
      }
    EXPECT_GT(four_bit, 0);
    const EvalResult got = evaluate(*gpu, ds, 48, 4);
    const double tol = dt == DType::F32 ? 1e-5 : 1e-2;
    EXPECT_NEAR(got.loss, want.loss, tol * want.loss) << dtype_label(dt);
    GenerateOptions o;
    o.max_new_tokens = 6;
    const auto ids = generate(*gpu, random_prompt(cpu->config().vocab_size, 9, 2), o);
    EXPECT_EQ(ids.size(), size_t(6));
    std::printf("4-bit base %s: eval loss cpu %.6f gpu %.6f\n", dtype_label(dt), want.loss,
                got.loss);
  }
}

namespace {

// Parameters of two models by name, compared: the largest normalised error and how many differ
// in any bit.
struct WeightsDiff {
  double worst = 0;
  std::string worst_name;
  int compared = 0, identical = 0;
};
WeightsDiff compare_weights(LlamaModel& a, LlamaModel& b) {
  WeightsDiff d;
  for (auto& p : a.params()) {
    Param* q = b.find_param(p.name);
    EXPECT_NE(q, nullptr) << p.name;
    if (!q) continue;
    EXPECT_EQ(p.value.shape(), q->value.shape()) << p.name;
    EXPECT_TRUE(q->value.device().is_cpu()) << p.name << ": the model stays on the host";
    const double e = rel_err(q->value, p.value);
    if (e > d.worst) {
      d.worst = e;
      d.worst_name = p.name;
    }
    d.identical += p.value.nbytes() == q->value.nbytes() &&
                   std::memcmp(p.value.raw(), q->value.raw(), p.value.nbytes()) == 0;
    ++d.compared;
  }
  return d;
}

}  // namespace

// merge_lora with a GPU as `compute`: each weight decoded and folded on the GPU in float32, the
// model on the host throughout, against the CPU's merge: the fixture's PEFT adapter on the
// float32 model, and an adapter on q and v over the 4-bit base (its other linear weights are only
// decoded, bit for bit the CPU's decoding).
TEST(GpuToolsMerge, MergeOnTheGpuMatchesTheCpu) {
  REQUIRE_GPU();
  {
    const std::string model = data("hf/tiny-llama3/model"),
                      adapter = data("hf/tiny-llama3/lora_adapter");
    auto cpu = LlamaModel::load(model), gpu = LlamaModel::load(model);
    cpu->load_adapter(adapter);
    gpu->load_adapter(adapter);
    cpu->merge_lora();
    gpu->merge_lora(Device::cuda(0));
    EXPECT_TRUE(gpu->device().is_cpu());
    EXPECT_FALSE(gpu->has_lora());
    const WeightsDiff d = compare_weights(*cpu, *gpu);
    EXPECT_LT(d.worst, 1e-6) << d.worst_name;
    EXPECT_EQ(d.compared, int(cpu->params().size()));
    std::printf("merge tiny-llama3 on the GPU: worst normalised weight error %.2e (%s)\n", d.worst,
                d.worst_name.c_str());
  }
  {
    const std::string dir = temp_dir("gpu_merge_4bit"), base = data("bnb-nf4/tiny_llama_bnb4");
    auto m = LlamaModel::load(base);
    LoraConfig lc;
    lc.r = 4;
    lc.alpha = 8;
    lc.targets = {"q_proj", "v_proj"};
    m->add_lora(lc, 9);
    std::mt19937 rng(4);
    std::normal_distribution<float> nd(0.0f, 0.05f);
    for (auto& p : m->params())  // B is zero at init: give the fold something to add
      if (p.name.find("lora_B") != std::string::npos)
        for (int64_t i = 0; i < p.value.numel(); ++i) p.value.f32()[i] = nd(rng);
    m->save_adapter(dir + "/adapter");
    auto cpu = LlamaModel::load(base), gpu = LlamaModel::load(base);
    cpu->load_adapter(dir + "/adapter");
    gpu->load_adapter(dir + "/adapter");
    cpu->merge_lora();
    gpu->merge_lora(Device::cuda(0));
    EXPECT_FALSE(gpu->is_quantized());
    const WeightsDiff d = compare_weights(*cpu, *gpu);
    EXPECT_LT(d.worst, 1e-6) << d.worst_name;
    // Everything but the 2 x layers folded weights is bit for bit the CPU's.
    const int folded = 2 * int(cpu->config().num_layers);
    EXPECT_GE(d.identical, d.compared - folded);
    std::printf("merge onto the 4-bit base on the GPU: worst %.2e (%s), %d of %d bit-identical\n",
                d.worst, d.worst_name.c_str(), d.identical, d.compared);
  }
}

namespace {

// The rig binary: RIG_BINARY, else beside this test binary (a bundle), else the build's.
std::string rig_binary() {
  if (const char* v = std::getenv("RIG_BINARY"); v && *v) return v;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::exists(self.parent_path() / "rig")) return (self.parent_path() / "rig").string();
  if (!ec && fs::exists(self.parent_path().parent_path() / "rig"))
    return (self.parent_path().parent_path() / "rig").string();
  return RIG_BINARY;
}

struct CliRun {
  int code = -1;
  std::string out;
};
CliRun run_rig(const std::string& args) {
  const std::string cmd = rig_binary() + " " + args + " 2>&1";
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

double number_after(const std::string& s, const std::string& key) {
  const size_t at = s.find(key);
  return at == std::string::npos ? NAN : std::stod(s.substr(at + key.size()));
}

}  // namespace

// The commands with --device cuda: the same text as the CPU in float32, bf16 by default with
// the speed line of --stats, a merge computed on the GPU, debug forward-backward's loss, and a
// GPU index past the visible ones as one line.
// Ranks launched as processes sharing a GPU hold a CUDA IPC staging buffer outside the allocator;
// max_memory counts it, so a cap no larger than that buffer is refused before any model is placed
// (else the budget left for the allocator would wrap around and lift the cap).
TEST(GpuToolsCli, MaxMemoryNoLargerThanTheIpcStagingBufferIsRefused) {
  REQUIRE_GPU();
  if (!fs::exists(rig_binary())) GTEST_SKIP() << "no rig binary at " << rig_binary();
  const std::string run = temp_dir("gpu_shared_tiny_cap") + "/run";
  const CliRun r = run_rig("train " + env_or("RIG_SOURCE_DIR", RIG_SOURCE_DIR) +
                           "/tests/data/configs/tiny-llama3-lora.yaml --quiet --nproc-per-node 2 "
                           "--output " +
                           run +
                           " --set device=cuda max_memory=16MiB max_steps=3 eval.split=0 "
                           "save.every=0");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("leaves nothing beside the 33554432 bytes of collective"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(run + "/final"));
}

TEST(GpuToolsCli, CommandsRunOnCuda) {
  REQUIRE_GPU();
  if (!fs::exists(rig_binary())) GTEST_SKIP() << "no rig binary at " << rig_binary();
  const std::string dir = temp_dir("gpu_tools_cli");
  const std::string src = env_or("RIG_SOURCE_DIR", RIG_SOURCE_DIR);
  const std::string tok = src + "/data/demo/tokenizer.json";
  {
    auto m = LlamaModel::random(ModelConfig::from_json({{"model_type", "llama"},
                                                        {"vocab_size", 264},
                                                        {"hidden_size", 64},
                                                        {"intermediate_size", 128},
                                                        {"num_hidden_layers", 2},
                                                        {"num_attention_heads", 4},
                                                        {"num_key_value_heads", 2}},
                                                       "t"),
                                3);
    for (auto& p : m->params())
      if (p.name.find("norm") == std::string::npos) ops::scale_(p.value, 5.0f);
    m->save_pretrained(dir + "/m");
    fs::copy_file(tok, dir + "/m/tokenizer.json");
  }
  const std::string gen =
      "generate --model " + dir + "/m --prompt 'reverse abcdef' --max-new-tokens 12";
  const CliRun cpu = run_rig(gen + " --device cpu");
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  const CliRun f32 = run_rig(gen + " --device cuda --dtype f32");
  ASSERT_EQ(f32.code, 0) << f32.out;
  EXPECT_EQ(f32.out, cpu.out)
      << "float32 on the GPU (a tie within 1e-6 would explain a difference)";
  const CliRun bf = run_rig(gen + " --device cuda --stats --ignore-eos");
  ASSERT_EQ(bf.code, 0) << bf.out;
  EXPECT_NE(bf.out.find("rig generate: cuda:0, bf16 (greedy)"), std::string::npos) << bf.out;
  EXPECT_NE(bf.out.find("12 new tokens, decode "), std::string::npos) << bf.out;
  EXPECT_NE(bf.out.find("reserved on cuda:0"), std::string::npos) << bf.out;
  std::printf("%s", bf.out.c_str());

  const std::string data_file = src + "/data/demo/reverse.jsonl";
  const std::string ev = "eval --model " + dir + "/m --data " + data_file + " --seq 64 --batch 64";
  const CliRun ec = run_rig(ev + " --device cpu");
  const CliRun eg = run_rig(ev + " --device cuda --dtype f32");
  const CliRun eb = run_rig(ev + " --device cuda --stats");
  ASSERT_EQ(ec.code, 0) << ec.out;
  ASSERT_EQ(eg.code, 0) << eg.out;
  ASSERT_EQ(eb.code, 0) << eb.out;
  const double lc = number_after(ec.out, "loss "), lg = number_after(eg.out, "loss "),
               lb = number_after(eb.out, "loss ");
  EXPECT_NEAR(lg, lc, 1e-4 * lc + 1e-4);  // printed with 4 decimals
  EXPECT_NEAR(lb, lc, 1e-2 * lc);
  EXPECT_NE(eb.out.find("rig eval: cuda:0, bf16"), std::string::npos) << eb.out;

  const std::string model = data("hf/tiny-llama3/model"),
                    adapter = data("hf/tiny-llama3/lora_adapter");
  const CliRun mg = run_rig("merge --model " + model + " --adapter " + adapter + " --out " + dir +
                            "/merged --device cuda");
  ASSERT_EQ(mg.code, 0) << mg.out;
  EXPECT_NE(mg.out.find("computed on cuda:0"), std::string::npos) << mg.out;
  auto want = LlamaModel::load(model);
  want->load_adapter(adapter);
  want->merge_lora();
  auto merged = LlamaModel::load(dir + "/merged");
  EXPECT_LT(compare_weights(*want, *merged).worst, 1e-6);

  const std::string batch = data("hf/tiny-llama3/forward_backward.safetensors");
  const CliRun fb = run_rig("debug forward-backward --model " + model + " --batch " + batch +
                            " --out " + dir + "/fb.safetensors --device cuda");
  ASSERT_EQ(fb.code, 0) << fb.out;
  EXPECT_NE(fb.out.find("(computed on cuda:0, f32)"), std::string::npos) << fb.out;
  auto ref = SafeTensorsFile::open(batch);
  auto mine = SafeTensorsFile::open(dir + "/fb.safetensors");
  const float want_loss = ref.get_f32("loss").f32()[0];
  // transformers' own loss and logits: the CPU is within 1e-5 of them, float32 on the GPU adds
  // its summation order.
  EXPECT_NEAR(mine.get_f32("loss").f32()[0], want_loss, 2e-5 * std::fabs(want_loss));
  EXPECT_LT(rel_err(mine.get_f32("logits"), ref.get_f32("logits")), 2e-5);

  const CliRun bad = run_rig(gen + " --device cuda:99");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("rig: generate: device 'cuda:99' requested, but only "), std::string::npos)
      << bad.out;
  EXPECT_EQ(std::count(bad.out.begin(), bad.out.end(), '\n'), 1) << bad.out;
}
