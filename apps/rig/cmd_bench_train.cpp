// rig bench train: training tokens/s and peak memory of rig train's optimizer step on a model
// shape (random tokens, no data set).
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "command.h"
#include "flags.h"
#include "rig/core/allocator.h"
#include "rig/io/atomic_file.h"
#include "rig/model/catalog.h"
#include "rig/model/llama.h"
#include "rig/model/loss_chunk.h"
#include "rig/ops/profile.h"
#include "rig/optim/adamw.h"
#include "rig/train/train_step.h"
#include "rig/train/trainer.h"

#ifdef RIG_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

struct Opts {
  std::string model, preset, precision = "auto", lora_targets = "all";
  int64_t hidden = 256, layers = 8, heads = 8, kv_heads = 4, inter = 688, vocab = 8000;
  int64_t batch = 4, seq = 256, steps = 5, warmup = 1;
  int64_t packed = 0;  // > 0: rows packed with documents of this average length
  std::string method = "full", device = "cpu", optimizer = "adamw";
  int lora_r = 16;
  std::string ckpt = "none";
  int64_t recompute_layers = -1;
  std::optional<int64_t> loss_chunk_rows;  // unset: the engine's default for the vocabulary
  bool json = false, profile = false;
  std::string trace;
};

// The bench's shape and settings as the config rig train would read: a constant learning rate
// and no dropout, so every step does the same work.
rig::TrainConfig train_config(const Opts& o) {
  rig::TrainConfig c;
  c.source = "bench train";
  c.seed = 1;
  if (!o.model.empty()) {
    c.model = o.model;  // a bitsandbytes 4-bit folder loads as it is with --method qlora
  } else {
    c.init = "random";
    c.architecture = {{"model_type", "llama"},
                      {"vocab_size", o.vocab},
                      {"hidden_size", o.hidden},
                      {"intermediate_size", o.inter},
                      {"num_hidden_layers", o.layers},
                      {"num_attention_heads", o.heads},
                      {"num_key_value_heads", o.kv_heads}};
    // A catalogue shape with plain RoPE, as bench/hf_baseline.py builds it, for side-by-side runs.
    if (!o.preset.empty()) c.architecture.update(rig::catalog_bench_config(o.preset, "--preset"));
  }
  c.method = o.method;
  c.lora.r = o.lora_r;
  c.lora.alpha = 2.0 * o.lora_r;
  c.lora.targets = rig::LoraConfig{}.targets;  // all
  if (o.lora_targets != "all") {
    c.lora.targets.clear();
    for (size_t p = 0; p <= o.lora_targets.size();) {
      size_t e = std::min(o.lora_targets.find(',', p), o.lora_targets.size());
      c.lora.targets.push_back(o.lora_targets.substr(p, e - p));
      p = e + 1;
    }
  }
  c.optimizer.name = o.optimizer;
  c.optimizer.lr = 1e-4;
  c.schedule.name = "constant";
  c.activation_checkpointing = o.ckpt;
  c.recompute_layers = o.recompute_layers;
  c.micro_batch_size = o.batch;
  c.sequence_len = o.seq;
  return c;
}

void check_flags(const Opts& o) {
  // Sizes and counts are checked as the command line is parsed (flags.h): one line naming the
  // flag, before any tensor is allocated.
  if (o.method != "full" && o.method != "lora" && o.method != "qlora")
    rig::bad_input("--method '{}' is not one of full, lora, qlora", o.method);
  if (o.optimizer != "adamw" && o.optimizer != "adamw8bit")
    rig::bad_input("--optimizer '{}' is not one of adamw, adamw8bit", o.optimizer);
  if (o.ckpt != "none" && o.ckpt != "full" && o.ckpt != "selective")
    rig::bad_input("--checkpointing '{}' is not one of none, full, selective", o.ckpt);
}

