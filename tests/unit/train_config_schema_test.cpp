// The config schema against the parser and the reference page: every name in it parses, every
// default in it is the parser's, and docs/config-reference.md is its rendering.
#include "rig/train/train_config_schema.h"

#include <gtest/gtest.h>

#include <set>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/train/train_config.h"
#include "rig/train/train_config_read.h"
#include "test_util.h"

namespace {

using json = nlohmann::json;

const char* kRegenerate =
    "docs/config-reference.md is not the rendering of the config schema "
    "(src/rig/train/train_config_schema.cpp). Edit the schema, not the generated tables, then "
    "regenerate the page from the repository root with:\n"
    "  build/rig config reference --write docs/config-reference.md";

// Sets `value` at a dotted schema name in `root`; "N" is the first list item.
void set_at(json& root, const std::string& name, const json& value) {
  json* cur = &root;
  for (size_t b = 0;;) {
    size_t dot = name.find('.', b);
    std::string part = name.substr(b, dot == std::string::npos ? dot : dot - b);
    if (part == "N") {
      if (!cur->is_array()) *cur = json::array();
      if (cur->empty()) cur->push_back(json::object());
      cur = &(*cur)[0];
    } else {
      if (!cur->is_object()) *cur = json::object();
      cur = &(*cur)[part];
    }
    if (dot == std::string::npos) break;
    b = dot + 1;
  }
  *cur = value;
}

// The smallest config that parses: a model and one dataset. JSON is YAML.
json minimal() {
  json j;
  set_at(j, "model", "/models/m");
  set_at(j, "datasets.N.path", "data.jsonl");
  return j;
}

TEST(ConfigSchema, ReferencePageIsTheRendering) {
  const std::string path = std::string(RIG_SOURCE_DIR) + "/docs/config-reference.md";
  const std::string page = rig::read_file(path);
  EXPECT_EQ(rig::update_config_reference(page, path), page) << kRegenerate;
}

TEST(ConfigSchema, RegeneratesOnlyBetweenMarkers) {
  const std::string page =
      "intro\n<!-- begin generated: keys -->\nold\n<!-- end generated: keys -->\nmiddle\n"
      "<!-- begin generated: aliases -->\n<!-- end generated: aliases -->\nend\n";
  const std::string out = rig::update_config_reference(page, "p.md");
  EXPECT_EQ(out, "intro\n<!-- begin generated: keys -->\n" + rig::config_reference_keys_markdown() +
                     "<!-- end generated: keys -->\nmiddle\n<!-- begin generated: aliases -->\n" +
                     rig::config_reference_aliases_markdown() +
                     "<!-- end generated: aliases -->\nend\n");
  EXPECT_EQ(rig::update_config_reference(out, "p.md"), out);
  try {
    rig::update_config_reference("no markers\n", "p.md");
    ADD_FAILURE() << "no error without markers";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("p.md"), std::string::npos) << e.what();
  }
}

TEST(ConfigSchema, NamesAreUnique) {
  std::set<std::string> seen;
  for (const auto& k : rig::config_schema()) {
    EXPECT_TRUE(seen.insert(k.name).second) << k.name;
    for (const auto& a : k.aliases) EXPECT_TRUE(seen.insert(a.name).second) << a.name;
  }
}

// Every key of the schema, set to its default (keys without one to null, which reads as not
// set), parses to the same config as the minimal one: the parser takes every key the schema
// names, with every mapping present so each of its take() calls runs (and throws on a key the
// schema lacks), and the schema's defaults are the parser's.
TEST(ConfigSchema, EveryKeyAtItsDefaultParsesToTheDefaults) {
  json all = minimal();
  size_t n = 0;
  for (const auto& k : rig::config_schema()) {
    if (k.name == "model" || k.name == "datasets" || k.name == "datasets.N.path") continue;
    json v = k.default_yaml.empty() ? json(nullptr)
                                    : rig::config_read::yaml_to_json(YAML::Load(k.default_yaml));
    set_at(all, k.name, v);
    ++n;
  }
  EXPECT_GT(n, 60u);
  const rig::TrainConfig want = rig::parse_train_config(minimal().dump(), "minimal.yaml");
  rig::TrainConfig got;
  try {
    got = rig::parse_train_config(all.dump(1), "all.yaml");
  } catch (const std::exception& e) {
    FAIL() << e.what() << "\n" << all.dump(1);
  }
  EXPECT_EQ(got.to_json().dump(1), want.to_json().dump(1));
  EXPECT_EQ(got.config_hash(), want.config_hash());
}

// Each alias is a name the parser accepts where the schema puts it.
TEST(ConfigSchema, EveryAliasIsAccepted) {
  for (const auto& k : rig::config_schema())
    for (const auto& a : k.aliases) {
      json j = minimal();
      set_at(j, a.name, nullptr);
      try {
        rig::parse_train_config(j.dump(), "cfg.yaml");
      } catch (const std::exception& e) {
        ADD_FAILURE() << a.name << " (alias of " << k.name << "): " << e.what();
      }
    }
}

TEST(ConfigSchema, KeysAtAMappingFollowTheSchema) {
  const auto& top = rig::config_keys_at("");
  for (const char* k : {"model", "base_model", "lora", "lora_r", "datasets", "optimizer", "guard"})
    EXPECT_NE(std::find(top.begin(), top.end(), k), top.end()) << k;
  EXPECT_EQ(std::find(top.begin(), top.end(), "r"), top.end());
  EXPECT_EQ(rig::config_keys_at("datasets.3"), rig::config_keys_at("datasets.N"));
  EXPECT_EQ(rig::config_keys_at("datasets.N"),
            (std::vector<std::string>{"path", "format", "type", "template", "chat_template"}));
  EXPECT_TRUE(rig::config_keys_at("no_such_mapping").empty());
}

TEST(ConfigSchema, CliPrintsAndChecksThePage) {
  auto r = rig::test::run_rig("config reference");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("| `lora.r` | integer ≥ 1, `16` |"), std::string::npos) << r.out;
  r = rig::test::run_rig(std::string("config reference --check ") + RIG_SOURCE_DIR +
                         "/docs/config-reference.md");
  EXPECT_EQ(r.code, 0) << r.out << kRegenerate;

  const std::string dir = rig::test::temp_dir("config_reference_cli");
  const std::string stale = dir + "/page.md";
  rig::write_file_atomic(stale,
                         "# page\n<!-- begin generated: keys -->\n<!-- end generated: keys -->\n"
                         "<!-- begin generated: aliases -->\n<!-- end generated: aliases -->\n");
  r = rig::test::run_rig("config reference --check " + stale);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("out of date"), std::string::npos) << r.out;
  r = rig::test::run_rig("config reference --write " + stale);
  EXPECT_EQ(r.code, 0) << r.out;
  r = rig::test::run_rig("config reference --check " + stale);
  EXPECT_EQ(r.code, 0) << r.out;
}

}  // namespace
