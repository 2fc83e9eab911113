#include "rig/data/records.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "rig/core/error.h"
#include "rig/io/safetensors.h"
#include "rig/text/chat_template.h"

namespace rig {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// A piece of a rendered sample: text to tokenize (special: control tokens in it are matched) or
// one token id.
struct Part {
  std::string text;
  int32_t id = -1;
  bool special = false;
  bool train = false;
};
using Parts = std::vector<Part>;

struct RecordError {
  std::string msg;
};

[[noreturn]] void record_error(const std::string& path, size_t line, const std::string& field,
                               const std::string& what) {
  throw RecordError{field.empty() ? fmt::format("{}:{}: {}", path, line, what)
                                  : fmt::format("{}:{}: field '{}': {}", path, line, field, what)};
}

std::string json_type(const json& j) { return j.type_name(); }

const std::string& need_string(const json& obj, const std::string& key, const std::string& field,
                               const std::string& path, size_t line) {
  if (!obj.contains(key)) record_error(path, line, field, "missing");
  const json& v = obj[key];
  if (!v.is_string()) record_error(path, line, field, "expected a string, got " + json_type(v));
  return v.get_ref<const std::string&>();
}

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isspace(uint8_t(c)); });
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(uint8_t(s[b]))) ++b;
  while (e > b && std::isspace(uint8_t(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

struct Specials {
  int32_t bos = -1, eos = -1;
  int32_t start_header = -1, end_header = -1, eot = -1;  // Llama 3
  int32_t im_start = -1, im_end = -1;                    // ChatML
};

Specials find_specials(const Tokenizer& tok) {
  Specials s;
  auto first = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (int32_t id = tok.token_to_id(n); id >= 0) return id;
    return -1;
  };
  s.bos = first({"<|begin_of_text|>", "<s>"});
  s.eos = first({"<|end_of_text|>", "</s>", "<|endoftext|>"});
  s.start_header = tok.token_to_id("<|start_header_id|>");
  s.end_header = tok.token_to_id("<|end_header_id|>");
  s.eot = tok.token_to_id("<|eot_id|>");
  s.im_start = tok.token_to_id("<|im_start|>");
  s.im_end = tok.token_to_id("<|im_end|>");
  return s;
}

int32_t need_id(int32_t id, const Tokenizer& tok, const char* token, const char* why) {
  if (id < 0) bad_input("tokenizer {} has no {} token, needed by {}", tok.path(), token, why);
  return id;
}

const char* kAlpacaInput =
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n{}"
    "\n\n### Input:\n{}\n\n### Response:\n";
const char* kAlpacaNoInput =
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{}\n\n### Response:\n";

Parts render_alpaca(const json& j, const Specials& sp, const Tokenizer& tok, const std::string& path,
                    size_t line) {
  const std::string& instruction = need_string(j, "instruction", "instruction", path, line);
  std::string input;
  if (j.contains("input") && !j["input"].is_null()) input = need_string(j, "input", "input", path, line);
  const std::string& output = need_string(j, "output", "output", path, line);
  if (blank(output)) record_error(path, line, "output", "empty response");
  Parts p;
  if (sp.bos >= 0) p.push_back({"", sp.bos});
  std::string prompt = input.empty() ? fmt::format(fmt::runtime(kAlpacaNoInput), instruction)
                                     : fmt::format(fmt::runtime(kAlpacaInput), instruction, input);
  p.push_back({prompt});
  p.push_back({output, -1, false, true});
  p.push_back({"", need_id(sp.eos, tok, "end-of-text", "the Alpaca format"), false, true});
  return p;
}

Parts render_chat(const json& j, ChatTemplate tpl, const Specials& sp, const Tokenizer& tok,
                  const std::string& path, size_t line) {
  if (!j.contains("messages")) record_error(path, line, "messages", "missing");
  const json& msgs = j["messages"];
  if (!msgs.is_array()) record_error(path, line, "messages", "expected an array, got " + json_type(msgs));
  if (msgs.empty()) record_error(path, line, "messages", "empty");
  Parts p;
  bool llama3 = tpl == ChatTemplate::Llama3;
  if (llama3) {
    need_id(sp.start_header, tok, "<|start_header_id|>", "the llama3 chat template");
    need_id(sp.end_header, tok, "<|end_header_id|>", "the llama3 chat template");
    need_id(sp.eot, tok, "<|eot_id|>", "the llama3 chat template");
    p.push_back({"", need_id(sp.bos, tok, "<|begin_of_text|>", "the llama3 chat template")});
  } else {
    need_id(sp.im_start, tok, "<|im_start|>", "the chatml template");
    need_id(sp.im_end, tok, "<|im_end|>", "the chatml template");
  }
  bool any_assistant = false;
  for (size_t i = 0; i < msgs.size(); ++i) {
    std::string f = fmt::format("messages[{}]", i);
    const json& m = msgs[i];
    if (!m.is_object()) record_error(path, line, f, "expected an object, got " + json_type(m));
    const std::string& role = need_string(m, "role", f + ".role", path, line);
    if (role != "system" && role != "user" && role != "assistant")
      record_error(path, line, f + ".role", "expected system, user or assistant, got '" + role + "'");
    std::string content = need_string(m, "content", f + ".content", path, line);
    bool asst = role == "assistant";
    if (asst && blank(content)) record_error(path, line, f + ".content", "empty response");
    any_assistant = any_assistant || asst;
    if (llama3) {
      content = trim(content);  // Llama 3's template trims message content
      p.push_back({"", sp.start_header});
      p.push_back({role});
      p.push_back({"", sp.end_header});
      p.push_back({"\n\n"});
      p.push_back({content, -1, false, asst});
      p.push_back({"", sp.eot, false, asst});
    } else {
      p.push_back({"", sp.im_start});
      p.push_back({role + "\n"});
      p.push_back({content, -1, false, asst});
      p.push_back({"", sp.im_end, false, asst});
      p.push_back({"\n"});
    }
  }
  if (!any_assistant) record_error(path, line, "messages", "no assistant message (nothing to train on)");
  return p;
}

// The end of the first special token at or after `from` (the one closing an assistant turn).
size_t first_special_end(const std::string& text, size_t from,
                         const std::vector<std::string>& specials) {
  bool first[256] = {};
  for (const auto& sp : specials) first[uint8_t(sp[0])] = true;
  for (size_t i = from; i < text.size(); ++i) {
    if (!first[uint8_t(text[i])]) continue;
    size_t best = std::string::npos;
    for (const auto& sp : specials)
      if (text.compare(i, sp.size(), sp) == 0) best = std::min(best, i + sp.size());
    if (best != std::string::npos) return best;
  }
  return std::string::npos;
}

// A chat record through the model's own template (see records.h): the rendered text cut into
// untrained and trained pieces, each tokenized with special tokens matched, as HF tokenizes the
// whole string.
Parts render_model_chat(const std::string& line, const HfChatTemplate& tmpl,
                        const std::vector<std::string>& specials, const std::string& path,
                        size_t lineno) {
  using ojson = nlohmann::ordered_json;  // key order reaches the template (tojson, items())
  ojson j = ojson::parse(line);
  if (!j.contains("messages")) record_error(path, lineno, "messages", "missing");
  const ojson& msgs = j["messages"];
  if (!msgs.is_array())
    record_error(path, lineno, "messages",
                 "expected an array, got " + std::string(msgs.type_name()));
  if (msgs.empty()) record_error(path, lineno, "messages", "empty");
  std::vector<jinja::Value> all;
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (!msgs[i].is_object())
      record_error(path, lineno, fmt::format("messages[{}]", i),
                   "expected an object, got " + std::string(msgs[i].type_name()));
    all.push_back(jinja::Value::from_json(msgs[i]));
  }
  HfChatTemplate::Input in;
  if (j.contains("tools") && !j["tools"].is_null()) {
    if (!j["tools"].is_array())
      record_error(path, lineno, "tools", "expected an array of tool schemas");
    in.tools = jinja::Value::from_json(j["tools"]);
  }
  auto render = [&](size_t n, bool gen) {
    in.messages = jinja::Value::list(std::vector<jinja::Value>(all.begin(), all.begin() + long(n)));
    in.add_generation_prompt = gen;
    try {
      return tmpl.render(in);
    } catch (const jinja::TemplateError& e) {
      record_error(path, lineno, "messages",
                   fmt::format("chat template {}: {}", tmpl.source_name(), e.message()));
    }
  };
  jinja::Rendered full = render(all.size(), false);
  const std::string& text = full.text;
  std::vector<std::pair<size_t, size_t>> spans = full.generation;
  if (spans.empty()) {
    for (size_t i = 0; i < msgs.size(); ++i) {
      if (!msgs[i].contains("role") || msgs[i]["role"] != "assistant") continue;
      std::string before = render(i, true).text;
      if (text.compare(0, before.size(), before) != 0)
        record_error(
            path, lineno, fmt::format("messages[{}]", i),
            "the chat template does not render the conversation before this message (with "
            "add_generation_prompt) as a prefix of the whole conversation, so the assistant "
            "turn cannot be located");
      size_t start = before.size(), end = first_special_end(text, start, specials);
      if (end == std::string::npos) end = text.size();
      if (end > start) spans.emplace_back(start, end);
    }
  }
  if (spans.empty())
    record_error(path, lineno, "messages", "no assistant turn (nothing to train on)");
  Parts p;
  size_t pos = 0;
  for (auto [b, e] : spans) {
    if (b < pos) continue;  // overlapping spans: keep the first
    if (b > pos) p.push_back({text.substr(pos, b - pos), -1, true, false});
    p.push_back({text.substr(b, e - b), -1, true, true});
    pos = e;
  }
  if (pos < text.size()) p.push_back({text.substr(pos), -1, true, false});
  return p;
}

template <typename F>
void parallel_for(size_t n, int threads, F&& f) {
  int t = threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
  t = int(std::min<size_t>(size_t(t), (n + 63) / 64));
  if (t <= 1) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr err;
  std::mutex mu;
  std::vector<std::thread> pool;
  for (int k = 0; k < t; ++k)
    pool.emplace_back([&] {
      try {
        for (size_t b; (b = next.fetch_add(64)) < n;)
          for (size_t i = b; i < std::min(n, b + 64); ++i) f(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (!err) err = std::current_exception();
        next = n;
      }
    });
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
}

std::vector<Sample> load_tokens(const std::string& path, RenderStats& st, int64_t vocab_limit) {
  auto f = SafeTensorsFile::open(path);
  if (!f.has("tokens")) bad_input("{}: tensor 'tokens' missing (expected I32 or I64 [rows, T])", path);
  Tensor t = f.get("tokens");
  if (t.ndim() != 2 || (t.dtype() != DType::I32 && t.dtype() != DType::I64))
    bad_input("{}: tensor 'tokens': expected I32 or I64 [rows, T], got {} {}", path,
              dtype_name(t.dtype()), shape_str(t.shape()));
  std::vector<Sample> out;
  int64_t rows = t.dim(0), T = t.dim(1);
  for (int64_t r = 0; r < rows; ++r) {
    Sample s;
    for (int64_t c = 0; c < T; ++c) {
      int64_t v = t.dtype() == DType::I32 ? t.data<int32_t>()[r * T + c] : t.data<int64_t>()[r * T + c];
      if (v > INT32_MAX) bad_input("{}: tensor 'tokens' row {} column {}: id {} is too large", path, r, c, v);
      s.ids.push_back(int32_t(v));
    }
    while (!s.ids.empty() && s.ids.back() < 0) s.ids.pop_back();  // negative tail = padding
    for (size_t c = 0; c < s.ids.size(); ++c) {
      if (s.ids[c] < 0) bad_input("{}: tensor 'tokens' row {} column {}: negative id {} before the end", path, r, c, s.ids[c]);
      if (vocab_limit > 0 && s.ids[c] >= vocab_limit)
        bad_input(
            "{}: tensor 'tokens' row {} column {}: id {} is outside the model's vocabulary "
            "(vocab_size {})",
            path, r, c, s.ids[c], vocab_limit);
    }
    ++st.records;
    if (s.ids.size() < 2) {  // nothing to predict
      ++st.invalid;
      if (st.first_invalid.empty()) st.first_invalid = fmt::format("{}: row {}: fewer than 2 tokens", path, r);
      continue;
    }
    s.train.assign(s.ids.size(), 1);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

DataFormat parse_data_format(const std::string& s) {
  if (s == "auto") return DataFormat::Auto;
  if (s == "alpaca") return DataFormat::Alpaca;
  if (s == "chat") return DataFormat::Chat;
  if (s == "text") return DataFormat::Text;
  if (s == "tokens") return DataFormat::Tokens;
  bad_input("unknown data format '{}' (expected auto, alpaca, chat, text or tokens)", s);
}

ChatTemplate parse_chat_template(const std::string& s) {
  if (s == "auto") return ChatTemplate::Auto;
  if (s == "llama3") return ChatTemplate::Llama3;
  if (s == "chatml") return ChatTemplate::ChatML;
  bad_input("unknown chat template '{}' (expected auto, llama3 or chatml)", s);
}

std::string data_format_name(DataFormat f) {
  switch (f) {
    case DataFormat::Auto: return "auto";
    case DataFormat::Alpaca: return "alpaca";
    case DataFormat::Chat: return "chat";
    case DataFormat::Text: return "text";
    case DataFormat::Tokens: return "tokens";
  }
  return "?";
}

std::string chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::Auto: return "auto";
    case ChatTemplate::Llama3: return "llama3";
    case ChatTemplate::ChatML: return "chatml";
  }
  return "?";
}

DataFormat detect_data_format(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  if (ext == ".txt") return DataFormat::Text;
  if (ext == ".safetensors") return DataFormat::Tokens;
  std::ifstream in(path);
  if (!in) bad_input("{}: cannot open", path);
  std::string line;
  size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (blank(line)) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("messages")) return DataFormat::Chat;
    if (j.is_object() && j.contains("instruction")) return DataFormat::Alpaca;
    bad_input("{}:{}: cannot tell the format (expected a JSON object with 'instruction' or "
              "'messages'); pass --format", path, n);
  }
  bad_input("{}: no records", path);
}

