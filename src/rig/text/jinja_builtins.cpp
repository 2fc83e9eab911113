// Built-ins of the Jinja2 interpreter: attribute and item access with the sandbox's rules
// (jinja2/sandbox.py: attributes first for `.x`, items first for `[x]`, mutating methods refused),
// the str/dict/list methods templates call, Jinja2's filters and tests (jinja2/filters.py,
// tests.py) and the globals transformers adds (raise_exception, strftime_now).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>

#include "rig/text/jinja_internal.h"

namespace rig::jinja::detail {

namespace {

// Jinja2's object_type_repr, used in its undefined messages.
std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.is_object())
    return v.dict_data().object == "Namespace" ? "jinja2.utils.Namespace object"
                                               : "jinja2.runtime.LoopContext object";
  return v.type_name() + " object";
}

Value no_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("'{}' has no attribute '{}'", object_type_repr(obj), name));
}

Value no_element(const Value& obj, const Value& key) {
  return Value::undefined(fmt::format("{} has no element {}", object_type_repr(obj), key.repr()));
}

Value unsafe(const Value& obj, const std::string& name) {
  return Value::function(name,
                         [msg = fmt::format("access to attribute '{}' of '{}' object is unsafe.",
                                            name, obj.type_name())](Args&) -> Value { fail(msg); });
}

bool int_like(const Value& v) {
  return v.is_bool() || v.is_int();
}
int64_t as_i(const Value& v) {
  return v.is_bool() ? v.as_bool() : v.as_int();
}

int64_t int_arg(const Value& v, const char* what) {
  if (!int_like(v))
    fail(fmt::format("'{}' object cannot be interpreted as an integer ({})", v.type_name(), what));
  return as_i(v);
}

bool bool_arg(Args& a, size_t i, std::string_view name, bool def) {
  Value v = a.get(i, name, Value(def));
  return v.truthy();
}

std::string str_arg(const Value& v, const char* what) {
  if (!v.is_string()) fail(fmt::format("{} must be str, not {}", what, v.type_name()));
  return v.str();
}

Value list_of(std::vector<Value> v) {
  return Value::list(std::move(v));
}
Value tuple_of(Value a, Value b) {
  return Value::list({std::move(a), std::move(b)}, true);
}

std::vector<Value> strings(const std::vector<std::string>& v) {
  return std::vector<Value>(v.begin(), v.end());
}

// Code-point index of byte offset `b` in s.
int64_t cp_index(const std::string& s, size_t b) {
  int64_t n = 0;
  for (size_t i = 0; i < b; ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) ++n;
  return n;
}

// ---- methods ----------------------------------------------------------------------------------

Value bound(const std::string& name, std::function<Value(Args&)> fn) {
  return Value::function(name, std::move(fn));
}

bool starts_or_ends(const std::string& s, const Value& what, bool ends) {
  auto one = [&](const Value& p) {
    const std::string& x = str_arg(p, ends ? "endswith first arg" : "startswith first arg");
    if (x.size() > s.size()) return false;
    return ends ? s.compare(s.size() - x.size(), x.size(), x) == 0 : s.compare(0, x.size(), x) == 0;
  };
  if (what.is_tuple()) return std::any_of(what.items().begin(), what.items().end(), one);
  return one(what);
}

