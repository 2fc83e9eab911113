#include "rig/train/train_config.h"

#include <xxhash.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "rig/core/allocator.h"
#include "rig/core/error.h"
#include "rig/core/tensor.h"
#include "rig/io/atomic_file.h"
#include "rig/model/catalog.h"
#include "rig/model/config.h"
#include "rig/text/tokenizer.h"
#include "rig/train/guard.h"

namespace rig {

using json = nlohmann::json;

// ---- small helpers ----------------------------------------------------------

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    // A prefix ("micro_batch" for "micro_batch_size") is as good as a one-letter typo.
    if (word.size() >= 3 && (c.rfind(word, 0) == 0 || word.rfind(c, 0) == 0)) d = std::min<size_t>(d, 1);
    if (d < best_d) best_d = d, best = c;
  }
  size_t limit = std::max<size_t>(2, word.size() / 3);
  return best_d <= limit ? best : std::string();
}

namespace {

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  std::string m = closest_match(word, candidates);
  return m.empty() ? std::string() : fmt::format("; did you mean '{}'?", m);
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

const std::vector<std::string> kLinearTargets = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"};

// ---- reading the YAML tree ----------------------------------------------------

struct Ctx {
  std::string source;
  std::set<std::string> override_paths;
  struct Assigned {
    std::string path, where;
    bool from_override;
  };
  std::map<std::string, Assigned> assigned;  // field -> who set it
};

// One key's value with what is needed to report on it.
struct Item {
  std::string path;  // dotted: "lora.r", "datasets.0.path"
  YAML::Node value;
  int line = -1;  // 1-based; -1 when unknown
  bool from_override = false;
};

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

std::string scalar_text(const YAML::Node& n) {
  if (n.IsScalar()) return n.Scalar();
  if (n.IsNull()) return "null";
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

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
                    const std::map<std::string, std::string>& aliases = {}) {
  std::string s = as_string(ctx, it);
  if (std::find(allowed.begin(), allowed.end(), s) != allowed.end()) return s;
  if (auto a = aliases.find(s); a != aliases.end()) return a->second;
  std::vector<std::string> all = allowed;
  for (const auto& [k, v] : aliases) all.push_back(k);
  bad_input("{}: '{}' is '{}', which is not one of {}{}", where(ctx, it), it.path, s,
            join(allowed), did_you_mean(s, all));
}

// Plain scalars become numbers, booleans or null when they read as such; quoted ones stay strings.
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

// Reads one mapping: take() each known key (present or not, so typos can be matched against all
// of them), then finish() rejects whatever was not taken.
class MapReader {
 public:
  MapReader(Ctx& ctx, YAML::Node node, std::string prefix)
      : ctx_(ctx), node_(std::move(node)), prefix_(std::move(prefix)) {}

