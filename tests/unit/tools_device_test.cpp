// --device and --dtype of rig eval, generate, merge and debug forward-backward, on the CPU: the
// CPU computes what it computed before the flags existed, and a CUDA device that cannot be had is
// one line and a non-zero exit, before anything loads. (tests/gpu/tools_gpu_test.cpp compares the
// GPU with the CPU.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "rig/data/records.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/ops/ops.h"
#include "rig/text/tokenizer.h"
#include "rig/train/inference.h"
#include "rig/train/trainer.h"
#include "test_util.h"

using namespace rig;

namespace {

const std::string kTok = std::string(RIG_SOURCE_DIR) + "/data/demo/tokenizer.json";

// A random model over the demo tokenizer's vocabulary, written once.
const std::string& tiny_model() {
  static const std::string dir = [] {
    const std::string d = test::temp_dir("device_model");
    auto m = LlamaModel::random(ModelConfig::from_json({{"model_type", "llama"},
                                                        {"vocab_size", 264},
                                                        {"hidden_size", 64},
                                                        {"intermediate_size", 128},
                                                        {"num_hidden_layers", 2},
                                                        {"num_attention_heads", 4},
                                                        {"num_key_value_heads", 2}},
                                                       "t"),
                                3);
    // Larger weights than the default 0.02, so that the logits spread and greedy picks vary.
    for (auto& p : m->params())
      if (p.name.find("norm") == std::string::npos) ops::scale_(p.value, 5.0f);
    m->save_pretrained(d + "/m");
    std::filesystem::copy_file(kTok, d + "/m/tokenizer.json");
    return d + "/m";
  }();
  return dir;
}

// The generation loop as it was before --device: every step's logits to the host, sample_token.
std::vector<int32_t> generate_as_before(LlamaModel& m, const std::vector<int32_t>& prompt,
                                        const GenerateOptions& opt) {
  auto cache = m.new_cache(int64_t(prompt.size()) + opt.max_new_tokens + 1);
  std::vector<float> logits = m.decode(cache, std::vector<int64_t>(prompt.begin(), prompt.end()));
  const size_t limit =
      opt.vocab_limit > 0 ? std::min(logits.size(), size_t(opt.vocab_limit)) : logits.size();
  std::mt19937_64 rng(opt.seed);
  std::vector<int32_t> out;
  for (int64_t t = 0; t < opt.max_new_tokens; ++t) {
    logits.resize(limit);
    const int32_t next = sample_token(logits, opt.temperature, opt.top_p, rng);
    out.push_back(next);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) break;
    logits = m.decode(cache, {next});
  }
  return out;
}

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

int count_lines(const std::string& s) {
  return int(std::count(s.begin(), s.end(), '\n'));
}

}  // namespace

TEST(ComputeTarget, AutoIsTheCpuWithoutAGpuAndBf16NeedsCuda) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is visible: auto would pick it";
  const ComputeTarget t = resolve_compute("auto", "auto", "eval");
  EXPECT_TRUE(t.device.is_cpu());
  EXPECT_EQ(t.dtype, DType::F32);
  EXPECT_EQ(t.str(), "cpu, f32");
  EXPECT_EQ(resolve_compute("cpu", "f32", "eval").dtype, DType::F32);
  EXPECT_EQ(resolve_compute("cpu", "fp32", "eval").dtype, DType::F32);
  auto message = [](const std::string& dev, const std::string& dt) {
    try {
      resolve_compute(dev, dt, "eval");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("cpu", "bf16"),
            "eval: --dtype bf16 needs a CUDA device; the CPU backend computes in f32");
  EXPECT_EQ(message("cpu", "f16"), "eval: --dtype 'f16' is not one of auto, f32, bf16");
  EXPECT_EQ(message("tpu", "auto"), "eval: device 'tpu' is not one of auto, cpu, cuda, cuda:N");
  for (const char* dev : {"cuda", "cuda:0", "cuda:3", "gpu"}) {
    const std::string m = message(dev, "auto");
    EXPECT_EQ(m.rfind(fmt::format("eval: device '{}' requested, but ", dev), 0), 0u) << m;
#ifdef RIG_WITH_CUDA
    EXPECT_NE(m.find("no CUDA GPU is visible"), std::string::npos) << m;
#else
    EXPECT_NE(m.find("this rig was built without CUDA"), std::string::npos) << m;
#endif
  }
}