Value string_method(const std::string& s, const std::string& name) {
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return bound(name, [s, name](Args& a) {
      return Value(py_strip(s, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
    });
  if (name == "split" || name == "rsplit")
    return bound(name, [s, name](Args& a) {
      Value m = a.get(1, "maxsplit", Value(-1));
      return list_of(
          strings(py_split(s, a.get(0, "sep"), int_arg(m, "maxsplit"), name == "rsplit")));
    });
  if (name == "splitlines")
    return bound(name, [s](Args& a) {
      return list_of(strings(py_splitlines(s, bool_arg(a, 0, "keepends", false))));
    });
  if (name == "startswith" || name == "endswith")
    return bound(name, [s, name](Args& a) {
      return Value(starts_or_ends(s, a.get(0, "prefix"), name == "endswith"));
    });
  if (name == "upper") return bound(name, [s](Args&) { return Value(py_upper(s)); });
  if (name == "lower") return bound(name, [s](Args&) { return Value(py_lower(s)); });
  if (name == "title") return bound(name, [s](Args&) { return Value(py_title(s)); });
  if (name == "capitalize") return bound(name, [s](Args&) { return Value(py_capitalize(s)); });
  if (name == "replace")
    return bound(name, [s](Args& a) {
      return Value(py_replace(s, str_arg(a.get(0, "old"), "replace() argument 1"),
                              str_arg(a.get(1, "new"), "replace() argument 2"),
                              int_arg(a.get(2, "count", Value(-1)), "count")));
    });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex")
    return bound(name, [s, name](Args& a) {
      std::string sub = str_arg(a.get(0, "sub"), "must be str");
      size_t at = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
      if (at == std::string::npos) {
        if (name.find("index") != std::string::npos) fail("substring not found");
        return Value(-1);
      }
      return Value(cp_index(s, at));
    });
  if (name == "count")
    return bound(name, [s](Args& a) {
      std::string sub = str_arg(a.get(0, "sub"), "must be str");
      if (sub.empty()) return Value(int64_t(to_u32(s).size()) + 1);
      int64_t n = 0;
      for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
      return Value(n);
    });
  if (name == "join")
    return bound(name, [s](Args& a) {
      std::string out;
      size_t i = 0;
      for (const auto& x : iterate(a.get(0, "iterable"))) {
        if (!x.is_string())
          fail(fmt::format("sequence item {}: expected str instance, {} found", i, x.type_name()));
        out += (i++ ? s : "") + x.str();
      }
      return Value(out);
    });
  if (name == "format") return bound(name, [s](Args& a) { return Value(str_format(s, a)); });
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" ||
      name == "isupper" || name == "islower")
    return bound(name, [s, name](Args&) { return Value(py_is(s, name.c_str())); });
  if (name == "center" || name == "ljust" || name == "rjust")
    return bound(name, [s, name](Args& a) {
      int64_t width = int_arg(a.get(0, "width"), "width");
      std::string fill = a.has(1, "fillchar") ? str_arg(a.get(1, "fillchar"), "fillchar") : " ";
      int64_t len = int64_t(to_u32(s).size());
      if (width <= len) return Value(s);
      int64_t marg = width - len, left = name == "ljust"   ? 0
                                         : name == "rjust" ? marg
                                                           : marg / 2 + (marg & width & 1);
      std::string out;
      for (int64_t i = 0; i < left; ++i) out += fill;
      out += s;
      for (int64_t i = left; i < marg; ++i) out += fill;
      return Value(out);
    });
  return Value::undefined("");
}

Value dict_method(const Value& d, const std::string& name) {
  if (name == "items")
    return bound(name, [d](Args&) {
      std::vector<Value> out;
      for (const auto& [k, v] : d.dict_data().items) out.push_back(tuple_of(k, v));
      return list_of(std::move(out));
    });
  if (name == "keys")
    return bound(name, [d](Args&) {
      std::vector<Value> out;
      for (const auto& kv : d.dict_data().items) out.emplace_back(kv.first);
      return list_of(std::move(out));
    });
  if (name == "values")
    return bound(name, [d](Args&) {
      std::vector<Value> out;
      for (const auto& kv : d.dict_data().items) out.push_back(kv.second);
      return list_of(std::move(out));
    });
  if (name == "get")
    return bound(name, [d](Args& a) {
      Value key = a.get(0, "key");
      const Value* v = key.is_string() ? d.dict_data().find(key.str()) : nullptr;
      return v ? *v : a.get(1, "default", Value::none());
    });
  if (name == "copy")
    return bound(name, [d](Args&) {
      Value c = Value::dict();
      c.dict_data().items = d.dict_data().items;
      return c;
    });
  if (name == "pop" || name == "popitem" || name == "setdefault" || name == "update" ||
      name == "clear")
    return unsafe(d, name);
  return Value::undefined("");
}

Value list_method(const Value& l, const std::string& name) {
  if (name == "index")
    return bound(name, [l](Args& a) {
      Value x = a.get(0, "value");
      for (size_t i = 0; i < l.items().size(); ++i)
        if (l.items()[i] == x) return Value(int64_t(i));
      fail(x.repr() + " is not in " + l.type_name());
    });
  if (name == "count")
    return bound(name, [l](Args& a) {
      Value x = a.get(0, "value");
      return Value(int64_t(std::count(l.items().begin(), l.items().end(), x)));
    });
  if (!l.is_tuple() && (name == "append" || name == "extend" || name == "insert" || name == "pop" ||
                        name == "remove" || name == "reverse" || name == "sort" || name == "clear"))
    return unsafe(l, name);
  return Value::undefined("");
}

// The attribute `name` of obj as Python's getattr sees it (methods); undefined when there is none.
Value python_attr(const Value& obj, const std::string& name) {
  if (obj.is_string()) return string_method(obj.str(), name);
  if (obj.is_dict()) return dict_method(obj, name);
  if (obj.is_list()) return list_method(obj, name);
  if (obj.is_object()) {
    const Value* v = obj.dict_data().find(name);
    return v ? *v : Value::undefined("");
  }
  return Value::undefined("");
}

}  // namespace