  std::optional<Item> take(const std::string& key) {
    known_.push_back(key);
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

  void finish() {
    if (!node_.IsMap()) return;
    for (auto kv : node_) {
      std::string key = kv.first.Scalar();
      if (used_.count(key)) continue;
      Item it;
      it.path = prefix_.empty() ? key : prefix_ + "." + key;
      it.line = kv.first.Mark().is_null() ? -1 : kv.first.Mark().line + 1;
      it.from_override = is_override(ctx_, it.path);
      std::vector<std::string> full;
      for (const auto& k : known_) full.push_back(prefix_.empty() ? k : prefix_ + "." + k);
      bad_input("{}: unknown key '{}'{}", where(ctx_, it), it.path, did_you_mean(it.path, full));
    }
  }

 private:
  Ctx& ctx_;
  YAML::Node node_;
  std::string prefix_;
  std::vector<std::string> known_;
  std::set<std::string> used_;
};

// Two keys meaning the same thing (learning_rate and optimizer.lr): an override beats the file;
// two from the same place are an error naming both.
template <typename F>
void assign(Ctx& ctx, const std::string& field, const Item& it, F apply) {
  auto prev = ctx.assigned.find(field);
  if (prev != ctx.assigned.end()) {
    if (prev->second.from_override && !it.from_override) return;
    if (prev->second.from_override == it.from_override)
      bad_input("{}: '{}' and '{}' ({}) both set {}; keep one", where(ctx, it), it.path,
                prev->second.path, prev->second.where, field);
  }
  apply();
  ctx.assigned[field] = {it.path, where(ctx, it), it.from_override};
}

YAML::Node need_map(const Ctx& ctx, const Item& it) {
  if (!it.value.IsMap()) type_error(ctx, it, "a mapping of keys");
  return it.value;
}

std::vector<std::string> read_targets(const Ctx& ctx, const Item& it) {
  std::vector<std::string> out;
  if (it.value.IsScalar()) {
    std::string s = it.value.Scalar();
    if (s == "all-linear" || s == "all_linear") return kLinearTargets;
    out.push_back(s);  // a single module name
  } else if (it.value.IsSequence()) {
    for (size_t i = 0; i < it.value.size(); ++i) {
      Item e{fmt::format("{}.{}", it.path, i), it.value[i], it.line, it.from_override};
      out.push_back(as_string(ctx, e));
    }
  } else {
    type_error(ctx, it, "a list of module names");
  }
  for (const auto& t : out)
    if (std::find(kLinearTargets.begin(), kLinearTargets.end(), t) == kLinearTargets.end())
      bad_input("{}: '{}': '{}' is not a LoRA target (use {} or all-linear){}", where(ctx, it),
                it.path, t, join(kLinearTargets), did_you_mean(t, kLinearTargets));
  if (out.empty()) bad_input("{}: '{}' is empty; name at least one module", where(ctx, it), it.path);
  return out;
}

const std::vector<std::string> kFormats = {"alpaca", "chat", "text", "tokens"};
const std::map<std::string, std::string> kFormatAliases = {
    {"chat_template", "chat"}, {"completion", "text"}, {"pretrain", "text"}, {"sharegpt", "chat"}};
const std::vector<std::string> kTemplates = {"alpaca", "llama3", "chatml"};

DatasetSettings read_dataset(Ctx& ctx, const Item& it) {
  DatasetSettings d;
  if (it.value.IsScalar()) {
    d.path = it.value.Scalar();
    return d;
  }
  MapReader r(ctx, need_map(ctx, it), it.path);
  if (auto v = r.take("path")) d.path = as_string(ctx, *v);
  auto fmt_item = r.take("format");
  auto type_item = r.take("type");  // axolotl
  if (fmt_item && type_item)
    bad_input("{}: '{}' and '{}' both set the dataset format; keep one", where(ctx, *type_item),
              type_item->path, fmt_item->path);
  if (auto v = fmt_item ? fmt_item : type_item) d.format = as_enum(ctx, *v, kFormats, kFormatAliases);
  auto tpl = r.take("template");
  auto tpl2 = r.take("chat_template");
  if (auto v = tpl ? tpl : tpl2) d.template_name = as_enum(ctx, *v, kTemplates);
  r.finish();
  if (d.path.empty()) bad_input("{}: '{}' needs a 'path'", where(ctx, it), it.path);
  return d;
}

}  // namespace

// ---- the parser ----------------------------------------------------------------

namespace {

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

TrainConfig parse_root(Ctx& ctx, const YAML::Node& root) {
  TrainConfig c;
  c.source = ctx.source;
  MapReader r(ctx, root, "");

  // Model and its origin.
  if (auto v = r.take("model")) assign(ctx, "the model", *v, [&] { c.model = as_string(ctx, *v); });
  if (auto v = r.take("base_model"))
    assign(ctx, "the model", *v, [&] { c.model = as_string(ctx, *v); });
  if (auto v = r.take("init")) c.init = as_enum(ctx, *v, {"pretrained", "random"});
  if (auto v = r.take("architecture")) {
    if (v->value.IsScalar()) {
      c.architecture_name = v->value.Scalar();
      if (!builtin_architecture(c.architecture_name))
        bad_input("{}: 'architecture' '{}' is not a built-in shape (built-in: {}){}; or give an "
                  "inline config.json object",
                  where(ctx, *v), c.architecture_name, join(builtin_architecture_names()),
                  did_you_mean(c.architecture_name, builtin_architecture_names()));
    } else if (v->value.IsMap()) {
      c.architecture = yaml_to_json(v->value);
      ModelConfig::from_json(c.architecture, where(ctx, *v) + ": architecture");
    } else {
      type_error(ctx, *v, "a built-in shape name or a config.json mapping");
    }
  }

  // Method.
  if (auto v = r.take("method"))
    assign(ctx, "the method", *v, [&] { c.method = as_enum(ctx, *v, {"full", "lora", "qlora"}); });
  if (auto v = r.take("adapter"))
    assign(ctx, "the method", *v, [&] { c.method = as_enum(ctx, *v, {"lora", "qlora"}); });
  bool load_4bit = false;
  std::optional<Item> load_4bit_item = r.take("load_in_4bit");
  if (load_4bit_item) load_4bit = as_bool(ctx, *load_4bit_item);
  if (auto v = r.take("load_in_8bit"); v && as_bool(ctx, *v))
    bad_input("{}: 8-bit base weights are not supported; use 'adapter: qlora' (4-bit NF4)",
              where(ctx, *v));

  // LoRA.
  if (auto v = r.take("lora")) {
    MapReader l(ctx, need_map(ctx, *v), "lora");
    if (auto x = l.take("r")) assign(ctx, "lora.r", *x, [&] { c.lora.r = as_int(ctx, *x); });
    if (auto x = l.take("alpha"))
      assign(ctx, "lora.alpha", *x, [&] { c.lora.alpha = as_double(ctx, *x); });
    if (auto x = l.take("dropout"))
      assign(ctx, "lora.dropout", *x, [&] { c.lora.dropout = as_double(ctx, *x); });
    for (const char* k : {"targets", "target_modules"})
      if (auto x = l.take(k))
        assign(ctx, "lora.targets", *x, [&] { c.lora.targets = read_targets(ctx, *x); });
    for (const char* k : {"rslora", "use_rslora"})
      if (auto x = l.take(k))
        assign(ctx, "lora.rslora", *x, [&] { c.lora.rslora = as_bool(ctx, *x); });
    l.finish();
  }
  if (auto v = r.take("lora_r")) assign(ctx, "lora.r", *v, [&] { c.lora.r = as_int(ctx, *v); });
  if (auto v = r.take("lora_alpha"))
    assign(ctx, "lora.alpha", *v, [&] { c.lora.alpha = as_double(ctx, *v); });
  if (auto v = r.take("lora_dropout"))
    assign(ctx, "lora.dropout", *v, [&] { c.lora.dropout = as_double(ctx, *v); });
  if (auto v = r.take("lora_target_modules"))
    assign(ctx, "lora.targets", *v, [&] { c.lora.targets = read_targets(ctx, *v); });
  for (const char* k : {"peft_use_rslora", "use_rslora"})
    if (auto v = r.take(k)) assign(ctx, "lora.rslora", *v, [&] { c.lora.rslora = as_bool(ctx, *v); });
  // axolotl: lora_target_linear adds every linear layer to whatever lora_target_modules named.
  if (auto v = r.take("lora_target_linear"); v && as_bool(ctx, *v)) c.lora.targets = kLinearTargets;

  // Data.
  std::string default_template;
  if (auto v = r.take("chat_template")) default_template = as_enum(ctx, *v, kTemplates);
  if (auto v = r.take("datasets")) {
    if (!v->value.IsSequence()) type_error(ctx, *v, "a list of datasets");
    for (size_t i = 0; i < v->value.size(); ++i) {
      Item e{fmt::format("datasets.{}", i), v->value[i], v->line, false};
      if (!v->value[i].Mark().is_null()) e.line = v->value[i].Mark().line + 1;
      e.from_override = is_override(ctx, e.path);
      c.datasets.push_back(read_dataset(ctx, e));
    }
  }
  for (auto& d : c.datasets) {
    if (!d.template_name.empty()) continue;
    if (d.format == "alpaca") d.template_name = default_template.empty() ? "alpaca" : default_template;
    if (d.format == "chat") d.template_name = default_template.empty() ? "chatml" : default_template;
  }
  for (const char* k : {"tokenizer", "tokenizer_config"})
    if (auto v = r.take(k)) assign(ctx, "the tokenizer", *v, [&] { c.tokenizer = as_string(ctx, *v); });
  for (const char* k : {"sequence_len", "max_seq_len"})
    if (auto v = r.take(k))
      assign(ctx, "sequence_len", *v, [&] { c.sequence_len = as_int(ctx, *v); });
  for (const char* k : {"packing", "sample_packing"})
    if (auto v = r.take(k)) assign(ctx, "packing", *v, [&] { c.packing = as_bool(ctx, *v); });
  if (auto v = r.take("train_on_inputs")) c.train_on_inputs = as_bool(ctx, *v);

  // Batch and length of the run.
  for (const char* k : {"micro_batch_size", "batch_size"})
    if (auto v = r.take(k))
      assign(ctx, "micro_batch_size", *v, [&] { c.micro_batch_size = as_int(ctx, *v); });
  if (auto v = r.take("gradient_accumulation_steps"))
    c.gradient_accumulation_steps = as_int(ctx, *v);
  if (auto v = r.take("max_steps")) c.max_steps = as_int(ctx, *v);
  for (const char* k : {"num_epochs", "epochs"})
    if (auto v = r.take(k)) assign(ctx, "num_epochs", *v, [&] { c.num_epochs = as_double(ctx, *v); });

  // Optimizer.
  const std::vector<std::string> opt_names = {"adamw", "adamw8bit"};
  const std::map<std::string, std::string> opt_aliases = {
      {"adamw_torch", "adamw"},          {"adamw_torch_fused", "adamw"},
      {"adamw_hf", "adamw"},             {"adamw_8bit", "adamw8bit"},
      {"adamw_bnb_8bit", "adamw8bit"},   {"paged_adamw_8bit", "adamw8bit"}};
  if (auto v = r.take("optimizer")) {
    if (v->value.IsScalar()) {  // axolotl: optimizer: adamw_torch
      assign(ctx, "optimizer.name", *v,
             [&] { c.optimizer.name = as_enum(ctx, *v, opt_names, opt_aliases); });
    } else {
      MapReader o(ctx, need_map(ctx, *v), "optimizer");
      if (auto x = o.take("name"))
        assign(ctx, "optimizer.name", *x,
               [&] { c.optimizer.name = as_enum(ctx, *x, opt_names, opt_aliases); });
      if (auto x = o.take("lr"))
        assign(ctx, "the learning rate", *x, [&] { c.optimizer.lr = as_double(ctx, *x); });
      if (auto x = o.take("betas")) {
        if (!x->value.IsSequence() || x->value.size() != 2)
          type_error(ctx, *x, "a list of two numbers [beta1, beta2]");
        Item b1{x->path + ".0", x->value[0], x->line, x->from_override};
        Item b2{x->path + ".1", x->value[1], x->line, x->from_override};
        assign(ctx, "optimizer.beta1", *x, [&] { c.optimizer.beta1 = as_double(ctx, b1); });
        assign(ctx, "optimizer.beta2", *x, [&] { c.optimizer.beta2 = as_double(ctx, b2); });
      }
      if (auto x = o.take("eps"))
        assign(ctx, "optimizer.eps", *x, [&] { c.optimizer.eps = as_double(ctx, *x); });
      if (auto x = o.take("weight_decay"))
        assign(ctx, "weight_decay", *x, [&] { c.optimizer.weight_decay = as_double(ctx, *x); });
      if (auto x = o.take("no_decay_on_norms_and_biases"))
        c.optimizer.no_decay_on_norms_and_biases = as_bool(ctx, *x);
      if (auto x = o.take("min_8bit_size")) {
        c.optimizer.min_8bit_size = as_int(ctx, *x);
        if (c.optimizer.min_8bit_size < 0)
          bad_input("{}: optimizer.min_8bit_size must be 0 or more, found {}", where(ctx, *x),
                    c.optimizer.min_8bit_size);
      }
      o.finish();
    }
  }
  if (auto v = r.take("learning_rate"))
    assign(ctx, "the learning rate", *v, [&] { c.optimizer.lr = as_double(ctx, *v); });
  if (auto v = r.take("weight_decay"))
    assign(ctx, "weight_decay", *v, [&] { c.optimizer.weight_decay = as_double(ctx, *v); });
  if (auto v = r.take("adam_beta1"))
    assign(ctx, "optimizer.beta1", *v, [&] { c.optimizer.beta1 = as_double(ctx, *v); });
  if (auto v = r.take("adam_beta2"))
    assign(ctx, "optimizer.beta2", *v, [&] { c.optimizer.beta2 = as_double(ctx, *v); });
  if (auto v = r.take("adam_epsilon"))
    assign(ctx, "optimizer.eps", *v, [&] { c.optimizer.eps = as_double(ctx, *v); });

  // Schedule.
  const std::vector<std::string> sched_names = {"constant", "linear", "cosine"};
  const std::map<std::string, std::string> sched_aliases = {{"constant_with_warmup", "constant"}};
  if (auto v = r.take("schedule")) {
    MapReader s(ctx, need_map(ctx, *v), "schedule");
    if (auto x = s.take("name"))
      assign(ctx, "schedule.name", *x,
             [&] { c.schedule.name = as_enum(ctx, *x, sched_names, sched_aliases); });
    if (auto x = s.take("warmup_steps"))
      assign(ctx, "warmup_steps", *x, [&] { c.schedule.warmup_steps = as_int(ctx, *x); });
    if (auto x = s.take("min_lr_ratio"))
      assign(ctx, "min_lr_ratio", *x, [&] { c.schedule.min_lr_ratio = as_double(ctx, *x); });
    s.finish();
  }
  if (auto v = r.take("lr_scheduler"))
    assign(ctx, "schedule.name", *v,
           [&] { c.schedule.name = as_enum(ctx, *v, sched_names, sched_aliases); });
  if (auto v = r.take("warmup_steps"))
    assign(ctx, "warmup_steps", *v, [&] { c.schedule.warmup_steps = as_int(ctx, *v); });
  if (auto v = r.take("cosine_min_lr_ratio"))
    assign(ctx, "min_lr_ratio", *v, [&] { c.schedule.min_lr_ratio = as_double(ctx, *v); });
  if (auto v = r.take("max_grad_norm")) c.max_grad_norm = as_double(ctx, *v);

  // Precision and memory.
  const std::map<std::string, std::string> prec_aliases = {
      {"float32", "fp32"}, {"bfloat16", "bf16"}, {"fp16", "fp16"}};
  if (auto v = r.take("precision"))
    assign(ctx, "precision", *v,
           [&] { c.precision = as_enum(ctx, *v, {"auto", "fp32", "bf16"}, prec_aliases); });
  if (auto v = r.take("dtype"))  // torchtune
    assign(ctx, "precision", *v,
           [&] { c.precision = as_enum(ctx, *v, {"fp32", "bf16"}, prec_aliases); });
  if (auto v = r.take("bf16"))  // axolotl: true | false | auto
    assign(ctx, "precision", *v, [&] {
      if (v->value.IsScalar() && v->value.Scalar() == "auto")
        c.precision = "auto";
      else
        c.precision = as_bool(ctx, *v) ? "bf16" : "fp32";
    });
  if (auto v = r.take("fp16"); v && as_bool(ctx, *v))
    bad_input("{}: fp16 training is not supported; use 'precision: bf16'", where(ctx, *v));
  if (c.precision == "fp16") bad_input("{}: fp16 training is not supported; use bf16", ctx.source);
  if (auto v = r.take("activation_checkpointing"))
    assign(ctx, "activation_checkpointing", *v, [&] {
      bool b;
      if (v->value.IsScalar() && v->value.Tag() != "!" && YAML::convert<bool>::decode(v->value, b))
        c.activation_checkpointing = b ? "full" : "none";
      else
        c.activation_checkpointing = as_enum(ctx, *v, {"none", "full", "selective"});
    });
  if (auto v = r.take("recompute_layers"))
    assign(ctx, "recompute_layers", *v, [&] {
      c.recompute_layers = as_int(ctx, *v);
      if (c.recompute_layers < -1)
        bad_input("{}: recompute_layers must be -1 (every layer) or a layer count, found {}",
                  where(ctx, *v), c.recompute_layers);
    });
  for (const char* k : {"gradient_checkpointing", "enable_activation_checkpointing"})
    if (auto v = r.take(k))
      assign(ctx, "activation_checkpointing", *v,
             [&] { c.activation_checkpointing = as_bool(ctx, *v) ? "full" : "none"; });
  if (auto v = r.take("strategy"))
    c.strategy = as_enum(ctx, *v, {"auto", "ddp", "sharded"}, {{"fsdp", "sharded"}, {"zero3", "sharded"}});
  if (auto v = r.take("dist")) {
    MapReader d(ctx, need_map(ctx, *v), "dist");
    if (auto x = d.take("timeout_s")) c.dist.timeout_s = as_double(ctx, *x);
    if (auto x = d.take("bucket_mb")) c.dist.bucket_mb = as_double(ctx, *x);
    if (auto x = d.take("powersgd_rank")) c.dist.powersgd_rank = as_int(ctx, *x);
    d.finish();
  }
  if (auto v = r.take("device")) {
    c.device = as_string(ctx, *v);
    if (c.device != "auto") try {
        Device::parse(c.device);
      } catch (const InputError&) {
        bad_input("{}: 'device' is '{}', which is not one of auto, cpu, cuda, cuda:N",
                  where(ctx, *v), c.device);
      }
  }
  if (auto v = r.take("max_memory")) {
    std::string s = as_string(ctx, *v);
    c.max_memory = parse_bytes(s, where(ctx, *v) + ": max_memory");
  }

  // Evaluation and saving.
  if (auto v = r.take("eval")) {
    MapReader e(ctx, need_map(ctx, *v), "eval");
    if (auto x = e.take("every"))
      assign(ctx, "eval.every", *x, [&] { c.eval.every = as_int(ctx, *x); });
    if (auto x = e.take("split"))
      assign(ctx, "eval.split", *x, [&] { c.eval.split = as_double(ctx, *x); });
    if (auto x = e.take("batches")) c.eval.batches = as_int(ctx, *x);
    if (auto x = e.take("generate")) c.eval.generate = as_int(ctx, *x);
    e.finish();
  }
  if (auto v = r.take("eval_steps"))
    assign(ctx, "eval.every", *v, [&] { c.eval.every = as_int(ctx, *v); });
  if (auto v = r.take("val_set_size"))
    assign(ctx, "eval.split", *v, [&] { c.eval.split = as_double(ctx, *v); });
  if (auto v = r.take("save")) {
    MapReader s(ctx, need_map(ctx, *v), "save");
    if (auto x = s.take("every"))
      assign(ctx, "save.every", *x, [&] { c.save.every = as_int(ctx, *x); });
    if (auto x = s.take("keep_last"))
      assign(ctx, "save.keep_last", *x, [&] { c.save.keep_last = as_int(ctx, *x); });
    s.finish();
  }
  if (auto v = r.take("save_steps"))
    assign(ctx, "save.every", *v, [&] { c.save.every = as_int(ctx, *v); });
  if (auto v = r.take("save_total_limit"))
    assign(ctx, "save.keep_last", *v, [&] { c.save.keep_last = as_int(ctx, *v); });

  if (auto v = r.take("thermal")) {
    MapReader t(ctx, need_map(ctx, *v), "thermal");
    if (auto x = t.take("pause_above_c")) c.thermal.pause_above_c = as_double(ctx, *x);
    if (auto x = t.take("resume_below_c")) c.thermal.resume_below_c = as_double(ctx, *x);
    t.finish();
  }

  if (auto v = r.take("guard")) {
    MapReader g(ctx, need_map(ctx, *v), "guard");
    if (auto x = g.take("skip_nonfinite")) c.guard.skip_nonfinite = as_bool(ctx, *x);
    if (auto x = g.take("max_skips_in_row")) c.guard.max_skips_in_row = as_int(ctx, *x);
    if (auto x = g.take("rollback_on_spike")) c.guard.rollback_on_spike = as_bool(ctx, *x);
    if (auto x = g.take("spike_window")) c.guard.spike_window = as_int(ctx, *x);
    if (auto x = g.take("spike_warmup")) c.guard.spike_warmup = as_int(ctx, *x);
    if (auto x = g.take("spike_k")) c.guard.spike_k = as_double(ctx, *x);
    if (auto x = g.take("spike_loss_ratio")) c.guard.spike_loss_ratio = as_double(ctx, *x);
    if (auto x = g.take("spike_grad_ratio")) c.guard.spike_grad_ratio = as_double(ctx, *x);
    if (auto x = g.take("max_rollbacks")) c.guard.max_rollbacks = as_int(ctx, *x);
    if (auto x = g.take("replica_check_every")) c.guard.replica_check_every = as_int(ctx, *x);
    if (auto x = g.take("verify_checkpoints")) c.guard.verify_checkpoints = as_bool(ctx, *x);
    g.finish();
  }
  if (auto v = r.take("inject")) {
    // One spec or a list of them; each is checked here so a typo stops the run before it starts.
    std::vector<Item> items;
    if (v->value.IsSequence()) {
      for (size_t i = 0; i < v->value.size(); ++i)
        items.push_back({fmt::format("inject.{}", i), v->value[i], v->line, v->from_override});
    } else {
      items.push_back(*v);
    }
    for (const auto& it : items) {
      std::string spec = as_string(ctx, it);
      check_injection_spec(spec, where(ctx, it) + ": '" + it.path + "'");
      c.inject.push_back(spec);
    }
  }

  // The rest.
  if (auto v = r.take("seed")) {
    int64_t s = as_int(ctx, *v);
    if (s < 0) bad_input("{}: 'seed' must be 0 or more, found {}", where(ctx, *v), s);
    c.seed = uint64_t(s);
  }
  if (auto v = r.take("deterministic")) c.deterministic = as_bool(ctx, *v);
  if (auto v = r.take("output_dir")) c.output_dir = as_string(ctx, *v);
  if (auto v = r.take("resume")) {
    assign(ctx, "resume", *v, [&] {
      bool b;
      if (v->value.IsScalar() && v->value.Tag() != "!" && YAML::convert<bool>::decode(v->value, b))
        c.resume = b ? "auto" : "never";
      else
        c.resume = as_string(ctx, *v);
    });
  }
  if (auto v = r.take("resume_from_checkpoint"))
    assign(ctx, "resume", *v, [&] { c.resume = as_string(ctx, *v); });
  if (auto v = r.take("auto_resume_from_checkpoints"))
    assign(ctx, "resume", *v, [&] { c.resume = as_bool(ctx, *v) ? "auto" : "never"; });
  r.finish();

  if (load_4bit) {
    if (c.method == "lora") c.method = "qlora";
    if (c.method == "full")
      bad_input("{}: 'load_in_4bit' needs 'adapter: qlora' (4-bit base weights cannot be trained "
                "directly)",
                where(ctx, *load_4bit_item));
  }
  return c;
}

}  // namespace

TrainConfig parse_train_config(const std::string& text, const std::string& source,
                               const std::vector<std::string>& overrides) {
  // Every string of a config ends up in config.json and the hash: it must be UTF-8.
  size_t bad = 0;
  if (!utf8_valid(text, &bad)) {
    const size_t line = size_t(std::count(text.begin(), text.begin() + long(bad), '\n')) + 1;
    const size_t bol = text.rfind('\n', bad == 0 ? 0 : bad - 1);
    const size_t col = bad - (bol == std::string::npos || bad == 0 ? 0 : bol + 1) + 1;
    bad_input("{}:{}:{}: not valid UTF-8", source, line, col);
  }
  for (const auto& o : overrides)
    if (!utf8_valid(o)) bad_input("{}: --set '{}': not valid UTF-8", source, o);
  Ctx ctx;
  ctx.source = source;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    bad_input("{}:{}:{}: YAML syntax error: {}", source, e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) bad_input("{}: expected a mapping of keys at the top level", source);
  for (const auto& o : overrides) apply_override(root, o, source, ctx.override_paths);
  TrainConfig c = parse_root(ctx, root);
  c.validate();
  return c;
}

TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_train_config(read_file(path), path, overrides);
}

