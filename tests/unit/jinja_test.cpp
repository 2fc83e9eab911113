// The Jinja2 chat-template renderer against Python's jinja2 configured as transformers'
// apply_chat_template (tests/data/templates, written by scripts/make_template_fixtures.py): every
// case byte for byte, errors with Jinja2's message.
#include "rig/text/jinja.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "rig/text/chat_template.h"
#include "test_util.h"

using namespace rig;
using json = nlohmann::ordered_json;

namespace {

constexpr std::time_t kFixedNow = 1700049600;  // FIXED_NOW of make_template_fixtures.py

std::vector<json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

std::string templates_dir() {
  return test::data_path("templates");
}

// What rendering a case gave: the text, or the error (raised by raise_exception or not).
struct Outcome {
  std::string text, error;
  bool raised = false, failed = false;
  std::vector<std::pair<size_t, size_t>> generation;
};

template <typename F>
Outcome outcome(F&& f) {
  Outcome o;
  try {
    jinja::Rendered r = f();
    o.text = r.text;
    o.generation = r.generation;
  } catch (const jinja::RaisedError& e) {
    o.failed = o.raised = true;
    o.error = e.message();
  } catch (const jinja::TemplateError& e) {
    o.failed = true;
    o.error = e.message();
  }
  return o;
}

void expect_matches(const json& c, const Outcome& got, const std::string& what) {
  if (c.contains("expected")) {
    ASSERT_FALSE(got.failed) << what << ": " << got.error;
    EXPECT_EQ(got.text, c["expected"].get<std::string>()) << what;
  } else {
    ASSERT_TRUE(got.failed) << what << ": rendered " << json(got.text).dump();
    EXPECT_EQ(got.error, c["expected_error"].get<std::string>()) << what;
    EXPECT_EQ(got.raised, c["error_kind"] == "raised") << what;
  }
}

}  // namespace

TEST(Jinja, LanguageCasesMatchJinja2) {
  auto cases = read_jsonl(templates_dir() + "/jinja_cases.jsonl");
  ASSERT_GT(cases.size(), 60u);
  jinja::RenderOptions opt;
  opt.now = kFixedNow;
  for (const auto& c : cases) {
    const std::string name = c["name"].get<std::string>();
    Outcome got = outcome([&] {
      jinja::Template t(c["source"].get<std::string>(), name);
      return t.render_tracked(jinja::Value::from_json(c["context"]), opt);
    });
    expect_matches(c, got, name);
    std::vector<std::pair<size_t, size_t>> want;
    if (c.contains("generation"))
      for (const auto& s : c["generation"])
        want.emplace_back(s[0].get<size_t>(), s[1].get<size_t>());
    EXPECT_EQ(got.generation, want) << name;
  }
}

TEST(Template, FixturesRenderLikeTransformers) {
  auto cases = read_jsonl(templates_dir() + "/chat_cases.jsonl");
  ASSERT_GT(cases.size(), 50u);
  std::map<std::string, HfChatTemplate> loaded;
  std::set<std::string> seen;
  jinja::RenderOptions opt;
  opt.now = kFixedNow;
  for (size_t i = 0; i < cases.size(); ++i) {
    const json& c = cases[i];
    const std::string cfg = c["config"].get<std::string>();
    if (!loaded.count(cfg)) loaded.emplace(cfg, HfChatTemplate::load(templates_dir() + "/" + cfg));
    seen.insert(c["template"].get<std::string>());
    HfChatTemplate::Input in;
    in.messages = jinja::Value::from_json(c["messages"]);
    if (c.contains("tools")) in.tools = jinja::Value::from_json(c["tools"]);
    in.add_generation_prompt = c["add_generation_prompt"].get<bool>();
    if (c.contains("extra")) in.extra = jinja::Value::from_json(c["extra"]);
    expect_matches(c, outcome([&] { return loaded.at(cfg).render(in, opt); }),
                   fmt::format("case {} ({})", i, c["template"].get<std::string>()));
  }
  for (const char* t : {"llama3", "qwen3", "gemma3", "mistral", "llama32-vision"})
    EXPECT_TRUE(seen.count(t)) << t;
}

