// docs/config-reference.md's key and alias tables, rendered from the schema.
#include <fmt/format.h>

#include "rig/core/error.h"
#include "rig/train/train_config_schema.h"

namespace rig {

namespace {

// A pipe ends a markdown table cell, even inside backticks.
std::string cell(const std::string& s) {
  std::string out;
  for (char ch : s) out += ch == '|' ? std::string("\\|") : std::string(1, ch);
  return out;
}

// "`adapter` (`lora` or `qlora`), `load_in_8bit`": the aliases with their notes.
std::string alias_list(const ConfigKey& k) {
  std::string s;
  for (size_t i = 0; i < k.aliases.size(); ++i) {
    s += (i ? ", `" : "`") + k.aliases[i].name + "`";
    if (!k.aliases[i].note.empty()) s += " (" + k.aliases[i].note + ")";
  }
  return s;
}

std::string alias_sentence(const ConfigKey& k) {
  if (k.aliases.empty()) return "";
  return (k.aliases.size() == 1 ? " Alias " : " Aliases ") + alias_list(k) + ".";
}

}  // namespace

std::string config_reference_keys_markdown() {
  std::string md;
  for (const auto& s : config_sections()) {
    md += fmt::format("{}### {}\n\n", md.empty() ? "" : "\n", s.title);
    if (!s.intro.empty()) md += s.intro + "\n\n";
    md += "| key | type, default | meaning |\n| --- | --- | --- |\n";
    for (const auto& k : s.keys) {
      std::string type = k.type;
      if (!k.default_yaml.empty()) type += ", `" + k.default_yaml + "`";
      if (!k.default_text.empty()) type += ", " + k.default_text;
      md +=
          fmt::format("| `{}` | {} | {} |\n", k.name, cell(type), cell(k.doc + alias_sentence(k)));
    }
  }
  return md;
}

std::string config_reference_aliases_markdown() {
  std::string md = "| you write | rig reads it as |\n| --- | --- |\n";
  for (const auto& k : config_schema()) {
    if (k.aliases.empty()) continue;
    md += fmt::format("| {} | `{}` |\n", cell(alias_list(k)), k.name);
  }
  return md;
}

std::string update_config_reference(const std::string& page, const std::string& source) {
  std::string out = page;
  auto region = [&](const std::string& name, const std::string& text) {
    const std::string begin = "<!-- begin generated: " + name, end = "<!-- end generated: " + name;
    size_t b = out.find(begin), e = out.find(end);
    if (b == std::string::npos || e == std::string::npos || e < b)
      bad_input("{}: no '{} ... -->' ... '{} -->' region to put the generated {} in", source, begin,
                end, name);
    size_t from = out.find('\n', b);
    if (from == std::string::npos || from > e)
      bad_input("{}: the '{}' marker needs a line of its own", source, begin);
    out.replace(from + 1, e - (from + 1), text);
  };
  region("keys", config_reference_keys_markdown());
  region("aliases", config_reference_aliases_markdown());
  return out;
}

}  // namespace rig
