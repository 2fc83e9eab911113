// rig generate / rig eval / rig merge: the tools around a run.
#include <filesystem>

#include "command.h"
#include "flags.h"
#include "rig/data/records.h"
#include "rig/model/config.h"
#include "rig/train/trainer.h"

namespace {

using namespace rig::cli;  // add_number and its ranges

namespace fs = std::filesystem;

std::unique_ptr<rig::LlamaModel> load_model(const std::string& model, const std::string& adapter) {
  auto m = rig::LlamaModel::load(model);
  if (!adapter.empty()) m->load_adapter(adapter);
  return m;
}

std::string find_tokenizer(const std::string& tok, const std::string& model) {
  std::string p = tok.empty() ? (fs::path(model) / "tokenizer.json").string() : tok;
  if (fs::is_directory(p)) p = (fs::path(p) / "tokenizer.json").string();
  if (!fs::exists(p)) rig::bad_input("{}: no tokenizer.json (pass --tokenizer)", p);
  return p;
}

struct GenOpts {
  std::string model, adapter, tokenizer, prompt;
  int64_t max_new = 64;
  float temperature = 0, top_p = 1;
  uint64_t seed = 0;
  bool special = true;
};

int run_generate(const GenOpts& o) {
  {
    rig::GenerateOptions check;  // flags first, before the model loads
    check.max_new_tokens = o.max_new;
    check.temperature = o.temperature;
    check.top_p = o.top_p;
    rig::check_generate_options(check);
  }
  auto m = load_model(o.model, o.adapter);
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
  for (int64_t id : rig::load_eos_token_ids(o.model)) go.stop_ids.push_back(int(id));
  if (go.stop_ids.empty())
    for (const auto& a : tok.added_tokens())
      if (a.special && (a.content == "</s>" || a.content == "<|endoftext|>" ||
                        a.content == "<|end_of_text|>" || a.content == "<|eot_id|>" ||
                        a.content == "<|im_end|>" || a.content == "<|eom_id|>"))
        go.stop_ids.push_back(a.id);
  auto out = rig::generate(*m, ids, go);
  fmt::print("{}\n", tok.decode(out, rig::DecodeOptions{true}));
  return 0;
}

struct EvalOpts {
  std::string model, adapter, tokenizer, data, format = "auto", chat = "auto";
  int64_t seq = 2048, batch = 4, generate = 0;
};

int run_eval(const EvalOpts& o) {
  auto m = load_model(o.model, o.adapter);
  rig::Tokenizer tok = rig::Tokenizer::load(find_tokenizer(o.tokenizer, o.model));
  rig::RenderOptions ro;
  ro.format = rig::parse_data_format(o.format);
  ro.chat = rig::parse_chat_template(o.chat);
  auto samples = rig::load_samples(o.data, &tok, ro);
  if (samples.empty()) rig::bad_input("{}: no samples", o.data);
  auto ds = rig::TokenDataset::from_samples(samples);
  auto r = rig::evaluate(*m, ds, o.seq, o.batch);
  fmt::print("loss {:.4f}  perplexity {:.3f}  over {} tokens of {} samples\n", r.loss, std::exp(r.loss),
             r.tokens, ds.size());
  if (o.generate > 0) {
    auto em = rig::exact_match(*m, ds, tok, o.generate, 3);
    fmt::print("exact match {:.1f}% of {} samples\n", 100 * em.exact_match, std::min<int64_t>(o.generate, int64_t(ds.size())));
    for (const auto& s : em.samples) fmt::print("  {}\n", s);
  }
  return 0;
}

int run_merge(const std::string& model, const std::string& adapter, const std::string& out,
              const std::string& dtype) {
  auto m = load_model(model, adapter);
  // A 4-bit (QLoRA) base is dequantized before the merge and written in bf16 unless asked.
  const bool four_bit = m->is_quantized();
  m->merge_lora();
  rig::DType dt = rig::DType::F32;
  if (dtype == "bf16" || (dtype == "auto" && four_bit))
    dt = rig::DType::BF16;
  else if (dtype == "f16") dt = rig::DType::F16;
  else if (dtype != "f32" && dtype != "auto")
    rig::bad_input("--dtype '{}' is not one of auto, f32, bf16, f16", dtype);
  m->save_pretrained(out, dt);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"})
    if (fs::exists(fs::path(model) / f))
      fs::copy_file(fs::path(model) / f, fs::path(out) / f, fs::copy_options::overwrite_existing);
  fmt::print("merged {} into {}{} -> {} ({})\n", adapter, model, four_bit ? " (dequantized)" : "",
             out, rig::dtype_name(dt));
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
  return [o] { return run_eval(*o); };
});

rig::cli::Registrar mg(
    "merge", "Fold a LoRA adapter into its base model and write a Hugging Face folder",
    [](CLI::App& app) {
      struct O {
        std::string model, adapter, out, dtype = "auto";
      };
      auto o = std::make_shared<O>();
      app.add_option("--model", o->model, "base model folder")->required();
      app.add_option("--adapter", o->adapter, "PEFT LoRA adapter folder")->required();
      app.add_option("--out", o->out, "output model folder")->required();
      app.add_option("--dtype", o->dtype,
                     "f32, bf16 or f16; auto: bf16 for a 4-bit (QLoRA) base, else f32")
          ->capture_default_str();
      return [o] { return run_merge(o->model, o->adapter, o->out, o->dtype); };
    });

}  // namespace
