// The training config's keys as one table: every name the parser accepts (canonical names and the
// axolotl/torchtune spellings), each key's default and its documentation. The key tables of
// docs/config-reference.md are rendered from it (`rig config reference --write
// docs/config-reference.md`), and a unit test keeps the committed page equal to the rendering.
#pragma once
#include <string>
#include <vector>

namespace rig {

// Another name the parser accepts for a key.
struct ConfigAlias {
  std::string name;  // dotted like ConfigKey::name
  std::string note =
      {};  // markdown: how it reads when not plainly as the key ("`true` is rejected")
};

struct ConfigKey {
  std::string name;               // dotted path; "N" stands for a list index ("datasets.N.path")
  std::string type;               // markdown, as the reference shows it: "integer ≥ 1"
  std::string default_yaml = {};  // the default as YAML the parser reads back; empty: none
  std::string default_text =
      {};  // markdown, for a default with no YAML form ("required"); may be empty
  std::vector<ConfigAlias> aliases = {};
  std::string doc;  // markdown
};

struct ConfigSection {
  std::string title;       // markdown heading text
  std::string intro = {};  // markdown paragraph above the table; may be empty
  std::vector<ConfigKey> keys;
};

// The table, in documentation order.
const std::vector<ConfigSection>& config_sections();
// Every key of every section, in the same order.
const std::vector<ConfigKey>& config_schema();

// The names a mapping at `prefix` accepts, canonical and alias, in schema order: "" is the top
// level, "lora" the lora mapping, "datasets.N" (or "datasets.0") one dataset.
const std::vector<std::string>& config_keys_at(const std::string& prefix);

// Markdown rendered from the table: one table of keys per section, and the alias table.
std::string config_reference_keys_markdown();
std::string config_reference_aliases_markdown();
// `page` (docs/config-reference.md) with what lies between its generated-region markers replaced
// by the renderings above; throws InputError naming `source` when a marker is missing.
std::string update_config_reference(const std::string& page, const std::string& source);

}  // namespace rig
