// The model and the training loop on the GPU (float32) against the Hugging Face fixtures and the
// CPU oracle. Skipped with the reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
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

INSTANTIATE_TEST_SUITE_P(TinyModels, GpuGolden, ::testing::Values("tiny-llama3", "tiny-qwen2"));

TEST(GpuTraining, LossCurveFollowsTransformers) {
  REQUIRE_GPU();
  const std::string dir = data("hf/tiny-llama3/");
  auto ref = nlohmann::json::parse(read_file(dir + "loss_curve.json"));
  Tensor tokens = SafeTensorsFile::open(dir + "loss_curve_data.safetensors").get("tokens");
  auto m = LlamaModel::load(dir + "model");
  m->to_device(Device::cuda(0));
  OptimizerConfig oc;
  oc.lr = ref["optimizer"]["lr"];
  oc.beta1 = ref["optimizer"]["betas"][0];
  oc.beta2 = ref["optimizer"]["betas"][1];
  oc.eps = ref["optimizer"]["eps"];
  oc.weight_decay = ref["optimizer"]["weight_decay"];
  oc.max_grad_norm = ref["optimizer"]["clip_grad_norm"];
  AdamW opt(oc);
  const int64_t steps = ref["steps"], B = ref["batch"], T = ref["seq"], row = tokens.dim(2);
  double worst = 0;
  for (int64_t s = 0; s < steps; ++s) {
    TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64), {}, {}};
    for (int64_t i = 0; i < B; ++i)
      for (int64_t t = 0; t < T; ++t)
        b.input_ids.data<int64_t>()[i * T + t] = b.labels.data<int64_t>()[i * T + t] =
            tokens.data<int64_t>()[(s * B + i) * row + t];
    m->zero_grad();
    double loss = m->step(b, StepOptions{}).loss();
    opt.clip_and_step(m->params(), oc.lr * std::min(1.0f, float(s + 1) / 20.0f));
    double rel = std::fabs(loss - ref["losses"][size_t(s)].get<double>()) / ref["losses"][size_t(s)].get<double>();
    worst = std::max(worst, rel);
    ASSERT_LT(rel, 1e-2) << "step " << s;
  }
  std::printf("GPU loss curve: worst relative difference over %lld steps %.2e\n", (long long)steps, worst);
}

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