// Each command names the flag in one line and exits non-zero before it reads the model (which
// does not exist here), so a wrong --device costs nothing.
TEST(ToolsDevice, CudaWithoutAGpuIsOneLineBeforeAnythingLoads) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is visible: --device cuda would run";
  const std::string why =
#ifdef RIG_WITH_CUDA
      "no CUDA GPU is visible";
#else
      "this rig was built without CUDA";
#endif
  const std::vector<std::pair<std::string, std::string>> cmds = {
      {"generate --model /nonexistent --prompt hi", "generate"},
      {"eval --model /nonexistent --data /nonexistent.jsonl", "eval"},
      {"merge --model /nonexistent --adapter /nonexistent --out /tmp/rig-never", "merge"},
      {"debug forward-backward --model /nonexistent --batch /nonexistent --out /tmp/rig-never",
       "debug forward-backward"},
  };
  for (const auto& [args, name] : cmds) {
    for (const char* dev : {"cuda", "cuda:1"}) {
      auto r = test::run_rig(args + " --device " + dev);
      EXPECT_NE(r.code, 0) << args;
      EXPECT_EQ(r.out, fmt::format("rig: {}: device '{}' requested, but {}\n", name, dev, why))
          << args;
    }
  }
  for (const char* args : {"generate --model /nonexistent --prompt hi --dtype bf16",
                           "eval --model /nonexistent --data x --device cpu --dtype bf16",
                           "debug forward-backward --model /nonexistent --batch b --out o "
                           "--dtype bf16"}) {
    auto r = test::run_rig(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_EQ(count_lines(r.out), 1) << r.out;
    EXPECT_NE(r.out.find("--dtype bf16 needs a CUDA device"), std::string::npos) << r.out;
  }
  auto r = test::run_rig("generate --model /nonexistent --prompt hi --device tpu");
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(r.out, "rig: generate: device 'tpu' is not one of auto, cpu, cuda, cuda:N\n");
  ASSERT_FALSE(std::filesystem::exists("/tmp/rig-never"));
}

// Greedy and sampled text of `rig generate --device cpu` is what the loop before --device
// produced, and --stats adds one line on stderr with the prompt, prefill and decode speed.
TEST(ToolsDevice, GenerateOnTheCpuIsUnchanged) {
  const std::string model = tiny_model();
  Tokenizer tok = Tokenizer::load(kTok);
  auto m = LlamaModel::load(model);
  const std::string prompt = "reverse abcde";
  auto ids = tok.encode(prompt, EncodeOptions{true, false});
  for (const char* sampling : {"", " --temperature 0.8 --top-p 0.9 --seed 7"}) {
    GenerateOptions go;
    go.max_new_tokens = 12;
    go.vocab_limit = tok.vocab_size();
    if (*sampling) {
      go.temperature = 0.8f;
      go.top_p = 0.9f;
      go.seed = 7;
    }
    // The demo tokenizer's end tokens stop generation (the model folder names none).
    for (const auto& a : tok.added_tokens())
      if (a.special && (a.content == "<|im_end|>" || a.content == "<|endoftext|>"))
        go.stop_ids.push_back(a.id);
    const std::vector<int32_t> want = generate_as_before(*m, ids, go);
    EXPECT_EQ(generate(*m, ids, go), want) << sampling;
    const std::string text = tok.decode(want, DecodeOptions{true});
    auto r = test::run_rig("generate --model " + model + " --prompt '" + prompt +
                           "' --max-new-tokens 12 --device cpu" + sampling);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out, text + "\n") << sampling;
    r = test::run_rig("generate --model " + model + " --prompt '" + prompt +
                      "' --max-new-tokens 12 --device cpu --dtype f32 --stats" + sampling);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out.substr(0, text.size() + 1), text + "\n");
    const std::string stats = r.out.substr(text.size() + 1);
    EXPECT_EQ(count_lines(stats), 1) << stats;
    EXPECT_EQ(stats.rfind("rig generate: cpu, f32 (", 0), 0u) << stats;
    EXPECT_NE(stats.find(fmt::format("prompt {} tokens, prefill ", ids.size())), std::string::npos)
        << stats;
    EXPECT_NE(stats.find(fmt::format("{} new tokens, decode ", want.size())), std::string::npos)
        << stats;
    EXPECT_NE(stats.find(" tokens/s ("), std::string::npos) << stats;
    EXPECT_NE(stats.find("peak "), std::string::npos) << stats;
  }
  // --ignore-eos: exactly --max-new-tokens tokens whatever is generated.
  GenerateStats st;
  GenerateOptions go;
  go.max_new_tokens = 9;
  generate(*m, ids, go, &st);
  EXPECT_EQ(st.prompt_tokens, int64_t(ids.size()));
  EXPECT_EQ(st.new_tokens, 9);
  EXPECT_GT(st.decode_tokens_per_s(), 0.0);
  auto r = test::run_rig("generate --model " + model + " --prompt '" + prompt +
                         "' --max-new-tokens 9 --device cpu --ignore-eos --stats");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("; 9 new tokens, decode "), std::string::npos) << r.out;
}

