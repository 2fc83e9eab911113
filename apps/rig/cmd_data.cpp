// rig data prepare: tokenize a dataset once into a memory-mapped cache (see rig/data/dataset.h).
// rig data inspect: show a prepared cache's settings and a few rendered samples with their mask.
#include <iostream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "flags.h"
#include "rig/data/dataset.h"
#include "rig/text/tokenizer.h"

namespace {

using namespace rig::cli;  // add_number and its ranges

using json = nlohmann::json;

struct PrepareArgs {
  std::string data, tokenizer, out, format = "auto", chat = "auto";
  bool train_on_all = false, skip_invalid = false, force = false, as_json = false;
  int threads = 0;
};

int run_prepare(const PrepareArgs& a) {
  rig::PrepareOptions o;
  o.source = a.data;
  o.tokenizer = a.tokenizer;
  o.out_dir = a.out;
  o.render.format = rig::parse_data_format(a.format);
  o.render.chat = rig::parse_chat_template(a.chat);
  o.render.train_on_all = a.train_on_all;
  o.render.skip_invalid = a.skip_invalid;
  o.render.threads = a.threads;
  o.force = a.force;
  auto r = rig::prepare_dataset(o);
  const auto& s = r.stats;
  if (a.as_json) {
    std::cout << json{{"path", r.path}, {"rebuilt", r.rebuilt}, {"reason", r.reason},
                      {"records", s.records}, {"samples", s.samples}, {"invalid", s.invalid},
                      {"tokens", s.tokens}, {"trained_tokens", s.trained_tokens},
                      {"chat_template", s.chat_template}}
                     .dump()
              << "\n";
  } else {
    fmt::print("{}: {} ({})\n", r.path, r.rebuilt ? "written" : "up to date, not rebuilt", r.reason);
    fmt::print("{} samples from {} records, {} tokens ({} trained)\n", s.samples, s.records,
               s.tokens, s.trained_tokens);
    if (!s.chat_template.empty()) fmt::print("chat template: {}\n", s.chat_template);
    if (s.invalid)
      fmt::print("skipped {} invalid record(s){}{}\n", s.invalid, s.first_invalid.empty() ? "" : "; first: ",
                 s.first_invalid);
  }
  return 0;
}

int run_inspect(const std::string& dir, const std::string& tok_path, int n) {
  auto d = rig::TokenDataset::open(dir);
  fmt::print("{} samples, {} tokens\n{}\n", d.size(), d.num_tokens(), d.metadata());
  // The template chat records were rendered with (the model's own file, llama3 or chatml).
  if (auto m = json::parse(d.metadata(), nullptr, false);
      m.is_object() && m.contains("chat_template") && m["chat_template"].is_string())
    fmt::print("chat template: {}\n", m["chat_template"].get<std::string>());
  if (tok_path.empty()) return 0;
  auto tok = rig::Tokenizer::load(tok_path);
  for (size_t i = 0; i < d.size() && int(i) < n; ++i) {
    auto ids = d.ids(i);
    auto tr = d.train(i);
    std::string prompt, resp;
    // Show the text with trained spans in [[ ]].
    std::string out;
    bool in_train = false;
    std::vector<int32_t> run;
    auto flush = [&] {
      if (run.empty()) return;
      out += in_train ? "[[" + tok.decode(run) + "]]" : tok.decode(run);
      run.clear();
    };
    for (size_t k = 0; k < ids.size(); ++k) {
      if (bool(tr[k]) != in_train) {
        flush();
        in_train = tr[k];
      }
      run.push_back(ids[k]);
    }
    flush();
    fmt::print("--- sample {} ({} tokens)\n{}\n", i, ids.size(), out);
  }
  return 0;
}

rig::cli::Registrar prep(
    "data prepare", "Tokenize a dataset once into a memory-mapped cache (skipped when current)",
    [](CLI::App& app) {
      auto a = std::make_shared<PrepareArgs>();
      app.add_option("--data", a->data, "dataset: .jsonl (Alpaca or chat), .txt, .safetensors")->required();
      app.add_option("--tokenizer", a->tokenizer, "tokenizer.json (not needed for .safetensors tokens)");
      app.add_option("--out", a->out, "cache folder")->required();
      app.add_option("--format", a->format, "auto, alpaca, chat, text or tokens");
      app.add_option("--chat-template", a->chat, "auto, llama3 or chatml (chat format)");
      app.add_flag("--train-on-all", a->train_on_all, "loss on prompt tokens too");
      app.add_flag("--skip-invalid", a->skip_invalid, "skip bad records and report how many");
      app.add_flag("--force", a->force, "rebuild even when the cache is current");
      add_number(app, "--threads", a->threads, "tokenization threads (0: all)", in_range(0, 1024));
      app.add_flag("--json", a->as_json, "print one JSON object");
      return [=] { return run_prepare(*a); };
    });

rig::cli::Registrar insp("data inspect", "Show a prepared dataset cache and its first samples",
                         [](CLI::App& app) {
                           auto dir = std::make_shared<std::string>();
                           auto tok = std::make_shared<std::string>();
                           auto n = std::make_shared<int>(3);
                           app.add_option("dir", *dir, "cache folder")->required();
                           app.add_option("--tokenizer", *tok, "decode samples with this tokenizer");
                           add_number(app, "-n", *n, "samples to show", at_least(0));
                           return [=] { return run_inspect(*dir, *tok, *n); };
                         });

}  // namespace