// ---- validation --------------------------------------------------------------

void TrainConfig::validate() const {
  const std::string& s = source;
  auto need = [&](bool ok, const char* key, const std::string& what, const std::string& value) {
    if (!ok) bad_input("{}: '{}' {}, found {}", s, key, what, value);
  };
  if (init == "pretrained") {
    if (model.empty())
      bad_input("{}: no model: set 'model' to a Hugging Face model folder, or 'init: random' with "
                "'architecture'",
                s);
    if (!architecture_name.empty() || !architecture.is_null())
      bad_input("{}: 'architecture' is only used with 'init: random' (a pretrained model brings "
                "its own config.json)",
                s);
  } else if (model.empty() && architecture_name.empty() && architecture.is_null()) {
    bad_input("{}: 'init: random' needs 'architecture' (a built-in shape such as tiny or "
              "llama3-8b, or an inline config.json mapping) or a 'model' folder to take it from",
              s);
  }
  if (method != "full") {
    need(lora.r > 0, "lora.r", "must be at least 1", std::to_string(lora.r));
    need(lora.alpha > 0, "lora.alpha", "must be more than 0", fmt::format("{}", lora.alpha));
    need(lora.dropout >= 0 && lora.dropout < 1, "lora.dropout", "must be in [0, 1)",
         fmt::format("{}", lora.dropout));
  }
  if (datasets.empty())
    bad_input("{}: no training data: add 'datasets: [{{path: data.jsonl, format: alpaca}}]'", s);
  for (size_t i = 0; i < datasets.size(); ++i) {
    const auto& d = datasets[i];
    if ((d.format == "text" || d.format == "tokens") && !d.template_name.empty())
      bad_input("{}: 'datasets.{}.template' is only used with the alpaca and chat formats", s, i);
  }
  bool needs_tokenizer = std::any_of(datasets.begin(), datasets.end(),
                                     [](const DatasetSettings& d) { return d.format != "tokens"; });
  if (needs_tokenizer && tokenizer.empty() && model.empty())
    bad_input("{}: no tokenizer: set 'tokenizer' (a tokenizer.json or a folder holding one); "
              "without a model folder there is none to take it from",
              s);
  need(sequence_len > 0, "sequence_len", "must be at least 1", std::to_string(sequence_len));
  need(micro_batch_size > 0, "micro_batch_size", "must be at least 1",
       std::to_string(micro_batch_size));
  need(gradient_accumulation_steps > 0, "gradient_accumulation_steps", "must be at least 1",
       std::to_string(gradient_accumulation_steps));
  need(max_steps >= 0, "max_steps", "must be 0 or more", std::to_string(max_steps));
  need(num_epochs >= 0, "num_epochs", "must be 0 or more", fmt::format("{}", num_epochs));
  if (max_steps == 0 && num_epochs <= 0)
    bad_input("{}: the run has no length: set 'max_steps' or 'num_epochs'", s);
  need(optimizer.lr > 0, "optimizer.lr", "(learning_rate) must be more than 0",
       fmt::format("{}", optimizer.lr));
  need(optimizer.beta1 >= 0 && optimizer.beta1 < 1, "optimizer.betas", "beta1 must be in [0, 1)",
       fmt::format("{}", optimizer.beta1));
  need(optimizer.beta2 >= 0 && optimizer.beta2 < 1, "optimizer.betas", "beta2 must be in [0, 1)",
       fmt::format("{}", optimizer.beta2));
  need(optimizer.eps > 0, "optimizer.eps", "must be more than 0", fmt::format("{}", optimizer.eps));
  need(optimizer.weight_decay >= 0, "optimizer.weight_decay", "must be 0 or more",
       fmt::format("{}", optimizer.weight_decay));
  need(schedule.warmup_steps >= 0, "schedule.warmup_steps", "must be 0 or more",
       std::to_string(schedule.warmup_steps));
  if (max_steps > 0 && schedule.warmup_steps >= max_steps)
    bad_input("{}: 'schedule.warmup_steps' ({}) must be less than max_steps ({})", s,
              schedule.warmup_steps, max_steps);
  need(schedule.min_lr_ratio >= 0 && schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio",
       "must be in [0, 1]", fmt::format("{}", schedule.min_lr_ratio));
  need(max_grad_norm >= 0, "max_grad_norm", "must be 0 (off) or more",
       fmt::format("{}", max_grad_norm));
  need(eval.every >= 0, "eval.every", "must be 0 or more", std::to_string(eval.every));
  need(eval.split >= 0 && eval.split < 1, "eval.split",
       "(val_set_size) must be a fraction in [0, 1)", fmt::format("{}", eval.split));
  need(eval.batches >= 0, "eval.batches", "must be 0 or more", std::to_string(eval.batches));
  need(thermal.pause_above_c >= 0, "thermal.pause_above_c", "must be 0 (off) or a temperature",
       std::to_string(thermal.pause_above_c));
  need(thermal.resume_below_c >= 0 && (thermal.pause_above_c == 0 || thermal.resume_below_c < thermal.pause_above_c),
       "thermal.resume_below_c", "must be below thermal.pause_above_c", std::to_string(thermal.resume_below_c));
  need(eval.generate >= 0, "eval.generate", "must be 0 or more", std::to_string(eval.generate));
  if (eval.every > 0 && eval.split == 0)
    bad_input("{}: 'eval.every' is {} but nothing is held out: set 'eval.split' (e.g. 0.05)", s,
              eval.every);
  need(dist.timeout_s > 0, "dist.timeout_s", "must be more than 0 seconds", fmt::format("{}", dist.timeout_s));
  need(dist.bucket_mb > 0, "dist.bucket_mb", "must be more than 0", fmt::format("{}", dist.bucket_mb));
  need(dist.powersgd_rank >= 0 && dist.powersgd_rank <= 64, "dist.powersgd_rank", "must be 0 (off) to 64",
       std::to_string(dist.powersgd_rank));
  if (dist.powersgd_rank > 0 && strategy == "sharded")
    bad_input("{}: 'dist.powersgd_rank' compresses data-parallel gradients; it does not apply to strategy: sharded", s);
  need(save.every >= 0, "save.every", "must be 0 or more", std::to_string(save.every));
  need(save.keep_last >= 0, "save.keep_last", "must be 0 (keep all) or more",
       std::to_string(save.keep_last));
  if (precision == "bf16" && device == "cpu")
    bad_input("{}: 'precision: bf16' needs a CUDA device; the CPU backend computes in fp32", s);
  need(guard.max_skips_in_row >= 1, "guard.max_skips_in_row", "must be at least 1",
       std::to_string(guard.max_skips_in_row));
  need(guard.spike_window >= 3, "guard.spike_window", "must be at least 3 steps",
       std::to_string(guard.spike_window));
  need(guard.spike_warmup >= 3 && guard.spike_warmup <= guard.spike_window, "guard.spike_warmup",
       "must be 3 or more and at most guard.spike_window", std::to_string(guard.spike_warmup));
  need(guard.spike_k > 0, "guard.spike_k", "must be more than 0", fmt::format("{}", guard.spike_k));
  need(guard.spike_loss_ratio >= 1, "guard.spike_loss_ratio", "must be 1 or more",
       fmt::format("{}", guard.spike_loss_ratio));
  need(guard.spike_grad_ratio >= 1, "guard.spike_grad_ratio", "must be 1 or more",
       fmt::format("{}", guard.spike_grad_ratio));
  need(guard.max_rollbacks >= 0, "guard.max_rollbacks", "must be 0 or more",
       std::to_string(guard.max_rollbacks));
  need(guard.replica_check_every >= 0, "guard.replica_check_every", "must be 0 (off) or more",
       std::to_string(guard.replica_check_every));
  for (const auto& spec : inject) check_injection_spec(spec, s + ": 'inject'");
  if (output_dir.empty()) bad_input("{}: 'output_dir' is empty", s);
}

