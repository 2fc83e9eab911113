// rig bench train: training tokens/s and peak memory of the engine on a model shape.
#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

#include "command.h"
#include "rig/core/allocator.h"
#include "rig/model/llama.h"
#include "rig/optim/adamw.h"

namespace {

struct Opts {
  std::string model;
  int64_t hidden = 256, layers = 8, heads = 8, kv_heads = 4, inter = 688, vocab = 8000;
  int64_t batch = 4, seq = 256, steps = 5, warmup = 1;
  std::string method = "full", device = "cpu";
  int lora_r = 16;
  bool ckpt = false, json = false;
};

int run(const Opts& o) {
  std::unique_ptr<rig::LlamaModel> m;
  if (!o.model.empty()) {
    m = rig::LlamaModel::load(o.model);
  } else {
    nlohmann::json j = {{"model_type", "llama"},          {"vocab_size", o.vocab},
                        {"hidden_size", o.hidden},        {"intermediate_size", o.inter},
                        {"num_hidden_layers", o.layers},  {"num_attention_heads", o.heads},
                        {"num_key_value_heads", o.kv_heads}};
    m = rig::LlamaModel::random(rig::ModelConfig::from_json(j, "bench shape"), 1);
  }
  if (o.method == "lora") {
    rig::LoraConfig lc;
    lc.r = o.lora_r;
    lc.alpha = float(2 * o.lora_r);
    m->add_lora(lc, 1);
  } else if (o.method != "full") {
    rig::bad_input("--method '{}' is not one of full, lora", o.method);
  }
  const rig::Device dev = rig::Device::parse(o.device);
  m->to_device(dev);
  const auto& cfg = m->config();
  std::mt19937_64 rng(1);
  rig::TokenBatch b{rig::Tensor::empty({o.batch, o.seq}, rig::DType::I64),
                    rig::Tensor::empty({o.batch, o.seq}, rig::DType::I64), {}, {}};
  for (int64_t i = 0; i < o.batch * o.seq; ++i)
    b.input_ids.data<int64_t>()[i] = b.labels.data<int64_t>()[i] = int64_t(rng() % uint64_t(cfg.vocab_size));
  rig::AdamW opt(rig::OptimizerConfig{});
  rig::StepOptions so;
  so.checkpointing = o.ckpt ? rig::Checkpointing::Full : rig::Checkpointing::None;
  auto& alloc = rig::allocator_for(dev);
  double secs = 0;
  for (int64_t s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) alloc.reset_peak();
    auto t0 = std::chrono::steady_clock::now();
    m->zero_grad();
    m->step(b, so);
    opt.clip_and_step(m->params(), 1e-4f);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= o.warmup) secs += dt;
  }
  const double tokens = double(o.batch * o.seq * o.steps);
  const double n = double(m->num_parameters(false));
  const double flops_per_token = (o.method == "full" ? 6.0 : 4.0) * n +
                                 12.0 * double(cfg.num_layers * cfg.hidden_size * o.seq);
  nlohmann::json r = {{"device", dev.str()},
                      {"method", o.method},
                      {"parameters", int64_t(n)},
                      {"trainable_parameters", m->num_parameters(true)},
                      {"batch", o.batch},
                      {"seq", o.seq},
                      {"checkpointing", o.ckpt},
                      {"tokens_per_s", tokens / secs},
                      {"tflops", tokens / secs * flops_per_token / 1e12},
                      {"step_ms", 1e3 * secs / double(o.steps)},
                      {"peak_memory_bytes", alloc.peak()}};
  if (o.json) {
    fmt::print("{}\n", r.dump());
  } else {
    fmt::print("{} {} params ({} trainable), batch {} x seq {}{}: {:.0f} tokens/s, {:.1f} ms/step, "
               "{:.3f} TFLOP/s, peak {}\n",
               o.method, int64_t(n), m->num_parameters(true), o.batch, o.seq,
               o.ckpt ? ", checkpointing" : "", tokens / secs, 1e3 * secs / double(o.steps),
               tokens / secs * flops_per_token / 1e12, rig::format_bytes(double(alloc.peak())));
  }
  return 0;
}

rig::cli::Registrar reg("bench train", "Measure training tokens/s and peak memory", [](CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("--model", o->model, "Hugging Face model folder (default: a random model of the shape below)");
  app.add_option("--hidden", o->hidden, "hidden size")->capture_default_str();
  app.add_option("--layers", o->layers, "layers")->capture_default_str();
  app.add_option("--heads", o->heads, "attention heads")->capture_default_str();
  app.add_option("--kv-heads", o->kv_heads, "key/value heads")->capture_default_str();
  app.add_option("--intermediate", o->inter, "MLP size")->capture_default_str();
  app.add_option("--vocab", o->vocab, "vocabulary")->capture_default_str();
  app.add_option("--batch", o->batch, "micro-batch")->capture_default_str();
  app.add_option("--seq", o->seq, "sequence length")->capture_default_str();
  app.add_option("--steps", o->steps, "timed steps")->capture_default_str();
  app.add_option("--method", o->method, "full or lora")->capture_default_str();
  app.add_option("--lora-r", o->lora_r, "LoRA rank")->capture_default_str();
  app.add_option("--device", o->device, "cpu, cuda or cuda:N")->capture_default_str();
  app.add_flag("--checkpointing", o->ckpt, "recompute each layer's forward in backward");
  app.add_flag("--json", o->json, "one JSON line");
  return [o] { return run(*o); };
});

}  // namespace