Value get_attr(const Value& obj, const std::string& name) {
  if (!name.empty() && name[0] == '_')
    return Value::undefined(
        fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, obj.type_name()));
  Value v = python_attr(obj, name);
  if (!v.is_undefined()) return v;
  if (obj.is_dict())
    if (const Value* x = obj.dict_data().find(name)) return *x;
  return no_attribute(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_dict() && key.is_string())
    if (const Value* x = obj.dict_data().find(key.str())) return *x;
  if ((obj.is_list() || obj.is_string()) && int_like(key)) {
    int64_t i = as_i(key);
    if (obj.is_list()) {
      int64_t n = int64_t(obj.items().size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return obj.items()[size_t(i)];
    } else {
      std::u32string u = to_u32(obj.str());
      int64_t n = int64_t(u.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return Value(to_utf8(std::u32string_view(u).substr(size_t(i), 1)));
    }
    return no_element(obj, key);
  }
  if (key.is_string()) {  // a failed lookup by name falls back to the attribute
    if (!key.str().empty() && key.str()[0] == '_')
      return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.",
                                          key.str(), obj.type_name()));
    Value v = python_attr(obj, key.str());
    if (!v.is_undefined()) return v;
    return no_attribute(obj, key.str());
  }
  return no_element(obj, key);
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto idx = [](const Value& v) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    if (!int_like(v)) fail("slice indices must be integers or None or have an __index__ method");
    return as_i(v);
  };
  std::optional<int64_t> a = idx(start_v), b = idx(stop_v), c = idx(step_v);
  int64_t step = c.value_or(1);
  if (step == 0) fail("slice step cannot be zero");
  if (!obj.is_list() && !obj.is_string()) return no_element(obj, Value("slice"));
  std::u32string u = obj.is_string() ? to_u32(obj.str()) : U"";
  const int64_t len = obj.is_string() ? int64_t(u.size()) : int64_t(obj.items().size());
  auto adjust = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += len;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= len) {
      x = step < 0 ? len - 1 : len;
    }
    return x;
  };
  int64_t start = adjust(a, step < 0 ? len - 1 : 0), stop = adjust(b, step < 0 ? -1 : len);
  std::vector<int64_t> picks;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) picks.push_back(i);
  if (obj.is_string()) {
    std::u32string out;
    for (int64_t i : picks) out += u[size_t(i)];
    return Value(to_utf8(out));
  }
  std::vector<Value> out;
  for (int64_t i : picks) out.push_back(obj.items()[size_t(i)]);
  return Value::list(std::move(out), obj.is_tuple());
}

std::vector<Value> iterate(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return {};
    case Value::Type::List:
      return v.items();
    case Value::Type::String: {
      std::vector<Value> out;
      for (char32_t c : to_u32(v.str())) out.emplace_back(to_utf8(std::u32string(1, c)));
      return out;
    }
    case Value::Type::Dict:
      if (v.is_dict()) {
        std::vector<Value> out;
        for (const auto& kv : v.dict_data().items) out.emplace_back(kv.first);
        return out;
      }
      break;
    default:
      break;
  }
  fail(fmt::format("'{}' object is not iterable", v.type_name()));
}

int64_t length(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return 0;
    case Value::Type::String:
      return int64_t(to_u32(v.str()).size());
    case Value::Type::List:
      return int64_t(v.items().size());
    case Value::Type::Dict:
      if (v.is_dict()) return int64_t(v.dict_data().items.size());
      break;
    default:
      break;
  }
  fail(fmt::format("object of type '{}' has no len()", v.type_name()));
}

Value call(const Value& callee, Args& args) {
  if (callee.is_undefined()) fail_undefined(callee);
  if (!callee.is_function()) fail(fmt::format("'{}' object is not callable", callee.type_name()));
  return callee.function_data().call(args);
}

namespace {

// ---- filters ----------------------------------------------------------------------------------

// Jinja2's make_attrgetter: "a.b.0" looked up item-first, integer parts as integers.
Value attr_path(const Value& item, const Value& attribute, const Value& def = Value()) {
  std::vector<Value> parts;
  if (attribute.is_string()) {
    for (const auto& p : py_split(attribute.str(), Value("."), -1, false)) {
      bool digits = !p.empty() &&
                    std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; });
      parts.push_back(digits ? Value(int64_t(std::stoll(p))) : Value(p));
    }
  } else {
    parts.push_back(attribute);
  }
  Value v = item;
  for (const auto& p : parts) {
    if (v.is_undefined()) fail_undefined(v);
    v = get_item(v, p);
    if (!def.is_undefined() && !def.is_none() && v.is_undefined()) v = def;
  }
  return v;
}

