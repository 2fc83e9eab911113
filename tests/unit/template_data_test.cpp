// Chat records with `auto` through the model's own chat template (a tokenizer_config.json beside
// tokenizer.json): the ids are the template's rendering tokenized as HF does, and the trained
// tokens are the assistant turns. The byte tokenizer makes ids readable: one id per UTF-8 byte,
// plus the Llama 3 and ChatML control tokens (tests/data/data/README.md).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "rig/data/dataset.h"
#include "rig/data/records.h"
#include "rig/text/chat_template.h"
#include "test_util.h"

using namespace rig;
namespace fs = std::filesystem;

namespace {

// A model folder: the byte tokenizer and the chat template of `config` (tests/data/templates).
std::string model_dir(const std::string& name, const std::string& config) {
  std::string dir = test::temp_dir(name);
  fs::copy_file(test::data_path("data/byte_tokenizer.json"), dir + "/tokenizer.json");
  if (!config.empty())
    fs::copy_file(test::data_path("templates/" + config), dir + "/tokenizer_config.json");
  return dir;
}

std::string write(const std::string& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir + "/" + name) << text;
  return dir + "/" + name;
}

// The trained pieces of a sample, decoded, and the whole sample decoded.
struct Decoded {
  std::string all;
  std::vector<std::string> trained;
};

Decoded decode(const Tokenizer& tok, const Sample& s) {
  Decoded d;
  d.all = tok.decode(s.ids);
  std::vector<int32_t> run;
  for (size_t i = 0; i <= s.ids.size(); ++i) {
    if (i < s.ids.size() && s.train[i]) {
      run.push_back(s.ids[i]);
    } else if (!run.empty()) {
      d.trained.push_back(tok.decode(run));
      run.clear();
    }
  }
  return d;
}

}  // namespace

TEST(TemplateData, Qwen3TemplateTrainsEachAssistantTurnAndItsEnd) {
  std::string dir = model_dir("tpl_data_qwen3", "qwen3.tokenizer_config.json");
  auto tok = Tokenizer::load(dir + "/tokenizer.json");
  auto data = write(
      dir, "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})"
      "\n"
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"},)"
      R"( {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},)"
      R"( {"role": "assistant", "content": "6", "reasoning_content": "add"}]})"
      "\n");
  RenderStats st;
  auto samples = load_samples(data, &tok, {}, &st);
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(st.chat_template, dir + "/tokenizer_config.json");
  // The ids are the rendering tokenized with its control tokens matched.
  auto tmpl = HfChatTemplate::load(dir);
  HfChatTemplate::Input in;
  in.messages = jinja::Value::from_json(nlohmann::json::parse(
      R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])"));
  const std::string text = tmpl.render(in).text;
  EXPECT_EQ(text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</"
            "think>\n\nHello<|im_end|>\n");
  EXPECT_EQ(samples[0].ids, tok.encode(text, {.special = true}));
  // Trained: from after the generation prompt to <|im_end|>; the newline after it is not.
  auto d0 = decode(tok, samples[0]);
  EXPECT_EQ(d0.trained, (std::vector<std::string>{"<think>\n\n</think>\n\nHello<|im_end|>"}));
  auto d1 = decode(tok, samples[1]);
  EXPECT_EQ(d1.trained,
            (std::vector<std::string>{"4<|im_end|>", "<think>\nadd\n</think>\n\n6<|im_end|>"}));
  EXPECT_EQ(d1.all.rfind("<|im_start|>system\nS<|im_end|>\n", 0), 0u) << d1.all;
}

TEST(TemplateData, Llama3TemplateLeavesItsTrailingHeaderUntrained) {
  // This template always ends with an assistant header, even after the last assistant turn.
  std::string dir = model_dir("tpl_data_llama3", "llama3.tokenizer_config.json");
  auto tok = Tokenizer::load(dir + "/tokenizer.json");
  auto data = write(
      dir, "chat.jsonl",
      R"({"messages": [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": " Yo "},)"
      R"( {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Bye"}]})"
      "\n");
  auto samples = load_samples(data, &tok, {});
  ASSERT_EQ(samples.size(), 1u);
  auto d = decode(tok, samples[0]);
  EXPECT_EQ(d.all,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nAgain<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(d.trained, (std::vector<std::string>{"Yo<|eot_id|>", "Bye<|eot_id|>"}));
}

