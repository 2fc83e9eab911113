// A Jinja2 interpreter for Hugging Face chat templates: the language subset that
// `tokenizer_config.json` chat templates use, rendered as transformers' apply_chat_template renders
// them (ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loopcontrols; its tojson,
// raise_exception and strftime_now; the {% generation %} tag of its AssistantTracker).
//
// Values follow Python's semantics where output depends on them: str() and repr() of every type,
// float repr, insertion-ordered dicts, code-point string indexing, Jinja2's default Undefined
// (prints empty, is falsy and iterable, fails on attribute access or arithmetic).
//
// Not supported: template inheritance and includes (extends, block, include, import), recursive
// loops, and a few filters no chat template uses (groupby, batch, slice, truncate, wordwrap,
// urlize, xmlattr, pprint, striptags, filesizeformat, urlencode). They fail at parse time naming
// the tag or filter.
#pragma once
#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "rig/core/error.h"

namespace rig::jinja {

// A template that does not parse, or fails while rendering (an undefined value used, operands
// of the wrong type): the message is "NAME:LINE: what", as Jinja2 reports it where it can.
class TemplateError : public InputError {
 public:
  TemplateError(const std::string& where, int line, const std::string& message);
  const std::string& message() const { return message_; }
  int line() const { return line_; }

 private:
  std::string message_;
  int line_;
};

// The template called raise_exception(message): the conversation is one the template refuses.
class RaisedError : public TemplateError {
 public:
  using TemplateError::TemplateError;
};

class Value;
struct Args;

struct ListData {
  std::vector<Value> items;
  bool tuple = false;  // prints as (a, b) and is not equal to a list
};

// Insertion-ordered, string-keyed (Python dicts keep insertion order; tojson and items() show it).
// `object` names a non-mapping object with attributes (namespace(), loop); empty for a dict.
struct DictData {
  std::vector<std::pair<std::string, Value>> items;
  std::string object;
  const Value* find(std::string_view key) const;
  void set(std::string key, Value v);
};

struct FunctionData {
  std::string name;  // "<Macro 'name'>" style printing and error messages
  std::function<Value(Args&)> call;
  bool macro = false;
};

struct UndefinedData {
  std::string hint;  // the UndefinedError message when it is used
};
struct NoneData {};

class Value {
 public:
  enum class Type { Undefined, None, Bool, Int, Float, String, List, Dict, Function };

  Value() = default;  // undefined
  Value(bool b) : v_(b) {}
  Value(int i) : v_(int64_t(i)) {}
  Value(int64_t i) : v_(i) {}
  Value(double d) : v_(d) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  static Value none() { return Value(NoneData{}); }
  static Value undefined(std::string hint) { return Value(UndefinedData{std::move(hint)}); }
  static Value list(std::vector<Value> items = {}, bool tuple = false);
  static Value dict();  // empty; fill with set()
  static Value object(std::string class_name);
  static Value function(std::string name, std::function<Value(Args&)> fn, bool macro = false);
  static Value from_json(const nlohmann::ordered_json& j);
  static Value from_json(const nlohmann::json& j);

  Type type() const { return Type(v_.index()); }
  bool is_undefined() const { return type() == Type::Undefined; }
  bool is_none() const { return type() == Type::None; }
  bool is_bool() const { return type() == Type::Bool; }
  bool is_int() const { return type() == Type::Int; }
  bool is_float() const { return type() == Type::Float; }
  bool is_number() const { return is_bool() || is_int() || is_float(); }  // Python: bool is an int
  bool is_string() const { return type() == Type::String; }
  bool is_list() const { return type() == Type::List; }  // list or tuple
  bool is_tuple() const { return is_list() && std::get<std::shared_ptr<ListData>>(v_)->tuple; }
  bool is_dict() const { return type() == Type::Dict && dict_data().object.empty(); }
  bool is_object() const { return type() == Type::Dict && !dict_data().object.empty(); }
  bool is_function() const { return type() == Type::Function; }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  double to_double() const;  // bool, int or float
  const std::string& str() const { return std::get<std::string>(v_); }
  const std::vector<Value>& items() const { return list_data().items; }
  const ListData& list_data() const { return *std::get<std::shared_ptr<ListData>>(v_); }
  const DictData& dict_data() const { return *std::get<std::shared_ptr<DictData>>(v_); }
  DictData& dict_data() { return *std::get<std::shared_ptr<DictData>>(v_); }
  const FunctionData& function_data() const { return *std::get<std::shared_ptr<FunctionData>>(v_); }
  const std::string& undefined_hint() const { return std::get<UndefinedData>(v_).hint; }
  const void* identity() const;  // the shared container, for `is sameas` and object equality

  // Dict building (also on objects): adds or replaces a key.
  Value& set(std::string key, Value v);

  bool truthy() const;            // Python bool()
  std::string to_str() const;     // Python str(); undefined prints as ""
  std::string repr() const;       // Python repr()
  std::string type_name() const;  // Python's type name: 'str', 'NoneType', 'dict', ...
  // transformers' tojson: json.dumps(x, ensure_ascii=False, indent, separators, sort_keys).
  std::string to_json(std::optional<std::string> indent = std::nullopt,
                      std::optional<std::pair<std::string, std::string>> separators = std::nullopt,
                      bool sort_keys = false) const;
  nlohmann::ordered_json to_json_value() const;  // throws on undefined and functions

 private:
  explicit Value(NoneData n) : v_(n) {}
  explicit Value(UndefinedData u) : v_(std::move(u)) {}
  std::variant<UndefinedData, NoneData, bool, int64_t, double, std::string,
               std::shared_ptr<ListData>, std::shared_ptr<DictData>, std::shared_ptr<FunctionData>>
      v_;
};

bool operator==(const Value& a, const Value& b);  // Python ==
inline bool operator!=(const Value& a, const Value& b) {
  return !(a == b);
}

// Call arguments: positional, then keywords in call order.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Positional `i`, else keyword `name`, else `def` (marking the keyword used).
  Value get(size_t i, std::string_view name, Value def = Value());
  bool has(size_t i, std::string_view name) const;
};

// Python's repr() of a float ("1.0", "1e-05", "0.30000000000000004").
std::string float_repr(double d);

struct RenderOptions {
  // What strftime_now() sees; the current time when unset. Local time, as Python's datetime.now().
  std::optional<std::time_t> now;
};

// What {% generation %} blocks wrapped: byte ranges [begin, end) of the rendered text.
struct Rendered {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
};

namespace detail {
struct Program;
}

class Template {
 public:
  // Parses `source`; a syntax error throws TemplateError naming `name` and the line.
  explicit Template(std::string_view source, std::string name = "template");
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // Renders with the variables of `context` (a dict). Errors throw TemplateError; a template
  // calling raise_exception throws RaisedError.
  std::string render(const Value& context, const RenderOptions& opt = {}) const;
  Rendered render_tracked(const Value& context, const RenderOptions& opt = {}) const;
  const std::string& name() const;
  // Whether the template uses {% generation %} (transformers' assistant-token tracking).
  bool has_generation_tags() const;

 private:
  std::unique_ptr<detail::Program> prog_;
};

}  // namespace rig::jinja