// Sort key for sort/dictsort/unique/min/max: strings lowercased unless case-sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  return v.is_string() && !case_sensitive ? Value(py_lower(v.str())) : v;
}

Value run_test(const std::string& name, const Value& v, Args& args) {
  TestFn t = find_test(name);
  if (!t) fail(fmt::format("No test named '{}'.", name));
  return Value(t(v, args));
}

// select/reject/selectattr/rejectattr.
Value select(const Value& seq, Args& a, bool attr, bool keep) {
  size_t first = 0;
  Value attribute;
  if (attr) attribute = a.get(first++, "attribute");
  std::vector<Value> out;
  for (const auto& item : iterate(seq)) {
    Value v = attr ? attr_path(item, attribute) : item;
    bool pass;
    if (a.pos.size() > first) {
      Args targs;
      targs.pos.assign(a.pos.begin() + long(first) + 1, a.pos.end());
      targs.kw = a.kw;
      pass = run_test(str_arg(a.pos[first], "test name"), v, targs).truthy();
    } else {
      pass = v.truthy();
    }
    if (pass == keep) out.push_back(item);
  }
  return list_of(std::move(out));
}

Value f_abs(const Value& v, Args&) {
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  if (int_like(v)) return Value(std::abs(as_i(v)));
  fail(fmt::format("bad operand type for abs(): '{}'", v.type_name()));
}
Value f_attr(const Value& v, Args& a) {
  std::string name = str_arg(a.get(0, "name"), "attribute name");
  if (!name.empty() && name[0] == '_') return Value::undefined("");
  Value x = python_attr(v, name);
  return x.is_undefined() ? no_attribute(v, name) : x;
}
Value f_capitalize(const Value& v, Args&) {
  return Value(py_capitalize(v.to_str()));
}
Value f_center(const Value& v, Args& a) {
  Args m;
  m.pos.push_back(a.get(0, "width", Value(80)));
  return call(string_method(v.to_str(), "center"), m);
}
Value f_length(const Value& v, Args&) {
  return Value(length(v));
}
Value f_default(const Value& v, Args& a) {
  Value def = a.get(0, "default_value", Value(""));
  bool boolean = bool_arg(a, 1, "boolean", false);
  return v.is_undefined() || (boolean && !v.truthy()) ? def : v;
}
Value f_dictsort(const Value& v, Args& a) {
  bool cs = bool_arg(a, 0, "case_sensitive", false);
  std::string by = a.get(1, "by", Value("key")).to_str();
  bool reverse = bool_arg(a, 2, "reverse", false);
  if (!v.is_dict()) fail("You can only sort by either \"key\" or \"value\"");
  if (by != "key" && by != "value") fail("You can only sort by either \"key\" or \"value\"");
  std::vector<Value> items;
  for (const auto& [k, x] : v.dict_data().items) items.push_back(tuple_of(k, x));
  size_t pos = by == "key" ? 0 : 1;
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    int c = compare(sort_key(x.items()[pos], cs), sort_key(y.items()[pos], cs), "<");
    return reverse ? c > 0 : c < 0;
  });
  return list_of(std::move(items));
}
Value f_escape(const Value& v, Args&) {
  std::string out;
  for (char c : v.to_str()) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return Value(out);
}
Value f_first(const Value& v, Args&) {
  auto items = iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}
Value f_last(const Value& v, Args&) {
  auto items = iterate(v);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

std::optional<double> parse_float(std::string s) {
  s = py_strip(s, Value(), true, true);
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return std::nullopt;
  return d;
}

std::optional<int64_t> parse_int(std::string s, int base) {
  s = py_strip(s, Value(), true, true);
  bool neg = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    neg = s[0] == '-';
    s.erase(0, 1);
  }
  if (s.size() > 2 && s[0] == '0') {
    char p = char(s[1] | 0x20);
    if ((p == 'x' && base == 16) || (p == 'o' && base == 8) || (p == 'b' && base == 2))
      s.erase(0, 2);
  }
  if (s.empty() || s[0] == '_' || s.back() == '_' || s.find("__") != std::string::npos)
    return std::nullopt;
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  int64_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9'                     ? c - '0'
            : (c | 0x20) >= 'a' && (c | 0x20) <= 'z' ? (c | 0x20) - 'a' + 10
                                                     : 99;
    if (d >= base) return std::nullopt;
    v = v * base + d;
  }
  return neg ? -v : v;
}