ChatTemplate detect_chat_template(const Tokenizer& tok) {
  if (tok.token_to_id("<|start_header_id|>") >= 0) return ChatTemplate::Llama3;
  if (tok.token_to_id("<|im_start|>") >= 0) return ChatTemplate::ChatML;
  bad_input(
      "tokenizer {} has no chat template beside it (tokenizer_config.json) and neither Llama 3 "
      "nor ChatML control tokens; name a template (the dataset's template: llama3 or chatml, or "
      "--template)",
      tok.path());
}

std::vector<Sample> load_samples(const std::string& path, const Tokenizer* tok,
                                 const RenderOptions& opt, RenderStats* stats) {
  RenderStats st;
  if (!fs::exists(path)) bad_input("{}: no such file", path);
  DataFormat fmt = opt.format == DataFormat::Auto ? detect_data_format(path) : opt.format;
  std::vector<Sample> samples;
  if (fmt == DataFormat::Tokens) {
    samples = load_tokens(path, st, opt.vocab_limit);
  } else {
    if (!tok) bad_input("{}: a tokenizer is needed for the {} format", path, data_format_name(fmt));
    Specials sp = find_specials(*tok);
    ChatTemplate tpl = opt.chat;
    std::optional<HfChatTemplate> model_tpl;
    std::vector<std::string> specials;  // special added tokens, the ends of assistant turns
    if (fmt == DataFormat::Chat && opt.chat == ChatTemplate::Auto) {
      if (fs::is_regular_file(tok->path()))
        model_tpl = HfChatTemplate::find_in(fs::path(tok->path()).parent_path().string());
      if (!model_tpl) tpl = detect_chat_template(*tok);
      for (const auto& t : tok->added_tokens())
        if (t.special && !t.content.empty()) specials.push_back(t.content);
    }
    if (fmt == DataFormat::Chat)
      st.chat_template = model_tpl ? model_tpl->source_name() : chat_template_name(tpl);
    std::ifstream in(path, std::ios::binary);
    if (!in) bad_input("{}: cannot open", path);
    std::vector<Parts> records;
    std::string line;
    size_t lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (blank(line)) continue;
      ++st.records;
      try {
        if (fmt == DataFormat::Text) {
          size_t bad;
          if (!utf8_valid(line, &bad)) record_error(path, lineno, "", fmt::format("not valid UTF-8 at column {}", bad + 1));
          Parts p;
          if (sp.bos >= 0) p.push_back({"", sp.bos, false, true});
          p.push_back({line, -1, false, true});
          if (sp.eos >= 0) p.push_back({"", sp.eos, false, true});
          records.push_back(std::move(p));
          continue;
        }
        json j;
        try {
          j = json::parse(line);
        } catch (const json::exception& e) {
          record_error(path, lineno, "", fmt::format("not valid JSON ({})", e.what()));
        }
        if (!j.is_object()) record_error(path, lineno, "", "expected a JSON object, got " + json_type(j));
        if (fmt == DataFormat::Alpaca)
          records.push_back(render_alpaca(j, sp, *tok, path, lineno));
        else if (model_tpl)
          records.push_back(render_model_chat(line, *model_tpl, specials, path, lineno));
        else
          records.push_back(render_chat(j, tpl, sp, *tok, path, lineno));
      } catch (const RecordError& e) {
        if (!opt.skip_invalid) throw InputError(e.msg);
        ++st.invalid;
        if (st.first_invalid.empty()) st.first_invalid = e.msg;
      }
    }
    samples.resize(records.size());
    parallel_for(records.size(), opt.threads, [&](size_t i) {
      Sample& s = samples[i];
      for (const Part& p : records[i]) {
        size_t before = s.ids.size();
        if (p.id >= 0) s.ids.push_back(p.id);
        else {
          auto ids = tok->encode(p.text, {.special = p.special});
          s.ids.insert(s.ids.end(), ids.begin(), ids.end());
        }
        s.train.resize(s.ids.size(), uint8_t(p.train || opt.train_on_all));
        (void)before;
      }
    });
  }
  for (auto& s : samples) {
    if (opt.train_on_all) std::fill(s.train.begin(), s.train.end(), 1);
    st.tokens += s.ids.size();
    for (uint8_t t : s.train) st.trained_tokens += t;
  }
  st.samples = samples.size();
  if (samples.empty()) bad_input("{}: no valid samples ({} records, {} invalid{}{})", path, st.records, st.invalid,
                                 st.first_invalid.empty() ? "" : "; first: ", st.first_invalid);
  if (stats) *stats = st;
  return samples;
}

}  // namespace rig