// ---- derived values -------------------------------------------------------------

double LoraSettings::scale() const { return rslora ? alpha / std::sqrt(double(r)) : alpha / double(r); }

double ScheduleSettings::lr_at(int64_t step, int64_t total, double peak) const {
  // Hugging Face's schedules (get_cosine_schedule_with_warmup and friends), with a floor.
  if (step < warmup_steps) return peak * double(step) / double(std::max<int64_t>(1, warmup_steps));
  if (name == "constant") return peak;
  double progress = double(step - warmup_steps) / double(std::max<int64_t>(1, total - warmup_steps));
  progress = std::clamp(progress, 0.0, 1.0);
  double f = name == "linear" ? 1.0 - progress : 0.5 * (1.0 + std::cos(M_PI * progress));
  return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * f);
}

std::string TrainConfig::resolved_precision(bool device_is_cuda) const {
  if (precision != "auto") return precision;
  return device_is_cuda ? "bf16" : "fp32";
}

json TrainConfig::architecture_json() const {
  if (!architecture_name.empty()) return *builtin_architecture(architecture_name);
  return architecture;
}

// ---- output ----------------------------------------------------------------------

json TrainConfig::to_json() const { return json::parse(to_ordered_json().dump()); }

nlohmann::ordered_json TrainConfig::to_ordered_json() const {
  using ojson = nlohmann::ordered_json;
  ojson j;
  j["model"] = model;
  j["init"] = init;
  j["architecture"] = architecture_name.empty() ? ojson(architecture) : ojson(architecture_name);
  j["method"] = method;
  j["lora"] = {{"r", lora.r},
               {"alpha", lora.alpha},
               {"dropout", lora.dropout},
               {"targets", lora.targets},
               {"rslora", lora.rslora}};
  ojson ds = ojson::array();
  for (const auto& d : datasets) {
    ojson e = {{"path", d.path}, {"format", d.format}};
    if (!d.template_name.empty()) e["template"] = d.template_name;
    ds.push_back(e);
  }
  j["datasets"] = ds;
  j["tokenizer"] = tokenizer;
  j["sequence_len"] = sequence_len;
  j["packing"] = packing;
  j["train_on_inputs"] = train_on_inputs;
  j["micro_batch_size"] = micro_batch_size;
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  j["max_steps"] = max_steps;
  j["num_epochs"] = num_epochs;
  j["optimizer"] = {{"name", optimizer.name},
                    {"lr", optimizer.lr},
                    {"betas", {optimizer.beta1, optimizer.beta2}},
                    {"eps", optimizer.eps},
                    {"weight_decay", optimizer.weight_decay},
                    {"no_decay_on_norms_and_biases", optimizer.no_decay_on_norms_and_biases},
                    {"min_8bit_size", optimizer.min_8bit_size}};
  j["schedule"] = {{"name", schedule.name},
                   {"warmup_steps", schedule.warmup_steps},
                   {"min_lr_ratio", schedule.min_lr_ratio}};
  j["max_grad_norm"] = max_grad_norm;
  j["precision"] = precision;
  j["activation_checkpointing"] = activation_checkpointing;
  j["recompute_layers"] = recompute_layers;
  j["strategy"] = strategy;
  j["dist"] = {{"timeout_s", dist.timeout_s}, {"bucket_mb", dist.bucket_mb}, {"powersgd_rank", dist.powersgd_rank}};
  j["eval"] = {{"every", eval.every}, {"split", eval.split}, {"batches", eval.batches}, {"generate", eval.generate}};
  j["save"] = {{"every", save.every}, {"keep_last", save.keep_last}};
  j["thermal"] = {{"pause_above_c", thermal.pause_above_c}, {"resume_below_c", thermal.resume_below_c}};
  j["guard"] = {{"skip_nonfinite", guard.skip_nonfinite},
                {"max_skips_in_row", guard.max_skips_in_row},
                {"rollback_on_spike", guard.rollback_on_spike},
                {"spike_window", guard.spike_window},
                {"spike_warmup", guard.spike_warmup},
                {"spike_k", guard.spike_k},
                {"spike_loss_ratio", guard.spike_loss_ratio},
                {"spike_grad_ratio", guard.spike_grad_ratio},
                {"max_rollbacks", guard.max_rollbacks},
                {"replica_check_every", guard.replica_check_every},
                {"verify_checkpoints", guard.verify_checkpoints}};
  j["inject"] = inject;
  j["seed"] = seed;
  j["deterministic"] = deterministic;
  j["device"] = device;
  j["max_memory"] = max_memory ? ojson(max_memory) : ojson(nullptr);
  j["output_dir"] = output_dir;
  j["resume"] = resume;
  return j;
}

