#include "rig/text/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) bad_input("{}: cannot open", p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A token as tokenizer_config.json writes it: a string, or an AddedToken {"content": ...}.
std::optional<std::string> token_text(const json& t) {
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string())
    return t["content"].get<std::string>();
  return std::nullopt;
}

jinja::Value special_tokens_map(const json& cfg) {
  std::vector<std::string> keys = {
      "bos_token", "eos_token", "unk_token",  "sep_token",
      "pad_token", "cls_token", "mask_token", "additional_special_tokens"};
  const json* extra =
      cfg.contains("extra_special_tokens") && cfg["extra_special_tokens"].is_object()
          ? &cfg["extra_special_tokens"]
          : nullptr;
  if (extra)
    for (auto it = extra->begin(); it != extra->end(); ++it) keys.push_back(it.key());
  jinja::Value out = jinja::Value::dict();
  for (const auto& k : keys) {
    const json* v = cfg.contains(k)               ? &cfg[k]
                    : extra && extra->contains(k) ? &(*extra)[k]
                                                  : nullptr;
    if (!v) continue;
    if (v->is_array()) {
      std::vector<jinja::Value> items;
      for (const auto& t : *v)
        if (auto s = token_text(t)) items.emplace_back(*s);
      if (!items.empty()) out.set(k, jinja::Value::list(std::move(items)));
    } else if (auto s = token_text(*v); s && !s->empty()) {
      out.set(k, *s);
    }
  }
  return out;
}

}  // namespace

HfChatTemplate HfChatTemplate::load(const std::string& path) {
  fs::path p(path);
  if (fs::is_directory(p)) p /= "tokenizer_config.json";
  if (!fs::exists(p)) bad_input("{}: no such file", p.string());
  json cfg;
  try {
    cfg = json::parse(read_file(p));
  } catch (const json::exception& e) {
    bad_input("{}: not valid JSON ({})", p.string(), e.what());
  }
  if (!cfg.is_object()) bad_input("{}: expected a JSON object", p.string());
  HfChatTemplate t;
  t.name_ = p.string();
  t.special_ = special_tokens_map(cfg);
  auto compile = [&](const std::string& src, const std::string& name) {
    return std::make_shared<jinja::Template>(src, name);
  };
  const json* ct = cfg.contains("chat_template") ? &cfg["chat_template"] : nullptr;
  // Newer transformers save the template beside the config; it wins there too.
  fs::path jinja_file = p.parent_path() / "chat_template.jinja";
  if (fs::exists(jinja_file)) {
    t.name_ = jinja_file.string();
    t.default_ = compile(read_file(jinja_file), t.name_);
  } else if (ct && ct->is_string()) {
    t.default_ = compile(ct->get<std::string>(), t.name_ + " (chat_template)");
  } else if (ct &&
             ct->is_array()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    for (const auto& e : *ct) {
      if (!e.is_object() || !e.contains("name") || !e.contains("template") ||
          !e["name"].is_string() || !e["template"].is_string())
        bad_input("{}: chat_template: expected a list of {{\"name\", \"template\"}} objects",
                  p.string());
      std::string name = e["name"].get<std::string>();
      if (name == "default")
        t.default_ =
            compile(e["template"].get<std::string>(), t.name_ + " (chat_template default)");
      if (name == "tool_use")
        t.tool_use_ =
            compile(e["template"].get<std::string>(), t.name_ + " (chat_template tool_use)");
    }
    if (!t.default_ && !t.tool_use_)
      bad_input("{}: chat_template has neither a 'default' nor a 'tool_use' template", p.string());
  } else {
    bad_input("{}: no chat_template (and no chat_template.jinja beside it)", p.string());
  }
  return t;
}

std::optional<HfChatTemplate> HfChatTemplate::find_in(const std::string& dir) {
  fs::path d(dir);
  if (fs::exists(d / "chat_template.jinja") || fs::exists(d / "tokenizer_config.json")) {
    if (!fs::exists(d / "tokenizer_config.json")) {  // a lone chat_template.jinja
      HfChatTemplate t;
      t.name_ = (d / "chat_template.jinja").string();
      t.special_ = jinja::Value::dict();
      t.default_ = std::make_shared<jinja::Template>(read_file(d / "chat_template.jinja"), t.name_);
      return t;
    }
    json cfg;
    try {
      cfg = json::parse(read_file(d / "tokenizer_config.json"));
    } catch (const json::exception&) {
      return std::nullopt;  // not ours to judge here; the tokenizer loader reports its own files
    }
    if (!fs::exists(d / "chat_template.jinja") &&
        (!cfg.is_object() || !cfg.contains("chat_template")))
      return std::nullopt;
    return load((d / "tokenizer_config.json").string());
  }
  return std::nullopt;
}

std::string HfChatTemplate::special_token(const std::string& key) const {
  const jinja::Value* v = special_.dict_data().find(key);
  return v && v->is_string() ? v->str() : "";
}

jinja::Rendered HfChatTemplate::render(const Input& in, const jinja::RenderOptions& opt) const {
  // transformers picks "tool_use" when tools are passed and the config has one.
  const bool tools = !in.tools.is_undefined() && !in.tools.is_none();
  const jinja::Template& tmpl = (tools && tool_use_) || !default_ ? *tool_use_ : *default_;
  jinja::Value ctx = jinja::Value::dict();
  ctx.set("messages", in.messages);
  ctx.set("tools", tools ? in.tools : jinja::Value::none());
  ctx.set("documents", jinja::Value::none());
  ctx.set("add_generation_prompt", in.add_generation_prompt);
  for (const auto& [k, v] : special_.dict_data().items) ctx.set(k, v);
  if (in.extra.is_dict())
    for (const auto& [k, v] : in.extra.dict_data().items) ctx.set(k, v);
  return tmpl.render_tracked(ctx, opt);
}

}  // namespace rig