Value f_float(const Value& v, Args& a) {
  Value def = a.get(0, "default", Value(0.0));
  if (v.is_undefined()) fail_undefined(v);  // float(Undefined) raises
  if (v.is_number()) return Value(v.to_double());
  if (v.is_string())
    if (auto d = parse_float(v.str())) return Value(*d);
  return def;
}
Value f_int(const Value& v, Args& a) {
  Value def = a.get(0, "default", Value(0));
  int base = int(int_arg(a.get(1, "base", Value(10)), "base"));
  if (v.is_undefined()) fail_undefined(v);  // int(Undefined) raises
  if (int_like(v)) return Value(as_i(v));
  if (v.is_float())
    return std::isfinite(v.as_float()) ? Value(int64_t(std::trunc(v.as_float()))) : def;
  if (v.is_string()) {
    if (auto i = parse_int(v.str(), base)) return Value(*i);
    if (auto d = parse_float(v.str()); d && std::isfinite(*d))
      return Value(int64_t(std::trunc(*d)));
  }
  return def;
}
Value f_format(const Value& v, Args& a) {
  if (!a.pos.empty() && !a.kw.empty())
    fail("can't handle positional and keyword arguments at the same time");
  if (!a.kw.empty()) {
    Value d = Value::dict();
    for (auto& [k, x] : a.kw) d.set(k, x);
    return Value(percent_format(v.to_str(), d));
  }
  return Value(percent_format(v.to_str(), Value::list(a.pos, true)));
}
Value f_indent(const Value& v, Args& a) {
  Value w = a.get(0, "width", Value(4));
  std::string ind =
      w.is_string() ? w.str() : std::string(size_t(std::max<int64_t>(0, int_arg(w, "width"))), ' ');
  bool first = bool_arg(a, 1, "first", false), blank = bool_arg(a, 2, "blank", false);
  std::string s = v.to_str() + "\n";  // Jinja2's quirk for splitlines
  auto lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
  } else if (!lines.empty()) {
    rv = lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
  }
  if (first) rv = ind + rv;
  return Value(rv);
}
Value f_items(const Value& v, Args&) {
  if (v.is_undefined()) return list_of({});
  if (!v.is_dict()) fail("Can only get item pairs from a mapping.");
  Args none;
  return call(dict_method(v, "items"), none);
}
Value f_join(const Value& v, Args& a) {
  std::string d = a.get(0, "d", Value("")).to_str();
  Value attribute = a.get(1, "attribute", Value::none());
  std::string out;
  size_t i = 0;
  for (const auto& x : iterate(v))
    out += (i++ ? d : "") + (attribute.is_none() ? x : attr_path(x, attribute)).to_str();
  return Value(out);
}
Value f_list(const Value& v, Args&) {
  return list_of(iterate(v));
}
Value f_lower(const Value& v, Args&) {
  return Value(py_lower(v.to_str()));
}
Value f_upper(const Value& v, Args&) {
  return Value(py_upper(v.to_str()));
}
Value f_map(const Value& v, Args& a) {
  std::vector<Value> out;
  if (a.pos.empty()) {
    Value attribute, def;
    for (auto& [k, x] : a.kw) {
      if (k == "attribute")
        attribute = x;
      else if (k == "default")
        def = x;
      else
        fail(fmt::format("Unexpected keyword argument '{}'", k));
    }
    if (attribute.is_undefined()) fail("map requires a filter argument");
    for (const auto& item : iterate(v)) out.push_back(attr_path(item, attribute, def));
    return list_of(std::move(out));
  }
  std::string name = str_arg(a.pos[0], "filter name");
  FilterFn f = find_filter(name);
  if (!f) fail(fmt::format("No filter named '{}'.", name));
  for (const auto& item : iterate(v)) {
    Args fa;
    fa.pos.assign(a.pos.begin() + 1, a.pos.end());
    fa.kw = a.kw;
    out.push_back(f(item, fa));
  }
  return list_of(std::move(out));
}
Value min_max(const Value& v, Args& a, bool want_max) {
  bool cs = bool_arg(a, 0, "case_sensitive", false);
  Value attribute = a.get(1, "attribute", Value::none());
  auto items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& x) {
    return sort_key(attribute.is_none() ? x : attr_path(x, attribute), cs);
  };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    int c = compare(key(items[i]), key(items[best]), want_max ? ">" : "<");
    if (want_max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}