namespace {

// Strings that would read back as another type are quoted; the rest stay plain and readable.
bool reads_as_non_string(const std::string& s) {
  if (s.empty()) return true;
  YAML::Node n = YAML::Load(s);
  if (!n.IsScalar()) return true;
  return !yaml_to_json(n).is_string() || n.Scalar() != s;
}

template <typename J>
void emit(YAML::Emitter& e, const J& j) {
  switch (j.type()) {
    case J::value_t::object:
      e << YAML::BeginMap;
      for (auto it = j.begin(); it != j.end(); ++it) {
        e << YAML::Key << it.key() << YAML::Value;
        emit(e, it.value());
      }
      e << YAML::EndMap;
      break;
    case J::value_t::array: {
      bool flat = std::all_of(j.begin(), j.end(), [](const J& x) { return x.is_primitive(); });
      e << (flat ? YAML::Flow : YAML::Block) << YAML::BeginSeq;
      for (const auto& x : j) emit(e, x);
      e << YAML::EndSeq;
      break;
    }
    case J::value_t::string: {
      const std::string& s = j.template get_ref<const std::string&>();
      bool quote = false;
      try {
        quote = reads_as_non_string(s);
      } catch (const YAML::Exception&) {
        quote = true;
      }
      if (quote) e << YAML::DoubleQuoted;
      e << s;
      break;
    }
    case J::value_t::boolean:
      e << j.template get<bool>();
      break;
    case J::value_t::null:
      e << YAML::Null;
      break;
    default:
      e << j.dump();  // numbers as JSON writes them: shortest text that reads back exactly
  }
}

}  // namespace