TEST(TemplateData, RefusedConversationsAreInvalidRecordsWithTheTemplatesMessage) {
  std::string dir = model_dir("tpl_data_gemma3", "gemma3.tokenizer_config.json");
  auto tok = Tokenizer::load(dir + "/tokenizer.json");
  auto data = write(
      dir, "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})"
      "\n"
      R"({"messages": [{"role": "assistant", "content": "first"}]})"
      "\n");
  try {
    load_samples(data, &tok, {});
    FAIL() << "loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  data + ":2: field 'messages': chat template " + dir +
                  "/tokenizer_config.json: "
                  "Conversation roles must alternate user/assistant/user/assistant/..."),
              std::string::npos)
        << e.what();
  }
  RenderOptions o;
  o.skip_invalid = true;
  RenderStats st;
  auto samples = load_samples(data, &tok, o, &st);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(st.invalid, 1u);
  // Gemma's turns close with <end_of_turn>, not one of this tokenizer's special tokens: the
  // turn then runs to the end of the text.
  EXPECT_EQ(decode(tok, samples[0]).trained, (std::vector<std::string>{"b<end_of_turn>\n"}));
}

TEST(TemplateData, GenerationTagsGiveTheTrainedSpans) {
  std::string dir = model_dir("tpl_data_gen", "");
  write(
      dir, "tokenizer_config.json",
      R"({"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n)"
      R"({% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %})"
      R"({{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"})");
  auto tok = Tokenizer::load(dir + "/tokenizer.json");
  auto data = write(
      dir, "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a1"},)"
      R"( {"role": "user", "content": "v"}, {"role": "assistant", "content": "a2"}]})"
      "\n");
  auto samples = load_samples(data, &tok, {});
  auto d = decode(tok, samples.at(0));
  EXPECT_EQ(d.trained, (std::vector<std::string>{"a1<|im_end|>", "a2<|im_end|>"}));
  // trim_blocks eats the newline after each block tag, as in Jinja2.
  EXPECT_EQ(d.all,
            "<|im_start|>user\nu<|im_end|><|im_start|>assistant\na1<|im_end|><|im_start|>user\nv<|"
            "im_end|>"
            "<|im_start|>assistant\na2<|im_end|>");
}

TEST(TemplateData, WithoutATemplateFileAutoKeepsTheBuiltIns) {
  std::string dir = model_dir("tpl_data_none", "");
  auto tok = Tokenizer::load(dir + "/tokenizer.json");
  auto data = write(
      dir, "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})"
      "\n");
  RenderStats st;
  auto samples = load_samples(data, &tok, {}, &st);
  EXPECT_EQ(st.chat_template, "llama3");  // the byte tokenizer has Llama 3's header tokens
  EXPECT_EQ(decode(tok, samples.at(0)).trained, (std::vector<std::string>{"Yo<|eot_id|>"}));
  // An explicit built-in wins over the model's template.
  fs::copy_file(test::data_path("templates/qwen3.tokenizer_config.json"),
                dir + "/tokenizer_config.json");
  RenderOptions o;
  o.chat = ChatTemplate::ChatML;
  load_samples(data, &tok, o, &st);
  EXPECT_EQ(st.chat_template, "chatml");
}

TEST(TemplateData, PreparedCacheRecordsTheTemplateAndNoticesItsEdits) {
  std::string dir = model_dir("tpl_data_cache", "qwen3.tokenizer_config.json");
  auto data = write(
      dir, "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})"
      "\n");
  PrepareOptions o;
  o.source = data;
  o.tokenizer = dir + "/tokenizer.json";
  o.out_dir = dir + "/cache";
  auto r = prepare_dataset(o);
  EXPECT_TRUE(r.rebuilt);
  EXPECT_EQ(r.stats.chat_template, dir + "/tokenizer_config.json");
  auto insp = test::run_rig("data inspect " + o.out_dir);
  EXPECT_EQ(insp.code, 0) << insp.out;
  EXPECT_NE(insp.out.find("\"chat_template\":\"" + dir + "/tokenizer_config.json\""),
            std::string::npos)
      << insp.out;
  EXPECT_NE(insp.out.find("\nchat template: " + dir + "/tokenizer_config.json\n"), std::string::npos)
      << insp.out;
  auto prep = test::run_rig("data prepare --force --data " + data + " --tokenizer " + o.tokenizer +
                            " --out " + dir + "/cache2");
  EXPECT_EQ(prep.code, 0) << prep.out;
  EXPECT_NE(prep.out.find("chat template: " + dir + "/tokenizer_config.json"), std::string::npos)
      << prep.out;
  EXPECT_FALSE(prepare_dataset(o).rebuilt);
  // Editing the template makes the cache stale.
  write(dir, "chat_template.jinja", "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}");
  EXPECT_THROW(open_prepared(o), InputError);
  r = prepare_dataset(o);
  EXPECT_TRUE(r.rebuilt);
  EXPECT_EQ(r.reason, "chat_template_xxh3 changed");
  EXPECT_EQ(r.stats.chat_template, dir + "/chat_template.jinja");
}