Value f_max(const Value& v, Args& a) {
  return min_max(v, a, true);
}
Value f_min(const Value& v, Args& a) {
  return min_max(v, a, false);
}
Value f_reject(const Value& v, Args& a) {
  return select(v, a, false, false);
}
Value f_rejectattr(const Value& v, Args& a) {
  return select(v, a, true, false);
}
Value f_select(const Value& v, Args& a) {
  return select(v, a, false, true);
}
Value f_selectattr(const Value& v, Args& a) {
  return select(v, a, true, true);
}
Value f_replace(const Value& v, Args& a) {
  Value count = a.get(2, "count", Value::none());
  return Value(py_replace(v.to_str(), a.get(0, "old").to_str(), a.get(1, "new").to_str(),
                          count.is_none() ? -1 : int_arg(count, "count")));
}
Value f_reverse(const Value& v, Args&) {
  if (v.is_string()) {
    std::u32string u = to_u32(v.str());
    std::reverse(u.begin(), u.end());
    return Value(to_utf8(u));
  }
  auto items = iterate(v);
  std::reverse(items.begin(), items.end());
  return list_of(std::move(items));
}
Value f_round(const Value& v, Args& a) {
  int64_t precision = int_arg(a.get(0, "precision", Value(0)), "precision");
  std::string method = a.get(1, "method", Value("common")).to_str();
  if (method != "common" && method != "ceil" && method != "floor")
    fail("method must be common, ceil or floor");
  if (!v.is_number()) fail(fmt::format("type {} doesn't define __round__ method", v.type_name()));
  if (method == "common") {
    if (int_like(v)) return Value(as_i(v));  // round(int, n) stays an int
    // Python rounds the exact binary value half-to-even, as printf does.
    char buf[512];
    snprintf(buf, sizeof buf, "%.*f", int(std::clamp<int64_t>(precision, 0, 300)), v.as_float());
    double r = std::strtod(buf, nullptr);
    if (precision < 0) {
      double p = std::pow(10.0, double(-precision));
      r = std::nearbyint(v.as_float() / p) * p;
    }
    return Value(r);
  }
  double p = std::pow(10.0, double(precision)), x = v.to_double() * p;
  return Value((method == "ceil" ? std::ceil(x) : std::floor(x)) / p);
}
Value f_safe(const Value& v, Args&) {
  return Value(v.to_str());
}
Value f_sort(const Value& v, Args& a) {
  bool reverse = bool_arg(a, 0, "reverse", false), cs = bool_arg(a, 1, "case_sensitive", false);
  Value attribute = a.get(2, "attribute", Value::none());
  auto items = iterate(v);
  std::vector<Value> attrs;
  if (!attribute.is_none()) attrs = strings(py_split(attribute.to_str(), Value(","), -1, false));
  auto key = [&](const Value& x) {
    if (attrs.empty()) return sort_key(x, cs);
    std::vector<Value> ks;
    for (const auto& at : attrs)
      ks.push_back(sort_key(attr_path(x, Value(py_strip(at.str(), Value(), true, true))), cs));
    return ks.size() == 1 ? ks[0] : Value::list(std::move(ks));
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    int c = compare(key(x), key(y), "<");
    return reverse ? c > 0 : c < 0;
  });
  return list_of(std::move(items));
}
Value f_string(const Value& v, Args&) {
  return Value(v.to_str());
}
Value f_sum(const Value& v, Args& a) {
  Value attribute = a.get(0, "attribute", Value::none());
  Value total = a.get(1, "start", Value(0));
  for (const auto& x : iterate(v))
    total = binary("+", total, attribute.is_none() ? x : attr_path(x, attribute));
  return total;
}
Value f_title(const Value& v, Args&) {
  // Jinja2's title filter: each run after [-\s({\[<] starts upper-cased, the rest lower-cased.
  std::u32string u = to_u32(v.to_str());
  std::string out;
  bool word_start = true;
  for (char32_t c : u) {
    bool sep = c == '-' || py_isspace(c) || c == '(' || c == '{' || c == '[' || c == '<';
    std::string one = to_utf8(std::u32string(1, c));
    out += sep ? one : word_start ? py_upper(one) : py_lower(one);
    word_start = sep;
  }
  return Value(out);
}
Value f_tojson(const Value& v, Args& a) {
  // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
  bool ascii = bool_arg(a, 0, "ensure_ascii", false);
  Value ind = a.get(1, "indent", Value::none()), seps = a.get(2, "separators", Value::none());
  bool sort_keys = bool_arg(a, 3, "sort_keys", false);
  std::optional<std::string> indent;
  if (ind.is_string())
    indent = ind.str();
  else if (!ind.is_none())
    indent = std::string(size_t(std::max<int64_t>(0, int_arg(ind, "indent"))), ' ');
  std::optional<std::pair<std::string, std::string>> separators;
  if (!seps.is_none()) {
    if (!seps.is_list() || seps.items().size() != 2) fail("separators must be a pair of strings");
    separators = std::make_pair(seps.items()[0].to_str(), seps.items()[1].to_str());
  }
  std::string s = v.to_json(indent, separators, sort_keys);
  if (!ascii) return Value(s);
  std::string out;
  for (char32_t c : to_u32(s)) {
    if (c < 0x80) {
      out += char(c);
    } else if (c < 0x10000) {
      out += fmt::format("\\u{:04x}", unsigned(c));
    } else {
      char32_t x = c - 0x10000;
      out += fmt::format("\\u{:04x}\\u{:04x}", unsigned(0xD800 + (x >> 10)),
                         unsigned(0xDC00 + (x & 0x3FF)));
    }
  }
  return Value(out);
}
Value f_trim(const Value& v, Args& a) {
  return Value(py_strip(v.to_str(), a.get(0, "chars"), true, true));
}
Value f_unique(const Value& v, Args& a) {
  bool cs = bool_arg(a, 0, "case_sensitive", false);
  Value attribute = a.get(1, "attribute", Value::none());
  std::vector<Value> out, seen;
  for (const auto& x : iterate(v)) {
    Value k = sort_key(attribute.is_none() ? x : attr_path(x, attribute), cs);
    if (std::find(seen.begin(), seen.end(), k) != seen.end()) continue;
    seen.push_back(k);
    out.push_back(x);
  }
  return list_of(std::move(out));
}
Value f_wordcount(const Value& v, Args&) {
  int64_t n = 0;
  bool in_word = false;
  for (char32_t c : to_u32(v.to_str())) {
    std::string one = to_utf8(std::u32string(1, c));
    bool w = c == '_' || py_is(one, "isalnum");
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value(n);
}

const std::map<std::string_view, FilterFn>& filters() {
  static const std::map<std::string_view, FilterFn> m = {
      {"abs", f_abs},
      {"attr", f_attr},
      {"capitalize", f_capitalize},
      {"center", f_center},
      {"count", f_length},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"e", f_escape},
      {"escape", f_escape},
      {"first", f_first},
      {"float", f_float},
      {"forceescape", f_escape},
      {"format", f_format},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"selectattr", f_selectattr},
      {"sort", f_sort},
      {"string", f_string},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"unique", f_unique},
      {"upper", f_upper},
      {"wordcount", f_wordcount},
  };
  return m;
}