TEST(Jinja, SyntaxErrorsNameTheTemplateAndLine) {
  try {
    jinja::Template t("line 1\n{% for x in xs %}\n{{ x }\n{% endfor %}", "my.jinja");
    FAIL() << "parsed";
  } catch (const jinja::TemplateError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("my.jinja:3: ", 0), 0u) << e.what();
    EXPECT_EQ(e.line(), 3);
  }
  try {
    jinja::Template t("{% if a %}\n\n{% endfor %}", "t");
    FAIL() << "parsed";
  } catch (const InputError& e) {  // a user's template is user input
    EXPECT_NE(std::string(e.what()).find("t:3: Encountered unknown tag 'endfor'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(jinja::Template("{{ x | no_such_filter }}"), jinja::TemplateError);
  EXPECT_THROW(jinja::Template("{% include 'other.jinja' %}"), jinja::TemplateError);
}

TEST(Jinja, RaiseExceptionIsItsOwnErrorWithTheMessage) {
  jinja::Template t("ok\n{% if bad %}{{ raise_exception('roles must alternate') }}{% endif %}",
                    "t");
  jinja::Value ctx = jinja::Value::dict();
  ctx.set("bad", true);
  try {
    t.render(ctx);
    FAIL() << "rendered";
  } catch (const jinja::RaisedError& e) {
    EXPECT_EQ(e.message(), "roles must alternate");
    EXPECT_EQ(std::string(e.what()), "t:2: roles must alternate");
  }
  ctx.set("bad", false);
  EXPECT_EQ(t.render(ctx), "ok\n");
  // Other failures are TemplateErrors, not RaisedErrors.
  try {
    jinja::Template("{{ a.b }}").render(jinja::Value::dict());
    FAIL() << "rendered";
  } catch (const jinja::RaisedError&) {
    FAIL() << "undefined attribute reported as raise_exception";
  } catch (const jinja::TemplateError& e) {
    EXPECT_EQ(e.message(), "'a' is undefined");
  }
}

TEST(Jinja, ValuesKeepPythonSemantics) {
  EXPECT_EQ(jinja::float_repr(1.0), "1.0");
  EXPECT_EQ(jinja::float_repr(1e-5), "1e-05");
  EXPECT_EQ(jinja::float_repr(1e16), "1e+16");
  EXPECT_EQ(jinja::float_repr(0.1 + 0.2), "0.30000000000000004");
  // Insertion order survives JSON input (ordered_json) and tojson.
  auto v = jinja::Value::from_json(json::parse(R"({"z": 1, "a": [true, null, 2.5, "é"]})"));
  EXPECT_EQ(v.to_json(), R"({"z": 1, "a": [true, null, 2.5, "é"]})");
  EXPECT_EQ(v.repr(), "{'z': 1, 'a': [True, None, 2.5, 'é']}");
}

TEST(Template, ConfigFormsAndErrors) {
  const std::string dir = test::temp_dir("template_cfg");
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
  };
  // AddedToken-dict tokens, a list of named templates: tool_use is picked when tools are passed.
  write("tokenizer_config.json",
        R"({"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
      "eos_token": "</s>", "unk_token": null, "additional_special_tokens": ["<a>", {"content": "<b>"}],
      "chat_template": [{"name": "default", "template": "{{ bos_token }}D{{ tools }}{{ unk_token is defined }}"},
                        {"name": "tool_use", "template": "{{ bos_token }}T{{ tools|length }}{{ additional_special_tokens }}"}]})");
  auto t = HfChatTemplate::load(dir);
  HfChatTemplate::Input in;
  in.messages = jinja::Value::list();
  EXPECT_EQ(t.render(in).text, "<s>DNoneFalse");
  in.tools = jinja::Value::list({jinja::Value::dict()});
  EXPECT_EQ(t.render(in).text, "<s>T1['<a>', '<b>']");
  EXPECT_EQ(t.special_token("eos_token"), "</s>");
  EXPECT_EQ(t.special_token("unk_token"), "");
  // A chat_template.jinja beside the config wins, as in transformers.
  write("chat_template.jinja", "J{{ eos_token }}\n");
  EXPECT_EQ(HfChatTemplate::load(dir + "/tokenizer_config.json").render(in).text, "J</s>");
  // Errors name the file.
  auto message = [](const std::string& path) {
    try {
      HfChatTemplate::load(path);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string other = test::temp_dir("template_cfg_none");
  std::ofstream(other + "/tokenizer_config.json") << R"({"eos_token": "</s>"})";
  EXPECT_NE(message(other + "/tokenizer_config.json")
                .find(other + "/tokenizer_config.json: no chat_template"),
            std::string::npos);
  EXPECT_FALSE(HfChatTemplate::find_in(other).has_value());
  EXPECT_NE(message(other + "/missing.json").find("missing.json: no such file"), std::string::npos);
  std::ofstream(other + "/bad.json") << R"({"chat_template": "{% if %}"})";
  EXPECT_NE(message(other + "/bad.json").find("bad.json (chat_template):1: "), std::string::npos)
      << message(other + "/bad.json");
}

TEST(Template, CliRendersTheFixtures) {
  auto cases = read_jsonl(templates_dir() + "/chat_cases.jsonl");
  const std::string dir = test::temp_dir("template_cli");
  std::map<std::string, std::vector<const json*>> by_config;
  for (const auto& c : cases) {
    // strftime_now reads the clock in the CLI: the case that depends on it stays in the test above.
    if (c["template"] == "llama32-vision" &&
        !(c.contains("extra") && c["extra"].contains("date_string")))
      continue;
    by_config[c["config"].get<std::string>()].push_back(&c);
  }
  ASSERT_EQ(by_config.size(), 5u);
  for (const auto& [cfg, list] : by_config) {
    const std::string input = dir + "/" + cfg + ".jsonl";
    {
      std::ofstream f(input);
      for (const json* c : list) {
        json line = {{"messages", (*c)["messages"]},
                     {"add_generation_prompt", (*c)["add_generation_prompt"]}};
        if (c->contains("tools")) line["tools"] = (*c)["tools"];
        if (c->contains("extra"))
          for (auto it = (*c)["extra"].begin(); it != (*c)["extra"].end(); ++it)
            line[it.key()] = it.value();
        f << line.dump() << "\n\n";  // blank lines are skipped
      }
    }
    auto r =
        test::run_rig("template render --tokenizer-config " + templates_dir() + "/" + cfg, input);
    ASSERT_EQ(r.code, 0) << cfg << ": " << r.out;
    std::vector<json> out;
    size_t pos = 0;
    while (pos < r.out.size()) {  // split on '\n' only: rendered text may hold U+2028
      size_t nl = r.out.find('\n', pos);
      out.push_back(json::parse(r.out.substr(pos, nl - pos)));
      pos = nl == std::string::npos ? r.out.size() : nl + 1;
    }
    ASSERT_EQ(out.size(), list.size()) << cfg;
    for (size_t i = 0; i < list.size(); ++i) {
      const json& c = *list[i];
      if (c.contains("expected"))
        EXPECT_EQ(out[i].value("text", "<no text: " + out[i].dump() + ">"),
                  c["expected"].get<std::string>())
            << cfg << " #" << i;
      else
        EXPECT_EQ(out[i].value("error", "<no error>"), c["expected_error"].get<std::string>())
            << cfg << " #" << i;
    }
  }
}

TEST(Template, CliInputErrors) {
  const std::string dir = test::temp_dir("template_cli_err");
  const std::string cfg = templates_dir() + "/gemma3.tokenizer_config.json";
  auto run = [&](const std::string& text, const std::string& args) {
    std::ofstream(dir + "/in.jsonl") << text;
    return test::run_rig("template render --tokenizer-config " + args, dir + "/in.jsonl");
  };
  auto r =
      run("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"messages\": 3}\n", cfg);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("stdin:2: field 'messages'"), std::string::npos) << r.out;
  r = run("{\"messages\": [\n", cfg);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("stdin:1: not valid JSON"), std::string::npos) << r.out;
  // A conversation the template refuses: an error line, and the next line still renders.
  r =
      run("{\"messages\": [{\"role\": \"assistant\", \"content\": \"a\"}]}\n"
          "{\"messages\": [{\"role\": \"user\", \"content\": \"b\"}]}\n",
          cfg + " --add-generation-prompt");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out,
            "{\"error\":\"Conversation roles must alternate user/assistant/user/assistant/...\"}\n"
            "{\"text\":\"<bos><start_of_turn>user\\nb<end_of_turn>\\n<start_of_turn>model\\n\"}\n");
  r = run("", dir + "/nope.json");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find(dir + "/nope.json: no such file"), std::string::npos) << r.out;
  std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": "<s>"})";
  r = run("", dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("tokenizer_config.json: no chat_template"), std::string::npos) << r.out;
}
