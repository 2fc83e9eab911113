// rig template render: a model's own chat template (tokenizer_config.json) applied to
// conversations, as transformers' apply_chat_template(tokenize=False) renders them.
// JSONL on stdin, one conversation a line: {"messages": [...], "tools": [...]} (tools optional);
// any other key is passed to the template as a variable (enable_thinking, date_string...), and
// "add_generation_prompt" there overrides the flag. One JSON line out per line in: {"text": ...},
// or {"error": ...} when the template refuses the conversation (raise_exception) or fails on it;
// rendering goes on with the next line. A line that is not such JSON stops with "stdin:LINE: ...".
#include <iostream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "rig/core/error.h"
#include "rig/text/chat_template.h"

namespace {

using json = nlohmann::ordered_json;

struct Opts {
  std::string config;
  bool add_generation_prompt = false;
};

int run(const Opts& o) {
  const rig::HfChatTemplate tmpl = rig::HfChatTemplate::load(o.config);
  std::ios::sync_with_stdio(false);
  std::string line;
  size_t lineno = 0;
  while (std::getline(std::cin, line)) {
    ++lineno;
    if (line.empty() || line == "\r") continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      rig::bad_input("stdin:{}: not valid JSON ({})", lineno, e.what());
    }
    if (!j.is_object()) rig::bad_input("stdin:{}: expected a JSON object with 'messages'", lineno);
    if (!j.contains("messages") || !j["messages"].is_array())
      rig::bad_input("stdin:{}: field 'messages': expected an array of messages", lineno);
    for (const auto& m : j["messages"])
      if (!m.is_object())
        rig::bad_input("stdin:{}: field 'messages': each message must be an object", lineno);
    rig::HfChatTemplate::Input in;
    in.add_generation_prompt = o.add_generation_prompt;
    in.extra = rig::jinja::Value::dict();
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& k = it.key();
      if (k == "messages") {
        in.messages = rig::jinja::Value::from_json(it.value());
      } else if (k == "tools") {
        if (!it.value().is_array() && !it.value().is_null())
          rig::bad_input("stdin:{}: field 'tools': expected an array of tool schemas or null",
                         lineno);
        in.tools = rig::jinja::Value::from_json(it.value());
      } else if (k == "add_generation_prompt") {
        if (!it.value().is_boolean())
          rig::bad_input("stdin:{}: field 'add_generation_prompt': expected true or false", lineno);
        in.add_generation_prompt = it.value().get<bool>();
      } else {
        in.extra.set(k, rig::jinja::Value::from_json(it.value()));
      }
    }
    json out;
    try {
      out["text"] = tmpl.render(in).text;
    } catch (const rig::jinja::TemplateError& e) {
      out["error"] = e.message();
    }
    std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  }
  std::cout.flush();
  return 0;
}

rig::cli::Registrar reg("template render",
                        "Render JSONL conversations {\"messages\", \"tools\"?} from stdin with a "
                        "tokenizer_config.json chat template",
                        [](CLI::App& app) {
                          auto o = std::make_shared<Opts>();
                          app.add_option("--tokenizer-config", o->config,
                                         "tokenizer_config.json, or the folder holding it")
                              ->required();
                          app.add_flag("--add-generation-prompt", o->add_generation_prompt,
                                       "end with the assistant turn's opening, as "
                                       "apply_chat_template(add_generation_prompt=True)");
                          return [=] { return run(*o); };
                        });

}  // namespace