// ---- tests ------------------------------------------------------------------------------------

bool t_defined(const Value& v, Args&) {
  return !v.is_undefined();
}
bool t_undefined(const Value& v, Args&) {
  return v.is_undefined();
}
bool t_none(const Value& v, Args&) {
  return v.is_none();
}
bool t_boolean(const Value& v, Args&) {
  return v.is_bool();
}
bool t_true(const Value& v, Args&) {
  return v.is_bool() && v.as_bool();
}
bool t_false(const Value& v, Args&) {
  return v.is_bool() && !v.as_bool();
}
bool t_integer(const Value& v, Args&) {
  return v.is_int();
}
bool t_float(const Value& v, Args&) {
  return v.is_float();
}
bool t_number(const Value& v, Args&) {
  return v.is_number();
}
bool t_string(const Value& v, Args&) {
  return v.is_string();
}
bool t_mapping(const Value& v, Args&) {
  return v.is_dict();
}
bool t_iterable(const Value& v, Args&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
bool t_callable(const Value& v, Args&) {
  return v.is_undefined() || v.is_function();
}
bool t_odd(const Value& v, Args&) {
  return binary("%", v, Value(2)) == Value(1);
}
bool t_even(const Value& v, Args&) {
  return binary("%", v, Value(2)) == Value(0);
}
bool t_divisibleby(const Value& v, Args& a) {
  return binary("%", v, a.get(0, "num")) == Value(0);
}
bool t_eq(const Value& v, Args& a) {
  return v == a.get(0, "other");
}
bool t_ne(const Value& v, Args& a) {
  return v != a.get(0, "other");
}
bool t_lt(const Value& v, Args& a) {
  return compare(v, a.get(0, "other"), "<") < 0;
}
bool t_le(const Value& v, Args& a) {
  return compare(v, a.get(0, "other"), "<=") <= 0;
}
bool t_gt(const Value& v, Args& a) {
  return compare(v, a.get(0, "other"), ">") > 0;
}
bool t_ge(const Value& v, Args& a) {
  return compare(v, a.get(0, "other"), ">=") >= 0;
}
bool t_in(const Value& v, Args& a) {
  return contains(a.get(0, "seq"), v);
}
bool t_lower(const Value& v, Args&) {
  return py_is(v.to_str(), "islower");
}
bool t_upper(const Value& v, Args&) {
  return py_is(v.to_str(), "isupper");
}
bool t_escaped(const Value&, Args&) {
  return false;
}
bool t_filter(const Value& v, Args&) {
  return v.is_string() && find_filter(v.str()) != nullptr;
}
bool t_test(const Value& v, Args&) {
  return v.is_string() && find_test(v.str()) != nullptr;
}
bool t_sameas(const Value& v, Args& a) {
  Value o = a.get(0, "other");
  if (v.type() != o.type()) return false;
  if (v.identity()) return v.identity() == o.identity();
  return v ==
         o;  // None, booleans, numbers and strings: Python's small-object identity, near enough
}

const std::map<std::string_view, TestFn>& tests() {
  static const std::map<std::string_view, TestFn> m = {
      {"defined", t_defined},
      {"undefined", t_undefined},
      {"none", t_none},
      {"boolean", t_boolean},
      {"true", t_true},
      {"false", t_false},
      {"integer", t_integer},
      {"float", t_float},
      {"number", t_number},
      {"string", t_string},
      {"mapping", t_mapping},
      {"iterable", t_iterable},
      {"sequence", t_iterable},
      {"callable", t_callable},
      {"odd", t_odd},
      {"even", t_even},
      {"divisibleby", t_divisibleby},
      {"eq", t_eq},
      {"equalto", t_eq},
      {"==", t_eq},
      {"ne", t_ne},
      {"!=", t_ne},
      {"lt", t_lt},
      {"lessthan", t_lt},
      {"<", t_lt},
      {"le", t_le},
      {"<=", t_le},
      {"gt", t_gt},
      {"greaterthan", t_gt},
      {">", t_gt},
      {"ge", t_ge},
      {">=", t_ge},
      {"in", t_in},
      {"lower", t_lower},
      {"upper", t_upper},
      {"escaped", t_escaped},
      {"filter", t_filter},
      {"test", t_test},
      {"sameas", t_sameas},
  };
  return m;
}

// ---- globals ----------------------------------------------------------------------------------

Value g_range(Args& a) {
  if (a.pos.empty() || a.pos.size() > 3)
    fail(fmt::format("range expected at most 3 arguments, got {}", a.pos.size()));
  int64_t start = 0, stop, step = 1;
  if (a.pos.size() == 1) {
    stop = int_arg(a.pos[0], "range");
  } else {
    start = int_arg(a.pos[0], "range");
    stop = int_arg(a.pos[1], "range");
    if (a.pos.size() == 3) step = int_arg(a.pos[2], "range");
  }
  if (step == 0) fail("range() arg 3 must not be zero");
  int64_t n = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                       : (start > stop ? (start - stop - step - 1) / -step : 0);
  if (n > 100000) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  std::vector<Value> out;
  for (int64_t i = 0; i < n; ++i) out.emplace_back(start + i * step);
  return list_of(std::move(out));
}

// dict(mapping_or_pairs, **kwargs) into `d`.
void fill_dict(Value& d, Args& a) {
  if (a.pos.size() > 1) fail(fmt::format("dict expected at most 1 argument, got {}", a.pos.size()));
  if (!a.pos.empty()) {
    const Value& src = a.pos[0];
    if (src.is_dict()) {
      for (const auto& kv : src.dict_data().items) d.set(kv.first, kv.second);
    } else {
      for (const auto& pair : iterate(src)) {
        auto kv = iterate(pair);
        if (kv.size() != 2) fail("dictionary update sequence element has wrong length");
        d.set(str_arg(kv[0], "dict key"), kv[1]);
      }
    }
  }
  for (auto& [k, v] : a.kw) d.set(k, v);
}

}  // namespace