// decode_greedy, the GPU's path (argmax where the logits are, the previous pick fed back from
// the device), picks on the CPU what the host argmax of decode's logits picks.
TEST(ToolsDevice, DecodeGreedyFollowsTheHostArgmax) {
  auto m = LlamaModel::load(tiny_model());
  auto a = m->new_cache(40), b = m->new_cache(40);
  ASSERT_TRUE(a.positions.defined() && a.logits.defined() && a.next.defined());
  std::vector<int64_t> prompt = {5, 17, 200, 3, 99, 42, 7};
  for (int64_t limit : {int64_t(0), int64_t(150)}) {
    a = m->new_cache(40);
    b = m->new_cache(40);
    std::vector<float> logits = m->decode(a, prompt);
    int64_t got = m->decode_greedy(b, prompt, limit);
    for (int s = 0; s < 20; ++s) {
      const size_t n = limit > 0 ? size_t(limit) : logits.size();
      const int64_t want =
          std::max_element(logits.begin(), logits.begin() + long(n)) - logits.begin();
      ASSERT_EQ(got, want) << "step " << s << " limit " << limit;
      logits = m->decode(a, {want});
      got = m->decode_greedy(b, {}, limit);
    }
    EXPECT_EQ(a.len, b.len);
  }
  // Without a previous pick there is nothing to feed.
  auto c = m->new_cache(4);
  EXPECT_THROW(m->decode_greedy(c, {}), Error);
}

// rig eval --device cpu prints the loss evaluate() computes on the CPU model; --stats adds one
// stderr line.
TEST(ToolsDevice, EvalOnTheCpuIsUnchanged) {
  const std::string model = tiny_model();
  const std::string data = test::small_data();
  auto r = test::run_rig("eval --model " + model + " --data " + data +
                         " --seq 64 --batch 16 --device cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  auto r0 = test::run_rig("eval --model " + model + " --data " + data + " --seq 64 --batch 16");
  ASSERT_EQ(r0.code, 0) << r0.out;
  if (!cuda_available()) {
    EXPECT_EQ(r0.out, r.out);  // auto is the CPU here
  }
  Tokenizer tok = Tokenizer::load(kTok);
  auto samples = load_samples(data, &tok, RenderOptions{});
  auto ds = TokenDataset::from_samples(samples);
  auto m = LlamaModel::load(model);
  const EvalResult want = evaluate(*m, ds, 64, 16);
  EXPECT_EQ(first_line(r.out),
            fmt::format("loss {:.4f}  perplexity {:.3f}  over {} tokens of {} samples", want.loss,
                        std::exp(want.loss), want.tokens, ds.size()));
  r = test::run_rig("eval --model " + model + " --data " + data +
                    " --seq 64 --batch 16 --device cpu --stats --generate 4");
  ASSERT_EQ(r.code, 0) << r.out;
  const size_t at = r.out.find("rig eval: cpu, f32; load ");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("scored tokens/s", at), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("exact match generation", at), std::string::npos) << r.out;
}