// Random tokens, every one trained, so each step's gradient is the batch's mean. With packed > 0,
// each row holds documents of lengths uniform in [1, 2 packed - 1] (the last one cut at the row's
// end), laid out as rig train's packer lays them: segment ids 1, 2, ..., positions from 0 in each
// document, and no target across a document boundary. *attention_len: the mean length a token's
// attention spans, sum(L^2) / sum(L) over the documents (the row length without packing).
rig::TokenBatch random_batch(int64_t batch, int64_t seq, int64_t vocab, int64_t packed,
                             double* attention_len) {
  std::mt19937_64 rng(1);
  rig::TokenBatch b{rig::Tensor::empty({batch, seq}, rig::DType::I64),
                    rig::Tensor::empty({batch, seq}, rig::DType::I64),
                    {},
                    {}};
  for (int64_t i = 0; i < batch * seq; ++i)
    b.input_ids.data<int64_t>()[i] = b.labels.data<int64_t>()[i] = int64_t(rng() % uint64_t(vocab));
  *attention_len = double(seq);
  if (packed == 0) return b;
  b.position_ids = rig::Tensor::empty({batch, seq}, rig::DType::I64);
  b.segment_ids = rig::Tensor::empty({batch, seq}, rig::DType::I64);
  std::uniform_int_distribution<int64_t> length(1, 2 * packed - 1);
  double squares = 0;
  for (int64_t r = 0; r < batch; ++r)
    for (int64_t t = 0, id = 1; t < seq; ++id) {
      const int64_t len = std::min(length(rng), seq - t);
      for (int64_t k = 0; k < len; ++k) {
        const int64_t i = r * seq + t + k;
        b.position_ids.data<int64_t>()[i] = k;
        b.segment_ids.data<int64_t>()[i] = id;
        if (k == 0) b.labels.data<int64_t>()[i] = -100;
      }
      squares += double(len) * double(len);
      t += len;
    }
  *attention_len = squares / double(batch * seq);
  return b;
}

// The card's name as the driver gives it ("NVIDIA H200"): `rig plan --calibrate` looks it up in
// its catalog. Empty on the CPU.
std::string gpu_name(rig::Device dev) {
#ifdef RIG_WITH_CUDA
  if (dev.is_cuda()) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, dev.index) == cudaSuccess) return prop.name;
    cudaGetLastError();
  }
#endif
  return "";
}

// One step with every op's span recorded: where the step's time goes, per category and per op.
nlohmann::json profile_step(rig::Device dev, const std::function<void()>& step,
                            const std::string& trace) {
  nlohmann::json breakdown;
  rig::ops::profile_open(dev.is_cuda() ? dev.index : -1);
  step();
  const rig::ops::Profile p = rig::ops::profile_close();
  for (const auto& [cat, ms] : p.category_ms) breakdown[cat + "_ms"] = ms;
  std::map<std::string, std::pair<double, int>> per_op;  // op -> (ms, calls)
  for (const auto& s : p.spans) {
    auto& [ms, calls] = per_op[s.op];
    ms += s.end_ms - s.start_ms;
    ++calls;
  }
  for (const auto& [op, v] : per_op) breakdown["ops"][op] = {{"ms", v.first}, {"calls", v.second}};
  breakdown["step_ms"] = p.wall_ms;
  breakdown["other_ms"] = p.wall_ms - p.op_ms();  // copies, memsets, launch gaps, host work
  breakdown["between_ops_ms"] = p.between_ops_ms();  // the device idle or in non-op work
  if (!trace.empty()) rig::write_file_atomic(trace, p.chrome_trace());
  return breakdown;
}

// The result as lines for a person (without --json): the profiled step's breakdown, then one
// summary line.
void print_text(const Opts& o, const nlohmann::json& r) {
  if (r.contains("breakdown")) {
    const nlohmann::json& breakdown = r["breakdown"];
    const double step = breakdown["step_ms"];
    for (const auto& [k, v] : breakdown.items())
      if (k != "step_ms" && k != "ops")
        fmt::print("  {:<16} {:9.2f} ms  {:5.1f}%\n", k, v.get<double>(),
                   100.0 * v.get<double>() / step);
    fmt::print("  {:<16} {:9.2f} ms\n", "profiled step", step);
  }
  fmt::print(
      "{} {} params ({} trainable), batch {} x seq {}{}{}: {:.0f} tokens/s, {:.1f} ms/step, "
      "{:.3f} TFLOP/s, peak {} in use, {} reserved\n",
      o.method, r["parameters"].get<int64_t>(), r["trainable_parameters"].get<int64_t>(), o.batch,
      o.seq, o.packed > 0 ? fmt::format(" packed (documents of {} on average)", o.packed) : "",
      o.ckpt == "none" ? "" : ", checkpointing " + o.ckpt, r["tokens_per_s"].get<double>(),
      r["step_ms"].get<double>(), r["tflops"].get<double>(),
      rig::format_bytes(r["peak_memory_bytes"].get<double>()),
      rig::format_bytes(r["peak_reserved_bytes"].get<double>()));
}