FilterFn find_filter(std::string_view name) {
  auto it = filters().find(name);
  return it == filters().end() ? nullptr : it->second;
}

TestFn find_test(std::string_view name) {
  auto it = tests().find(name);
  return it == tests().end() ? nullptr : it->second;
}

void add_globals(Value& g, const RenderOptions& opt) {
  g.set("range", Value::function("range", g_range));
  g.set("dict", Value::function("dict", [](Args& a) {
          Value d = Value::dict();
          fill_dict(d, a);
          return d;
        }));
  g.set("namespace", Value::function("namespace", [](Args& a) {
          Value ns = Value::object("Namespace");
          fill_dict(ns, a);
          return ns;
        }));
  g.set("raise_exception", Value::function("raise_exception", [](Args& a) -> Value {
          throw Failure{a.get(0, "message").to_str(), true};
        }));
  g.set("strftime_now", Value::function("strftime_now", [now = opt.now](Args& a) {
          std::string f = str_arg(a.get(0, "format"), "strftime() argument 1");
          std::time_t t = now ? *now : std::time(nullptr);
          std::tm tm{};
          localtime_r(&t, &tm);
          if (f.empty()) return Value("");
          for (size_t cap = 256; cap <= (1u << 20); cap *= 4) {
            std::string buf(cap, '\0');
            size_t n = std::strftime(buf.data(), cap, f.c_str(), &tm);
            if (n > 0) return Value(buf.substr(0, n));
          }
          return Value("");
        }));
}

}  // namespace rig::jinja::detail