// rig merge --device cpu writes the bytes the merge wrote before --device; merge_lora with the
// model's own device as `compute` is the same merge.
TEST(ToolsDevice, MergeOnTheCpuIsUnchanged) {
  const std::string dir = test::temp_dir("merge_device");
  const std::string model = test::data_path("hf/tiny-llama3/model"),
                    adapter = test::data_path("hf/tiny-llama3/lora_adapter");
  auto r = test::run_rig("merge --model " + model + " --adapter " + adapter + " --out " + dir +
                         "/cpu --device cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("computed on cpu"), std::string::npos) << r.out;
  auto m = LlamaModel::load(model);
  m->load_adapter(adapter);
  m->merge_lora();
  m->save_pretrained(dir + "/lib");
  auto m2 = LlamaModel::load(model);
  m2->load_adapter(adapter);
  m2->merge_lora(Device::cpu());
  m2->save_pretrained(dir + "/lib2");
  auto read = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string want = read(dir + "/lib/model.safetensors");
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(read(dir + "/cpu/model.safetensors") == want);
  EXPECT_TRUE(read(dir + "/lib2/model.safetensors") == want);
}

// rig debug forward-backward --device cpu writes what it wrote before (float32 by default).
TEST(ToolsDevice, DebugForwardBackwardOnTheCpuIsUnchanged) {
  const std::string dir = test::temp_dir("fb_device");
  const std::string model = test::data_path("hf/tiny-llama3/model"),
                    batch = test::data_path("hf/tiny-llama3/forward_backward.safetensors");
  auto r = test::run_rig("debug forward-backward --model " + model + " --batch " + batch +
                         " --out " + dir + "/a.safetensors --device cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(computed on cpu, f32)"), std::string::npos) << r.out;
  auto m = LlamaModel::load(model);
  auto b = SafeTensorsFile::open(batch);
  m->zero_grad();
  Tensor logits;
  StepOptions so;
  so.logits = &logits;
  const StepResult res =
      m->step(TokenBatch{b.get("input_ids").clone(), b.get("labels").clone(), {}, {}}, so);
  auto out = SafeTensorsFile::open(dir + "/a.safetensors");
  EXPECT_EQ(out.get_f32("loss").f32()[0], float(res.loss()));
  Tensor got = out.get_f32("logits");
  ASSERT_EQ(got.numel(), logits.numel());
  EXPECT_EQ(std::memcmp(got.raw(), logits.raw(), logits.nbytes()), 0);
  int grads = 0;
  for (auto& p : m->params()) {
    if (!p.grad.defined()) continue;
    Tensor g = out.get_f32("grad." + p.name);
    ASSERT_EQ(g.nbytes(), p.grad.nbytes()) << p.name;
    EXPECT_EQ(std::memcmp(g.raw(), p.grad.raw(), g.nbytes()), 0) << p.name;
    ++grads;
  }
  EXPECT_GT(grads, 10);
}

// rig debug random-model writes a folder the tools load: config.json of the catalogue shape,
// weights in the asked dtype, the tokenizer beside them.
TEST(ToolsDevice, RandomModelFolderLoadsAndGenerates) {
  const std::string dir = test::temp_dir("random_model");
  auto r = test::run_rig("debug random-model --architecture tiny --out " + dir +
                         "/m --dtype bf16 --tokenizer " + kTok);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("wrote a random tiny"), std::string::npos) << r.out;
  ASSERT_TRUE(std::filesystem::exists(dir + "/m/tokenizer.json"));
  auto w = WeightFiles::open_dir(dir + "/m");
  for (const auto& name : w.names()) EXPECT_EQ(w.info(name).dtype, DType::BF16) << name;
  auto m = LlamaModel::load(dir + "/m");
  EXPECT_GT(m->num_parameters(false), 0);
  r = test::run_rig("generate --model " + dir + "/m --prompt 'reverse abc' --max-new-tokens 4 " +
                    "--device cpu --ignore-eos");
  EXPECT_EQ(r.code, 0) << r.out;
  r = test::run_rig("debug random-model --architecture no-such-model --out " + dir + "/x");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("'no-such-model' is not one of tiny,"), std::string::npos) << r.out;
}
