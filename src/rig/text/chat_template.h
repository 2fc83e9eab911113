// A model's own chat template (Hugging Face `chat_template` in tokenizer_config.json, or a
// chat_template.jinja beside it), rendered as transformers' tokenizer.apply_chat_template does:
//   template.render(messages=..., tools=tools or None, documents=None,
//                   add_generation_prompt=..., **tokenizer.special_tokens_map, **extra)
// The special tokens are those of tokenizer_config.json that are set (bos_token, eos_token,
// unk_token, sep_token, pad_token, cls_token, mask_token, additional_special_tokens and the keys
// of extra_special_tokens), as strings; the AddedToken form {"content": "<s>", ...} gives its
// content.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "rig/text/jinja.h"

namespace rig {

class HfChatTemplate {
 public:
  // Reads a tokenizer_config.json (or a folder holding one). Missing files, bad JSON, a missing
  // template or one that does not parse throw InputError naming the file.
  static HfChatTemplate load(const std::string& path);
  // The template of the tokenizer_config.json or chat_template.jinja in `dir`, if there is one.
  static std::optional<HfChatTemplate> find_in(const std::string& dir);

  struct Input {
    jinja::Value messages;  // a list of {"role", "content", ...}
    jinja::Value tools;     // a list of tool schemas; undefined renders as None
    bool add_generation_prompt = false;
    jinja::Value extra;  // a dict of further template variables (enable_thinking...)
  };
  // Throws jinja::RaisedError when the template calls raise_exception(), jinja::TemplateError on
  // other rendering errors.
  jinja::Rendered render(const Input& in, const jinja::RenderOptions& opt = {}) const;

  // Where the template came from: "FILE" or "FILE (tool_use)".
  const std::string& source_name() const { return name_; }
  const jinja::Value& special_tokens() const { return special_; }
  // The special token `key` ("eos_token"...), or "" when it is not set.
  std::string special_token(const std::string& key) const;

 private:
  HfChatTemplate() = default;
  std::string name_;
  std::shared_ptr<jinja::Template> default_, tool_use_;
  jinja::Value special_;
};

}  // namespace rig
