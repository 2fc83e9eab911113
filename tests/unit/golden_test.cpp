// The CPU engine against Hugging Face transformers and PEFT (tests/data/hf, made in float32).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "hf_reference.h"
#include "rig/core/allocator.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/optim/adamw.h"
#include "test_util.h"

using namespace rig;
using json = nlohmann::json;

namespace {

double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double num = 0, den = 0;
  const float *pa = a.f32(), *pb = b.f32();
  for (int64_t i = 0; i < a.numel(); ++i) {
    num += double(pa[i] - pb[i]) * double(pa[i] - pb[i]);
    den += double(pb[i]) * pb[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

std::string fixture(const std::string& model, const std::string& f) {
  return test::data_path("hf/" + model + "/" + f);
}

TokenBatch batch_from(const SafeTensorsFile& f, const std::string& suffix = "") {
  return TokenBatch{f.get("input_ids" + suffix).clone(), f.get("labels" + suffix).clone(), {}, {}};
}

json reference(const std::string& model) {
  return json::parse(read_file(fixture(model, "reference.json")));
}

using test::optimizer_from;

// One float32 step with logits, compared with the reference's loss and logits.
Tensor check_forward(LlamaModel& m, const SafeTensorsFile& batch, const SafeTensorsFile& ref) {
  m.zero_grad();
  Tensor logits;
  StepOptions opt;
  opt.logits = &logits;
  auto r = m.step(batch_from(batch), opt);
  const double want = ref.get_f32("loss").f32()[0];
  EXPECT_NEAR(r.loss(), want, 1e-5 * std::fabs(want));
  EXPECT_LT(rel_err(logits, ref.get_f32("logits")), 1e-5);
  return logits;
}

class Golden : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(Golden, ForwardBackwardMatchesTransformers) {
  auto m = LlamaModel::load(fixture(GetParam(), "model"));
  auto ref = SafeTensorsFile::open(fixture(GetParam(), "forward_backward.safetensors"));
  check_forward(*m, ref, ref);
  int checked = 0;
  for (auto& p : m->params()) {
    std::string key = "grad." + p.name;
    ASSERT_TRUE(ref.has(key)) << key;
    EXPECT_LT(rel_err(p.grad, ref.get_f32(key)), 1e-4) << key;
    ++checked;
  }
  // Every gradient in the reference has a counterpart.
  int in_ref = 0;
  for (auto& t : ref.tensors()) in_ref += t.name.rfind("grad.", 0) == 0;
  EXPECT_EQ(checked, in_ref);
}

// Every checkpointing mode computes the same gradients bit for bit (the recomputed values are the
// same operations on the same inputs), each keeping less than the one before it.
TEST_P(Golden, CheckpointingModesGiveIdenticalGradientsAndLowerPeaks) {
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA on q,v,down" : "full fine-tuning");
    auto m = LlamaModel::load(fixture(GetParam(), "model"));
    if (lora) {
      LoraConfig lc;
      lc.targets = {"q_proj", "v_proj", "down_proj"};
      m->add_lora(lc, 7);
    }
    auto ref = SafeTensorsFile::open(fixture(GetParam(), "forward_backward.safetensors"));
    TokenBatch b = batch_from(ref);
    std::vector<Tensor> plain;
    struct Mode {
      Checkpointing ck;
      int64_t recompute_layers;
      const char* name;
    };
    const Mode modes[] = {{Checkpointing::None, -1, "none"},
                          {Checkpointing::Selective, -1, "selective"},
                          {Checkpointing::Full, 1, "full, one layer recomputed"},
                          {Checkpointing::Full, -1, "full"}};
    size_t prev_peak = 0;
    for (const Mode& mode : modes) {
      SCOPED_TRACE(mode.name);
      m->zero_grad();
      StepOptions opt;
      opt.checkpointing = mode.ck;
      opt.recompute_layers = mode.recompute_layers;
      size_t base = cpu_allocator().in_use();
      cpu_allocator().reset_peak();
      m->step(b, opt);
      const size_t peak = cpu_allocator().peak() - base;
      if (prev_peak) {
        EXPECT_LT(peak, prev_peak);
      }
      prev_peak = peak;
      for (size_t i = 0; i < m->params().size(); ++i) {
        const Tensor& g = m->params()[i].grad;
        if (!g.defined()) continue;
        if (plain.size() <= i) plain.resize(m->params().size());
        if (!plain[i].defined()) {
          plain[i] = g.clone();
        } else {
          EXPECT_EQ(0, std::memcmp(g.raw(), plain[i].raw(), g.nbytes())) << m->params()[i].name;
        }
      }
    }
  }
}

TEST_P(Golden, LoraForwardBackwardMatchesPeft) {
  auto m = LlamaModel::load(fixture(GetParam(), "model"));
  m->load_adapter(fixture(GetParam(), "lora_adapter"));
  auto ref = SafeTensorsFile::open(fixture(GetParam(), "lora_forward_backward.safetensors"));
  auto fb = SafeTensorsFile::open(fixture(GetParam(), "forward_backward.safetensors"));
  check_forward(*m, fb, ref);
  int checked = 0;
  for (auto& p : m->params()) {
    if (!p.trainable) {
      EXPECT_FALSE(p.grad.defined()) << p.name;
      continue;
    }
    EXPECT_LT(rel_err(p.grad, ref.get_f32("grad." + p.name)), 1e-4) << p.name;
    ++checked;
  }
  EXPECT_EQ(checked, int(m->config().num_layers) * 14);
}

TEST_P(Golden, AdamWFiveStepsMatchTorch) {
  auto m = LlamaModel::load(fixture(GetParam(), "model"));
  auto ref = SafeTensorsFile::open(fixture(GetParam(), "adamw_5steps.safetensors"));
  json cfg = reference(GetParam())["adamw_5steps"];
  OptimizerConfig oc = optimizer_from(cfg);
  AdamW opt(oc);
  for (int s = 0; s < 5; ++s) {
    m->zero_grad();
    auto r = m->step(batch_from(ref, std::string(".") + std::to_string(s)), StepOptions{});
    EXPECT_NEAR(r.loss(), cfg["losses"][s].get<double>(), 1e-4) << "step " << s;
    double norm = opt.clip_and_step(m->params(), oc.lr);
    EXPECT_NEAR(norm, cfg["grad_norms_before_clip"][s].get<double>(), 1e-4 * norm) << "step " << s;
  }
  for (auto& p : m->params())
    EXPECT_LT(rel_err(p.value, ref.get_f32("param." + p.name)), 1e-4) << p.name;
}

TEST_P(Golden, LoraAdamWFiveStepsMatchPeft) {
  auto m = LlamaModel::load(fixture(GetParam(), "model"));
  m->load_adapter(fixture(GetParam(), "lora_adapter"));
  auto ref = SafeTensorsFile::open(fixture(GetParam(), "lora_forward_backward.safetensors"));
  // The LoRA trajectory uses the same five batches as the full one.
  auto batches = SafeTensorsFile::open(fixture(GetParam(), "adamw_5steps.safetensors"));
  json cfg = reference(GetParam())["lora"]["adamw"];
  OptimizerConfig oc = optimizer_from(cfg);
  AdamW opt(oc);
  for (int s = 0; s < cfg["steps"].get<int>(); ++s) {
    m->zero_grad();
    auto r = m->step(batch_from(batches, std::string(".") + std::to_string(s)), StepOptions{});
    EXPECT_NEAR(r.loss(), cfg["losses"][s].get<double>(), 1e-4) << "step " << s;
    opt.clip_and_step(m->params(), oc.lr);
  }
  for (auto& p : m->params())
    if (p.trainable) {
      EXPECT_LT(rel_err(p.value, ref.get_f32("trained." + p.name)), 1e-4) << p.name;
    }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, Golden,
                         ::testing::Values("tiny-llama3", "tiny-qwen2", "tiny-qwen3"));

TEST(GoldenCli, DebugForwardBackwardWritesHfNames) {
  std::string out = test::temp_dir("dbg") + "/fb.safetensors";
  auto r = test::run_rig("debug forward-backward --model " + fixture("tiny-llama3", "model") + " --batch " +
                         fixture("tiny-llama3", "forward_backward.safetensors") + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  auto mine = SafeTensorsFile::open(out);
  auto ref = SafeTensorsFile::open(fixture("tiny-llama3", "forward_backward.safetensors"));
  for (const auto& t : ref.tensors()) {
    if (t.name == "input_ids" || t.name == "labels") continue;
    ASSERT_TRUE(mine.has(t.name)) << t.name;
    EXPECT_LT(rel_err(mine.get_f32(t.name), ref.get_f32(t.name)), 1e-4) << t.name;
  }
}

TEST(GoldenCli, DebugForwardBackwardRejectsBadBatch) {
  std::string dir = test::temp_dir("dbg_bad");
  save_safetensors(dir + "/b.safetensors", {{"input_ids", Tensor::from_f32({1, 2}, {1, 2})}});
  auto r = test::run_rig("debug forward-backward --model " + fixture("tiny-llama3", "model") +
                         " --batch " + dir + "/b.safetensors --out " + dir + "/o.safetensors");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("'input_ids' must be int64"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/o.safetensors"));
}