int run(const Opts& o) {
  check_flags(o);
  const rig::Device dev = rig::Device::parse(o.device);
  const std::string precision =
      o.precision == "auto" ? (dev.is_cuda() ? "bf16" : "fp32") : o.precision;
  if (precision != "bf16" && precision != "fp32")
    rig::bad_input("--precision '{}' is not one of auto, bf16, fp32", o.precision);
  // What rig train builds for one optimizer step: the model, the optimizer and the step itself.
  const rig::TrainConfig cfg = train_config(o);
  std::unique_ptr<rig::LlamaModel> m = rig::build_model(cfg);
  rig::place_model(*m, cfg, dev, precision);
  m->materialize_4bit(dev);  // QLoRA on a random model: the 4-bit codes drawn onto the device
  const auto& mc = m->config();
  rig::AdamW opt(rig::optimizer_config(cfg, false));
  rig::TrainStepOptions so = rig::train_step_options(cfg, 0);
  so.loss_chunk_rows = o.loss_chunk_rows.value_or(
      rig::loss_chunk_rows_for(mc.vocab_size, int64_t(rig::dtype_size(m->compute_dtype()))));
  rig::TrainStep step(*m, opt, nullptr, nullptr, so);
  double attention_len = 0;
  const std::vector<rig::TokenBatch> micro = {
      random_batch(o.batch, o.seq, mc.vocab_size, o.packed, &attention_len)};
  // As rig train's step: forward and backward, the guard's NaN/Inf scan, the norm, clip, AdamW.
  auto one_step = [&](int64_t s) {
    const double loss = step.accumulate(micro, 0, s).loss();
    if (!std::isfinite(loss)) rig::fail("step {}: the loss is {}", s, loss);
    // As rig train on one rank: the norm finds NaN/Inf in the gradients.
    const double norm = step.grad_norm();
    if (!std::isfinite(norm)) rig::fail("step {}: the gradient norm is {}", s, norm);
    step.apply(float(cfg.optimizer.lr), norm);
    return loss;
  };
  auto& alloc = rig::allocator_for(dev);
  double secs = 0;
  std::vector<double> losses;
  for (int64_t s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) alloc.reset_peak();
    auto t0 = std::chrono::steady_clock::now();
    losses.push_back(one_step(s));
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= o.warmup) secs += dt;
  }
  // One more step, profiled.
  nlohmann::json breakdown;
  if (o.profile || !o.trace.empty())
    breakdown = profile_step(
        dev, [&] { one_step(o.warmup + o.steps); }, o.trace);
  const double tokens = double(o.batch * o.seq * o.steps);
  const double n = double(m->num_parameters(false));
  // Model FLOPs as shared/bench counts them: the input embedding is a lookup, not a product.
  // Attention's term counts the span a token attends over: the row, or its document when packed.
  const double n_mat = mc.tie_word_embeddings ? n : n - double(mc.vocab_size * mc.hidden_size);
  const double flops_per_token = (o.method == "full" ? 6.0 : 4.0) * n_mat +
                                 12.0 * double(mc.num_layers * mc.hidden_size) * attention_len;
  // "gpu", "config", "lora_r" and "lora_targets" let `rig plan --calibrate` rebuild the run's
  // FLOPs per token and the card's peak from this line alone.
  nlohmann::json r = {{"device", dev.str()},
                      {"gpu", gpu_name(dev)},
                      {"config", mc.to_json()},
                      {"precision", precision},
                      {"method", o.method},
                      {"lora_r", o.method == "full" ? 0 : o.lora_r},
                      {"lora_targets", o.method == "full" ? "" : o.lora_targets},
                      {"parameters", int64_t(n)},
                      {"trainable_parameters", m->num_parameters(true)},
                      {"batch", o.batch},
                      {"seq", o.seq},
                      {"packed", o.packed},
                      {"attention_len", attention_len},
                      {"checkpointing", o.ckpt},
                      {"recompute_layers", o.recompute_layers},
                      {"loss_chunk_rows", so.loss_chunk_rows},
                      {"optimizer", o.optimizer},
                      {"optimizer_state_bytes", opt.state_bytes()},
                      {"tokens_per_s", tokens / secs},
                      {"tflops", tokens / secs * flops_per_token / 1e12},
                      {"step_ms", 1e3 * secs / double(o.steps)},
                      {"peak_memory_bytes", alloc.peak()},
                      {"peak_reserved_bytes", alloc.peak_reserved()},
                      {"losses", losses}};
  if (!breakdown.is_null()) r["breakdown"] = breakdown;
  if (o.json)
    fmt::print("{}\n", r.dump());
  else
    print_text(o, r);
  return 0;
}

