#include "rig/train/train_config_read.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <stdexcept>

#include "rig/train/train_config.h"
#include "rig/train/train_config_schema.h"

namespace rig::config_read {

using json = nlohmann::json;

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  std::string m = closest_match(word, candidates);
  return m.empty() ? std::string() : fmt::format("; did you mean '{}'?", m);
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

std::string where(const Ctx& ctx, const Item& it) {
  if (it.from_override) return fmt::format("{}: --set {}", ctx.source, it.path);
  if (it.line > 0) return fmt::format("{}:{}", ctx.source, it.line);
  return ctx.source;
}

bool is_override(const Ctx& ctx, const std::string& path) {
  for (const auto& o : ctx.override_paths)
    if (path == o || path.rfind(o + ".", 0) == 0) return true;
  return false;
}

namespace {

std::string scalar_text(const YAML::Node& n) {
  if (n.IsScalar()) return n.Scalar();
  if (n.IsNull()) return "null";
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

}  // namespace

[[noreturn]] void type_error(const Ctx& ctx, const Item& it, const char* expected) {
  bad_input("{}: '{}' must be {}, found '{}'", where(ctx, it), it.path, expected,
            scalar_text(it.value));
}

int64_t as_int(const Ctx& ctx, const Item& it) {
  if (!it.value.IsScalar()) type_error(ctx, it, "an integer");
  const std::string& s = it.value.Scalar();
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) {
    // Accept "1e3" and "2.0" when they are whole numbers.
    char* end = nullptr;
    double d = std::strtod(s.c_str(), &end);
    if (s.empty() || *end || !std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9e15)
      type_error(ctx, it, "an integer");
    v = int64_t(d);
  }
  return v;
}

double as_double(const Ctx& ctx, const Item& it) {
  if (!it.value.IsScalar()) type_error(ctx, it, "a number");
  const std::string& s = it.value.Scalar();
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (s.empty() || *end || !std::isfinite(d)) type_error(ctx, it, "a number");
  return d;
}

bool as_bool(const Ctx& ctx, const Item& it) {
  if (!it.value.IsScalar()) type_error(ctx, it, "true or false");
  bool b;
  if (!YAML::convert<bool>::decode(it.value, b)) type_error(ctx, it, "true or false");
  return b;
}

std::string as_string(const Ctx& ctx, const Item& it) {
  if (!it.value.IsScalar()) type_error(ctx, it, "a string");
  return it.value.Scalar();
}

std::string as_enum(const Ctx& ctx, const Item& it, const std::vector<std::string>& allowed,
                    const std::map<std::string, std::string>& aliases) {
  std::string s = as_string(ctx, it);
  if (std::find(allowed.begin(), allowed.end(), s) != allowed.end()) return s;
  if (auto a = aliases.find(s); a != aliases.end()) return a->second;
  std::vector<std::string> all = allowed;
  for (const auto& [k, v] : aliases) all.push_back(k);
  bad_input("{}: '{}' is '{}', which is not one of {}{}", where(ctx, it), it.path, s, join(allowed),
            did_you_mean(s, all));
}

json yaml_to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    json j = json::object();
    for (auto kv : n) j[kv.first.as<std::string>()] = yaml_to_json(kv.second);
    return j;
  }
  if (n.IsSequence()) {
    json j = json::array();
    for (auto v : n) j.push_back(yaml_to_json(v));
    return j;
  }
  if (!n.IsScalar()) return nullptr;
  const std::string& s = n.Scalar();
  if (n.Tag() == "!") return s;
  int64_t i;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), i);
  if (ec == std::errc() && p == s.data() + s.size()) return i;
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (!s.empty() && !*end && std::isfinite(d)) return d;
  bool b;
  if (YAML::convert<bool>::decode(n, b)) return b;
  if (s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
  return s;
}

