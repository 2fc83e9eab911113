// rig tokenize: JSONL {"text": ...} on stdin -> JSONL {"ids": [...]} on stdout, in order;
// --decode goes the other way. Lines are processed in chunks so input of any size streams.
#include <iostream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "flags.h"
#include "rig/core/error.h"
#include "rig/text/tokenizer.h"

namespace {

using json = nlohmann::json;

struct Opts {
  std::string tokenizer;
  bool special = false, decode = false, add_special = false, skip_special = false;
  int threads = 0;
};

json parse_line(const std::string& line, size_t lineno, const char* field) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    rig::bad_input("stdin line {}: not valid JSON ({})", lineno, e.what());
  }
  if (!j.is_object() || !j.contains(field))
    rig::bad_input("stdin line {}: missing field '{}'", lineno, field);
  return j[field];
}

int run(const Opts& o) {
  auto tok = rig::Tokenizer::load(o.tokenizer);
  std::ios::sync_with_stdio(false);
  std::string line;
  size_t lineno = 0;
  std::vector<std::string> texts;
  auto flush = [&] {
    auto ids = tok.encode_batch(texts, {.special = o.special, .add_special = o.add_special}, o.threads);
    std::string out;
    for (const auto& v : ids) out += json{{"ids", v}}.dump() + "\n";
    std::cout << out;
    texts.clear();
  };
  while (std::getline(std::cin, line)) {
    ++lineno;
    if (line.empty() || line == "\r") continue;
    if (o.decode) {
      json v = parse_line(line, lineno, "ids");
      std::vector<int32_t> ids;
      if (!v.is_array()) rig::bad_input("stdin line {}: field 'ids': expected an array of integers", lineno);
      for (const auto& x : v) {
        if (!x.is_number_integer())
          rig::bad_input("stdin line {}: field 'ids': expected an array of integers", lineno);
        ids.push_back(x.get<int32_t>());
      }
      std::string text;
      try {
        text = tok.decode(ids, {.skip_special = o.skip_special});
      } catch (const rig::InputError& e) {
        rig::bad_input("stdin line {}: {}", lineno, e.what());
      }
      std::cout << json{{"text", text}}.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    } else {
      json v = parse_line(line, lineno, "text");
      if (!v.is_string()) rig::bad_input("stdin line {}: field 'text': expected a string", lineno);
      texts.push_back(v.get<std::string>());
      if (texts.size() >= 4096) flush();
    }
  }
  if (!texts.empty()) flush();
  std::cout.flush();
  return 0;
}

rig::cli::Registrar reg(
    "tokenize", "Tokenize JSONL {\"text\"} from stdin to JSONL {\"ids\"} (or back with --decode)",
    [](CLI::App& app) {
      using namespace rig::cli;
      auto o = std::make_shared<Opts>();
      app.add_option("--tokenizer", o->tokenizer, "tokenizer.json")->required();
      app.add_flag("--special", o->special, "match special tokens written in the text");
      app.add_flag("--add-special", o->add_special, "apply the post-processor (e.g. prepend BOS)");
      app.add_flag("--decode", o->decode, "read {\"ids\"} and write {\"text\"}");
      app.add_flag("--skip-special", o->skip_special, "with --decode: drop special tokens");
      add_number(app, "--threads", o->threads, "encoding threads (0: all)", in_range(0, 1024));
      return [=] { return run(*o); };
    });

}  // namespace