rig::cli::Registrar reg(
    "bench train", "Measure training tokens/s and peak memory", [](CLI::App& app) {
      using namespace rig::cli;
      auto o = std::make_shared<Opts>();
      app.add_option("--preset", o->preset,
                     "a model catalogue shape (llama3-1b, llama3-8b, ...; those two are "
                     "bench/hf_baseline.py's)");
      app.add_option("--precision", o->precision, "auto (bf16 on CUDA), bf16 or fp32")
          ->capture_default_str();
      app.add_option("--lora-targets", o->lora_targets,
                     "all, or modules like q_proj,k_proj,v_proj,o_proj")
          ->capture_default_str();
      app.add_option("--model", o->model,
                     "Hugging Face model folder (default: a random model of the shape below)");
      add_number(app, "--hidden", o->hidden, "hidden size", in_range(1, 1 << 20))
          ->capture_default_str();
      add_number(app, "--layers", o->layers, "layers", in_range(1, 1 << 16))->capture_default_str();
      add_number(app, "--heads", o->heads, "attention heads", in_range(1, 4096))
          ->capture_default_str();
      add_number(app, "--kv-heads", o->kv_heads, "key/value heads", in_range(1, 4096))
          ->capture_default_str();
      add_number(app, "--intermediate", o->inter, "MLP size", in_range(1, 1 << 22))
          ->capture_default_str();
      add_number(app, "--vocab", o->vocab, "vocabulary", in_range(1, 1 << 24))
          ->capture_default_str();
      add_number(app, "--batch", o->batch, "micro-batch", in_range(1, 1 << 20))
          ->capture_default_str();
      add_number(app, "--seq", o->seq, "sequence length", in_range(1, 1 << 24))
          ->capture_default_str();
      // --packed 1: documents of one token have no target (a loss of 0 over nothing).
      add_number(app, "--packed", o->packed,
                 "pack each row with random documents of this average length, as rig train packs "
                 "data (lengths uniform in 1..2N-1); 0: one document per row",
                 in_range(2, 1 << 24).or_value(0, "whole rows"))
          ->capture_default_str();
      add_number(app, "--steps", o->steps, "timed steps", in_range(1, 1000000))
          ->capture_default_str();
      app.add_option("--method", o->method, "full, lora or qlora (LoRA on NF4 weights)")
          ->capture_default_str();
      add_number(app, "--lora-r", o->lora_r, "LoRA rank", in_range(1, 65536))
          ->capture_default_str();
      app.add_option("--optimizer", o->optimizer, "adamw (float32 moments) or adamw8bit")
          ->capture_default_str();
      app.add_option("--device", o->device, "cpu, cuda or cuda:N")->capture_default_str();
      app.add_flag("--checkpointing{full}", o->ckpt,
                   "activation checkpointing: none, selective (recompute the element-wise work) or "
                   "full (recompute each layer's forward); the bare flag means full")
          ->capture_default_str();
      add_number(app, "--recompute-layers", o->recompute_layers,
                 "with full checkpointing: layers that recompute their forward, the rest run "
                 "selective (-1: all)",
                 in_range(-1, 1 << 16))
          ->capture_default_str();
      add_number(app, "--loss-chunk-rows", o->loss_chunk_rows,
                 "rows of logits the loss materialises at once (memory against fewer, larger "
                 "LM-head products; default: about 512 MiB of them)",
                 in_range(1, int64_t(1) << 40));
      app.add_flag("--json", o->json, "one JSON line");
      app.add_flag(
          "--profile", o->profile,
          "time one more step op by op: milliseconds per category (matmul, attention, norm, "
          "elementwise, loss, optimizer) and the rest (copies, launch gaps, host work)");
      app.add_option("--trace", o->trace,
                     "write that profiled step as a Chrome trace (Perfetto) JSON file");
      return [o] { return run(*o); };
    });

}  // namespace