std::optional<Item> MapReader::take(const std::string& key) {
  // A key parsed but missing from the schema would be undocumented and never suggested.
  const auto& known = config_keys_at(prefix_);
  if (std::find(known.begin(), known.end(), key) == known.end())
    throw std::logic_error(fmt::format("config key '{}{}{}' is parsed but not in the schema",
                                       prefix_, prefix_.empty() ? "" : ".", key));
  if (!node_.IsMap()) return std::nullopt;
  for (auto kv : node_) {
    if (kv.first.Scalar() != key) continue;
    used_.insert(key);
    Item it;
    it.path = prefix_.empty() ? key : prefix_ + "." + key;
    it.value = kv.second;
    it.line = kv.first.Mark().is_null() ? -1 : kv.first.Mark().line + 1;
    it.from_override = is_override(ctx_, it.path);
    if (it.value.IsNull() && !it.from_override) return std::nullopt;  // "key:" means unset
    return it;
  }
  return std::nullopt;
}

void MapReader::finish() {
  if (!node_.IsMap()) return;
  for (auto kv : node_) {
    std::string key = kv.first.Scalar();
    if (used_.count(key)) continue;
    Item it;
    it.path = prefix_.empty() ? key : prefix_ + "." + key;
    it.line = kv.first.Mark().is_null() ? -1 : kv.first.Mark().line + 1;
    it.from_override = is_override(ctx_, it.path);
    std::vector<std::string> full;
    for (const auto& k : config_keys_at(prefix_))
      full.push_back(prefix_.empty() ? k : prefix_ + "." + k);
    bad_input("{}: unknown key '{}'{}", where(ctx_, it), it.path, did_you_mean(it.path, full));
  }
}

YAML::Node need_map(const Ctx& ctx, const Item& it) {
  if (!it.value.IsMap()) type_error(ctx, it, "a mapping of keys");
  return it.value;
}

void apply_override(YAML::Node root, const std::string& spec, const std::string& source,
                    std::set<std::string>& paths) {
  auto eq = spec.find('=');
  if (eq == std::string::npos || eq == 0)
    bad_input("{}: --set '{}': expected key=value (e.g. lora.r=8)", source, spec);
  std::string key = spec.substr(0, eq), value = spec.substr(eq + 1);
  YAML::Node parsed;
  try {
    parsed = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    bad_input("{}: --set '{}': the value is not valid YAML: {}", source, spec, e.msg);
  }
  std::vector<std::string> parts;
  for (size_t b = 0;;) {
    size_t dot = key.find('.', b);
    parts.push_back(key.substr(b, dot == std::string::npos ? std::string::npos : dot - b));
    if (dot == std::string::npos) break;
    b = dot + 1;
  }
  for (const auto& p : parts)
    if (p.empty()) bad_input("{}: --set '{}': empty part in key '{}'", source, spec, key);
  YAML::Node cur;
  cur.reset(root);  // yaml-cpp: '=' between nodes assigns into the tree; reset() rebinds
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    bool last = i + 1 == parts.size();
    if (cur.IsSequence()) {
      size_t idx = 0;
      auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), idx);
      if (ec != std::errc() || ptr != p.data() + p.size() || idx > cur.size())
        bad_input("{}: --set '{}': '{}' is a list of {}; '{}' is not an index 0..{}", source, spec,
                  join({parts.begin(), parts.begin() + long(i)}, "."), cur.size(), p, cur.size());
      if (idx == cur.size()) cur.push_back(YAML::Node(YAML::NodeType::Map));
      if (last) {
        cur[idx] = parsed;
      } else {
        YAML::Node next = cur[idx];
        cur.reset(next);
      }
      continue;
    }
    if (!cur.IsMap()) cur = YAML::Node(YAML::NodeType::Map);  // replaces a scalar or null
    if (last) {
      cur[p] = parsed;
    } else {
      YAML::Node next = cur[p];
      if (!next.IsMap() && !next.IsSequence()) next = YAML::Node(YAML::NodeType::Map);
      cur.reset(next);
    }
  }
  paths.insert(key);
}

}  // namespace rig::config_read