std::string TrainConfig::to_yaml() const {
  YAML::Emitter e;
  emit(e, to_ordered_json());
  return std::string(e.c_str()) + "\n";
}

std::string TrainConfig::config_hash() const {
  // Bookkeeping that does not change what is computed stays out, so a resumed run whose folder
  // moved or whose save cadence changed still matches.
  json j = to_json();
  j.erase("output_dir");
  j.erase("resume");
  j.erase("save");
  // How the run guards itself and the faults injected to prove it: a run resumes whatever they
  // are, and a clean run and an injected one are the same computation.
  j.erase("guard");
  j.erase("inject");
  // How ranks talk, not what they compute; compression does change it (and stays out when off,
  // so configs without it keep their hash).
  const int64_t psgd = j["dist"]["powersgd_rank"];
  j.erase("dist");
  if (psgd > 0) j["powersgd_rank"] = psgd;
  std::string s = j.dump();
  return fmt::format("{:016x}", XXH3_64bits(s.data(), s.size()));
}

void save_run_config(const TrainConfig& c, const std::string& run_dir) {
  std::filesystem::create_directories(run_dir);
  std::string head = fmt::format("# resolved by rig from {} (config hash {})\n", c.source, c.config_hash());
  write_file_atomic(run_dir + "/config.yaml", head + c.to_yaml());
  nlohmann::ordered_json j = c.to_ordered_json();
  j["config_hash"] = c.config_hash();
  write_file_atomic(run_dir + "/config.json", j.dump(1) + "\n");
}

// ---- built-in shapes: the model catalogue (rig/model/catalog.h) -----------------

std::vector<std::string> builtin_architecture_names() {
  return catalog_names();
}

std::optional<json> builtin_architecture(const std::string& name) {
  const CatalogModel* m = find_catalog_model(name);
  if (!m) return std::nullopt;
  return m->config;
}

}  // namespace rig
