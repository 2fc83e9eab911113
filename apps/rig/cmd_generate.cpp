// rig generate / rig eval / rig merge: the tools around a run. Each computes where --device says
// (auto: the GPU when there is one); eval and generate in --dtype (auto: bf16 on CUDA, as
// training), merge always in float32.
#include <chrono>
#include <filesystem>

#include "command.h"
#include "device_flags.h"
#include "flags.h"
#include "rig/core/allocator.h"
#include "rig/data/records.h"
#include "rig/model/config.h"
#include "rig/train/inference.h"
#include "rig/train/trainer.h"

namespace {

using namespace rig::cli;  // add_number and its ranges

namespace fs = std::filesystem;

// Computing in bf16, a base the folder stores in bf16 loads as it is (an 8B base holds 16 GB of
// host memory, not 32 in float32); the bytes that reach the device are the same.
std::unique_ptr<rig::LlamaModel> load_model(const std::string& model, const std::string& adapter,
                                            rig::DType compute = rig::DType::F32) {
  rig::LoadOptions lo;
  lo.frozen_bf16 = compute == rig::DType::BF16;
  auto m = rig::LlamaModel::load(model, lo);
  if (!adapter.empty()) m->load_adapter(adapter);
  return m;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// "peak 15.2 GiB in use, 15.9 GiB reserved on cuda:0" (the allocator's counts since start).
std::string peak_memory(rig::Device dev) {
  const rig::Allocator& a = rig::allocator_for(dev);
  if (dev.is_cpu())
    return fmt::format("peak {} in use on cpu", rig::format_bytes(double(a.peak())));
  return fmt::format("peak {} in use, {} reserved on {}", rig::format_bytes(double(a.peak())),
                     rig::format_bytes(double(a.peak_reserved())), dev.str());
}

std::string find_tokenizer(const std::string& tok, const std::string& model) {
  std::string p = tok.empty() ? (fs::path(model) / "tokenizer.json").string() : tok;
  if (fs::is_directory(p)) p = (fs::path(p) / "tokenizer.json").string();
  if (!fs::exists(p)) rig::bad_input("{}: no tokenizer.json (pass --tokenizer)", p);
  return p;
}

struct GenOpts {
  std::string model, adapter, tokenizer, prompt, device = "auto", dtype = "auto";
  int64_t max_new = 64;
  float temperature = 0, top_p = 1;
  uint64_t seed = 0;
  bool special = true, stats = false, ignore_eos = false;
};

int run_generate(const GenOpts& o) {
  {
    rig::GenerateOptions check;  // flags first, before the model loads
    check.max_new_tokens = o.max_new;
    check.temperature = o.temperature;
    check.top_p = o.top_p;
    rig::check_generate_options(check);
  }
  const rig::ComputeTarget target = rig::resolve_compute(o.device, o.dtype, "generate");
  const auto t_load = Clock::now();
  auto m = load_model(o.model, o.adapter, target.dtype);
  rig::place_for_inference(*m, target);
  const double load_s = seconds_since(t_load);
  rig::Tokenizer tok = rig::Tokenizer::load(find_tokenizer(o.tokenizer, o.model));
  auto ids = tok.encode(o.prompt, rig::EncodeOptions{o.special, false});
  if (ids.empty()) rig::bad_input("--prompt is empty after tokenization");
  rig::GenerateOptions go;
  go.max_new_tokens = o.max_new;
  go.temperature = o.temperature;
  go.top_p = o.top_p;
  go.seed = o.seed;
  go.vocab_limit = tok.vocab_size();
  // Stop where transformers would: the model's eos_token_id(s); a model folder that names none
  // falls back to the special tokens that end a turn or a text in the common templates (never
  // the header markers such as <|end_header_id|>, which sit inside a Llama 3 prompt).
  if (!o.ignore_eos) {
    for (int64_t id : rig::load_eos_token_ids(o.model)) go.stop_ids.push_back(int(id));
    if (go.stop_ids.empty())
      for (const auto& a : tok.added_tokens())
        if (a.special && (a.content == "</s>" || a.content == "<|endoftext|>" ||
                          a.content == "<|end_of_text|>" || a.content == "<|eot_id|>" ||
                          a.content == "<|im_end|>" || a.content == "<|eom_id|>"))
          go.stop_ids.push_back(a.id);
  }
  rig::GenerateStats st;
  auto out = rig::generate(*m, ids, go, &st);
  fmt::print("{}\n", tok.decode(out, rig::DecodeOptions{true}));
  if (o.stats) {
    std::fflush(stdout);
    fmt::print(stderr,
               "rig generate: {} ({}); load {:.1f} s; prompt {} tokens, prefill {:.1f} ms; "
               "{} new tokens, decode {:.1f} tokens/s ({:.2f} ms/token); {}\n",
               target.str(), o.temperature > 0 ? "sampled" : "greedy", load_s, st.prompt_tokens,
               st.prefill_ms, st.new_tokens, st.decode_tokens_per_s(),
               st.new_tokens > 1 ? st.decode_ms / double(st.new_tokens - 1) : 0.0,
               peak_memory(target.device));
  }
  return 0;
}

struct EvalOpts {
  std::string model, adapter, tokenizer, data, format = "auto", chat = "auto";
  std::string device = "auto", dtype = "auto";
  int64_t seq = 2048, batch = 4, generate = 0;
  bool stats = false;
};

int run_eval(const EvalOpts& o) {
  const rig::ComputeTarget target = rig::resolve_compute(o.device, o.dtype, "eval");
  const auto t_load = Clock::now();
  auto m = load_model(o.model, o.adapter, target.dtype);
  rig::place_for_inference(*m, target);
  const double load_s = seconds_since(t_load);
  rig::Tokenizer tok = rig::Tokenizer::load(find_tokenizer(o.tokenizer, o.model));
  rig::RenderOptions ro;
  ro.format = rig::parse_data_format(o.format);
  ro.chat = rig::parse_chat_template(o.chat);
  auto samples = rig::load_samples(o.data, &tok, ro);
  if (samples.empty()) rig::bad_input("{}: no samples", o.data);
  auto ds = rig::TokenDataset::from_samples(samples);
  const auto t_eval = Clock::now();
  auto r = rig::evaluate(*m, ds, o.seq, o.batch);
  const double eval_s = seconds_since(t_eval);
  fmt::print("loss {:.4f}  perplexity {:.3f}  over {} tokens of {} samples\n", r.loss, std::exp(r.loss),
             r.tokens, ds.size());
  double gen_s = 0;
  if (o.generate > 0) {
    const auto t_gen = Clock::now();
    auto em = rig::exact_match(*m, ds, tok, o.generate, 3);
    gen_s = seconds_since(t_gen);
    fmt::print("exact match {:.1f}% of {} samples\n", 100 * em.exact_match, std::min<int64_t>(o.generate, int64_t(ds.size())));
    for (const auto& s : em.samples) fmt::print("  {}\n", s);
  }
  if (o.stats) {
    // Rows are padded to --seq (no packing), so the padded positions are computed too.
    const int64_t batches = (int64_t(ds.size()) + o.batch - 1) / o.batch;
    std::fflush(stdout);
    fmt::print(stderr,
               "rig eval: {}; load {:.1f} s; loss over {} batches of {} x {} in {:.2f} s "
               "({:.0f} scored tokens/s, {:.0f} positions/s){}; {}\n",
               target.str(), load_s, batches, o.batch, o.seq, eval_s,
               eval_s > 0 ? double(r.tokens) / eval_s : 0.0,
               eval_s > 0 ? double(batches * o.batch * o.seq) / eval_s : 0.0,
               o.generate > 0 ? fmt::format("; exact match generation {:.2f} s", gen_s) : "",
               peak_memory(target.device));
  }
  return 0;
}

int run_merge(const std::string& model, const std::string& adapter, const std::string& out,
              const std::string& dtype, const std::string& device) {
  if (dtype != "auto" && dtype != "f32" && dtype != "bf16" && dtype != "f16")
    rig::bad_input("--dtype '{}' is not one of auto, f32, bf16, f16", dtype);
  const rig::Device dev = rig::resolve_device(device, "merge");
  auto m = load_model(model, adapter);
  // A 4-bit (QLoRA) base is dequantized before the merge and written in bf16 unless asked.
  const bool four_bit = m->is_quantized();
  // The model stays on the host (it is written from there); on a GPU each weight is decoded and
  // folded there, one at a time, in float32.
  if (dev.is_cuda())
    m->merge_lora(dev);
  else
    m->merge_lora();
  rig::DType dt = rig::DType::F32;
  if (dtype == "bf16" || (dtype == "auto" && four_bit))
    dt = rig::DType::BF16;
  else if (dtype == "f16")
    dt = rig::DType::F16;
  m->save_pretrained(out, dt);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"})
    if (fs::exists(fs::path(model) / f))
      fs::copy_file(fs::path(model) / f, fs::path(out) / f, fs::copy_options::overwrite_existing);
  fmt::print("merged {} into {}{} -> {} ({}; computed on {})\n", adapter, model,
             four_bit ? " (dequantized)" : "", out, rig::dtype_name(dt), dev.str());
  return 0;
}

rig::cli::Registrar gen("generate", "Generate text from a model (and adapter) with a KV cache", [](CLI::App& app) {
  auto o = std::make_shared<GenOpts>();
  app.add_option("--model", o->model, "Hugging Face model folder")->required();
  app.add_option("--adapter", o->adapter, "PEFT LoRA adapter folder");
  app.add_option("--tokenizer", o->tokenizer, "tokenizer.json (default: the model folder's)");
  app.add_option("--prompt", o->prompt, "prompt text (special tokens written in it are matched)")->required();
  add_number(app, "--max-new-tokens", o->max_new, "tokens to generate", in_range(0, 1000000))
      ->capture_default_str();
  add_number(app, "--temperature", o->temperature, "0: greedy", at_least(0))->capture_default_str();
  add_number(app, "--top-p", o->top_p, "nucleus sampling mass", in_range(0, 1).open_low())
      ->capture_default_str();
  add_number(app, "--seed", o->seed, "sampling seed", at_least(0))->capture_default_str();
  add_device_flag(app, o->device);
  add_compute_dtype_flag(app, o->dtype);
  app.add_flag("--stats", o->stats,
               "print prompt tokens, prefill time, decode tokens/s and peak memory on stderr");
  app.add_flag("--ignore-eos", o->ignore_eos,
               "do not stop at the end-of-sequence tokens (benchmarks: always --max-new-tokens)");
  return [o] { return run_generate(*o); };
});

rig::cli::Registrar ev("eval", "Loss and perplexity of a model (and adapter) on a dataset", [](CLI::App& app) {
  auto o = std::make_shared<EvalOpts>();
  app.add_option("--model", o->model, "Hugging Face model folder")->required();
  app.add_option("--adapter", o->adapter, "PEFT LoRA adapter folder");
  app.add_option("--tokenizer", o->tokenizer, "tokenizer.json (default: the model folder's)");
  app.add_option("--data", o->data, "dataset (alpaca, chat, text or tokens)")->required();
  app.add_option("--format", o->format, "auto, alpaca, chat, text, tokens")->capture_default_str();
  app.add_option("--template", o->chat, "chat template: auto, llama3, chatml")->capture_default_str();
  add_number(app, "--seq", o->seq, "sequence length", in_range(1, 1 << 24))->capture_default_str();
  add_number(app, "--batch", o->batch, "micro-batch", in_range(1, 1 << 20))->capture_default_str();
  add_number(app, "--generate", o->generate,
             "also measure exact match of greedy responses on N samples", at_least(0));
  add_device_flag(app, o->device);
  add_compute_dtype_flag(app, o->dtype);
  app.add_flag("--stats", o->stats,
               "print load and evaluation time, tokens/s and peak memory on stderr");
  return [o] { return run_eval(*o); };
});

rig::cli::Registrar mg(
    "merge", "Fold a LoRA adapter into its base model and write a Hugging Face folder",
    [](CLI::App& app) {
      struct O {
        std::string model, adapter, out, dtype = "auto", device = "auto";
      };
      auto o = std::make_shared<O>();
      app.add_option("--model", o->model, "base model folder")->required();
      app.add_option("--adapter", o->adapter, "PEFT LoRA adapter folder")->required();
      app.add_option("--out", o->out, "output model folder")->required();
      app.add_option(
             "--dtype", o->dtype,
             "output dtype: f32, bf16 or f16; auto: bf16 for a 4-bit (QLoRA) base, else f32 "
             "(the fold itself is always computed in f32)")
          ->capture_default_str();
      add_device_flag(app, o->device,
                      "; where the 4-bit weights are decoded and B*A is added, one weight at a "
                      "time (the model itself stays in host memory)");
      return [o] { return run_merge(o->model, o->adapter, o->out, o->dtype, o->device); };
    });

}  // namespace
