// Values of the Jinja2 interpreter with Python's semantics: str/repr, tojson, ==, ordering,
// `in`, arithmetic, % formatting, and the str methods templates call (on code points).
#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

#include "rig/text/jinja_internal.h"

namespace rig::jinja {

using detail::fail;

TemplateError::TemplateError(const std::string& where, int line, const std::string& message)
    : InputError(line > 0 ? fmt::format("{}:{}: {}", where, line, message)
                          : fmt::format("{}: {}", where, message)),
      message_(message),
      line_(line) {}

const Value* DictData::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void DictData::set(std::string key, Value v) {
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(std::move(key), std::move(v));
}

Value Value::list(std::vector<Value> items, bool tuple) {
  Value v;
  v.v_ = std::make_shared<ListData>(ListData{std::move(items), tuple});
  return v;
}

Value Value::dict() {
  Value v;
  v.v_ = std::make_shared<DictData>();
  return v;
}

Value Value::object(std::string class_name) {
  Value v = dict();
  v.dict_data().object = std::move(class_name);
  return v;
}

Value Value::function(std::string name, std::function<Value(Args&)> fn, bool macro) {
  Value v;
  v.v_ = std::make_shared<FunctionData>(FunctionData{std::move(name), std::move(fn), macro});
  return v;
}

namespace {
template <typename J>
Value from_json_impl(const J& j) {
  using T = nlohmann::detail::value_t;
  switch (j.type()) {
    case T::boolean:
      return Value(j.template get<bool>());
    case T::number_integer:
      return Value(j.template get<int64_t>());
    case T::number_unsigned: {
      auto u = j.template get<uint64_t>();
      return u <= uint64_t(INT64_MAX) ? Value(int64_t(u)) : Value(double(u));
    }
    case T::number_float:
      return Value(j.template get<double>());
    case T::string:
      return Value(j.template get<std::string>());
    case T::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(from_json_impl(x));
      return Value::list(std::move(items));
    }
    case T::object: {
      Value d = Value::dict();
      for (auto it = j.begin(); it != j.end(); ++it)
        d.dict_data().items.emplace_back(it.key(), from_json_impl(it.value()));
      return d;
    }
    default:
      return Value::none();
  }
}
}  // namespace

Value Value::from_json(const nlohmann::ordered_json& j) {
  return from_json_impl(j);
}
Value Value::from_json(const nlohmann::json& j) {
  return from_json_impl(j);
}

double Value::to_double() const {
  if (is_bool()) return as_bool() ? 1 : 0;
  if (is_int()) return double(as_int());
  return as_float();
}

const void* Value::identity() const {
  switch (type()) {
    case Type::List:
      return std::get<std::shared_ptr<ListData>>(v_).get();
    case Type::Dict:
      return std::get<std::shared_ptr<DictData>>(v_).get();
    case Type::Function:
      return std::get<std::shared_ptr<FunctionData>>(v_).get();
    default:
      return nullptr;
  }
}

Value& Value::set(std::string key, Value v) {
  dict_data().set(std::move(key), std::move(v));
  return *this;
}

bool Value::truthy() const {
  switch (type()) {
    case Type::Undefined:
    case Type::None:
      return false;
    case Type::Bool:
      return as_bool();
    case Type::Int:
      return as_int() != 0;
    case Type::Float:
      return as_float() != 0;
    case Type::String:
      return !str().empty();
    case Type::List:
      return !items().empty();
    case Type::Dict:
      return is_object() || !dict_data().items.empty();
    case Type::Function:
      return true;
  }
  return false;
}

std::string Value::type_name() const {
  switch (type()) {
    case Type::Undefined:
      return "Undefined";
    case Type::None:
      return "NoneType";
    case Type::Bool:
      return "bool";
    case Type::Int:
      return "int";
    case Type::Float:
      return "float";
    case Type::String:
      return "str";
    case Type::List:
      return is_tuple() ? "tuple" : "list";
    case Type::Dict:
      return is_object() ? dict_data().object : "dict";
    case Type::Function:
      return function_data().macro ? "Macro" : "builtin_function_or_method";
  }
  return "object";
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string s(buf, r.ptr);
  std::string out;
  size_t i = 0;
  if (s[0] == '-') {
    out = "-";
    i = 1;
  }
  size_t e = s.find('e');
  std::string digits;
  for (size_t k = i; k < e; ++k)
    if (s[k] != '.') digits += s[k];
  int exp = std::stoi(s.substr(e + 1));
  // Python's repr: positional notation for exponents -4..15, scientific otherwise.
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      std::string ip = digits.substr(0, std::min<size_t>(digits.size(), exp + 1));
      while (ip.size() < size_t(exp + 1)) ip += '0';
      std::string fp = digits.size() > size_t(exp + 1) ? digits.substr(exp + 1) : "0";
      out += ip + "." + fp;
    } else {
      out += "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  }
  return out;
}

std::string Value::to_str() const {
  switch (type()) {
    case Type::Undefined:
      return "";
    case Type::None:
      return "None";
    case Type::Bool:
      return as_bool() ? "True" : "False";
    case Type::Int:
      return std::to_string(as_int());
    case Type::Float:
      return float_repr(as_float());
    case Type::String:
      return str();
    case Type::List:
      return repr();
    case Type::Dict: {
      if (!is_object()) return repr();
      const auto& d = dict_data();
      if (d.object == "LoopContext") {
        const Value *i = d.find("index"), *n = d.find("length");
        return fmt::format("<LoopContext {}/{}>", i ? i->to_str() : "?", n ? n->to_str() : "?");
      }
      std::string inner = "{";
      for (size_t k = 0; k < d.items.size(); ++k)
        inner += (k ? ", " : "") + detail::py_repr_str(d.items[k].first) + ": " +
                 d.items[k].second.repr();
      return "<" + d.object + " " + inner + "}>";
    }
    case Type::Function:
      return function_data().macro ? "<Macro '" + function_data().name + "'>"
                                   : "<built-in function " + function_data().name + ">";
  }
  return "";
}

std::string Value::repr() const {
  switch (type()) {
    case Type::Undefined:
      return "Undefined";
    case Type::String:
      return detail::py_repr_str(str());
    case Type::List: {
      const auto& l = list_data();
      std::string s = l.tuple ? "(" : "[";
      for (size_t i = 0; i < l.items.size(); ++i) s += (i ? ", " : "") + l.items[i].repr();
      if (l.tuple && l.items.size() == 1) s += ",";
      return s + (l.tuple ? ")" : "]");
    }
    case Type::Dict: {
      if (is_object()) return to_str();
      std::string s = "{";
      const auto& items = dict_data().items;
      for (size_t i = 0; i < items.size(); ++i)
        s += (i ? ", " : "") + detail::py_repr_str(items[i].first) + ": " + items[i].second.repr();
      return s + "}";
    }
    default:
      return to_str();
  }
}

namespace {

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += char(c);
    }
  }
  out += '"';
}

struct JsonStyle {
  std::optional<std::string> indent;
  std::string item_sep, key_sep;
  bool sort_keys;
};

void json_write(const Value& v, std::string& out, const JsonStyle& st, int depth) {
  auto newline = [&](int d) {
    out += '\n';
    for (int i = 0; i < d; ++i) out += *st.indent;
  };
  switch (v.type()) {
    case Value::Type::None:
      out += "null";
      return;
    case Value::Type::Bool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Type::Int:
      out += std::to_string(v.as_int());
      return;
    case Value::Type::Float: {
      double d = v.as_float();
      out += std::isnan(d)   ? "NaN"
             : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity")
                             : float_repr(d);
      return;
    }
    case Value::Type::String:
      json_string(out, v.str());
      return;
    case Value::Type::List: {
      const auto& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += st.item_sep;
        if (st.indent) newline(depth + 1);
        json_write(items[i], out, st, depth + 1);
      }
      if (st.indent) newline(depth);
      out += ']';
      return;
    }
    case Value::Type::Dict: {
      if (v.is_object()) break;
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict_data().items) items.push_back(&kv);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      if (items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += st.item_sep;
        if (st.indent) newline(depth + 1);
        json_string(out, items[i]->first);
        out += st.key_sep;
        json_write(items[i]->second, out, st, depth + 1);
      }
      if (st.indent) newline(depth);
      out += '}';
      return;
    }
    default:
      break;
  }
  fail("Object of type " + v.type_name() + " is not JSON serializable");
}

}  // namespace

std::string Value::to_json(std::optional<std::string> indent,
                           std::optional<std::pair<std::string, std::string>> separators,
                           bool sort_keys) const {
  JsonStyle st{std::move(indent), ", ", ": ", sort_keys};
  if (st.indent) st.item_sep = ",";
  if (separators) {
    st.item_sep = separators->first;
    st.key_sep = separators->second;
  }
  std::string out;
  json_write(*this, out, st, 0);
  return out;
}

nlohmann::ordered_json Value::to_json_value() const {
  switch (type()) {
    case Type::None:
      return nullptr;
    case Type::Bool:
      return as_bool();
    case Type::Int:
      return as_int();
    case Type::Float:
      return as_float();
    case Type::String:
      return str();
    case Type::List: {
      auto a = nlohmann::ordered_json::array();
      for (const auto& x : items()) a.push_back(x.to_json_value());
      return a;
    }
    case Type::Dict:
      if (!is_object()) {
        auto o = nlohmann::ordered_json::object();
        for (const auto& [k, x] : dict_data().items) o[k] = x.to_json_value();
        return o;
      }
      break;
    default:
      break;
  }
  fail("Object of type " + type_name() + " is not JSON serializable");
}

bool operator==(const Value& a, const Value& b) {
  using T = Value::Type;
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.to_double() == b.to_double();
    auto iv = [](const Value& v) { return v.is_bool() ? int64_t(v.as_bool()) : v.as_int(); };
    return iv(a) == iv(b);
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case T::Undefined:
    case T::None:
      return true;
    case T::String:
      return a.str() == b.str();
    case T::List: {
      if (a.is_tuple() != b.is_tuple() || a.items().size() != b.items().size()) return false;
      for (size_t i = 0; i < a.items().size(); ++i)
        if (a.items()[i] != b.items()[i]) return false;
      return true;
    }
    case T::Dict: {
      if (a.is_object() || b.is_object()) return a.identity() == b.identity();
      const auto &x = a.dict_data(), &y = b.dict_data();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* w = y.find(k);
        if (!w || *w != v) return false;
      }
      return true;
    }
    case T::Function:
      return a.identity() == b.identity();
    default:
      return false;
  }
}

Value Args::get(size_t i, std::string_view name, Value def) {
  if (i < pos.size()) return pos[i];
  for (const auto& [k, v] : kw)
    if (k == name) return v;
  return def;
}

bool Args::has(size_t i, std::string_view name) const {
  if (i < pos.size()) return true;
  for (const auto& kv : kw)
    if (kv.first == name) return true;
  return false;
}

namespace detail {

void fail(std::string message) {
  throw Failure{std::move(message)};
}

void fail_undefined(const Value& v) {
  fail(v.undefined_hint());
}

int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (!a.is_float() && !b.is_float()) {
      int64_t x = a.is_bool() ? a.as_bool() : a.as_int(),
              y = b.is_bool() ? b.as_bool() : b.as_int();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    double x = a.to_double(), y = b.to_double();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string())
    return a.str().compare(b.str()) < 0 ? -1 : a.str() == b.str() ? 0 : 1;
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
    const auto &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (x[i] != y[i]) return compare(x[i], y[i], op);
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  fail(fmt::format("'{}' not supported between instances of '{}' and '{}'", op, a.type_name(),
                   b.type_name()));
}

bool contains(const Value& c, const Value& item) {
  switch (c.type()) {
    case Value::Type::Undefined:
      return false;
    case Value::Type::String:
      if (!item.is_string())
        fail("'in <string>' requires string as left operand, not " + item.type_name());
      return c.str().find(item.str()) != std::string::npos;
    case Value::Type::List:
      for (const auto& x : c.items())
        if (x == item) return true;
      return false;
    case Value::Type::Dict:
      if (c.is_dict()) return item.is_string() && c.dict_data().find(item.str()) != nullptr;
      break;
    default:
      break;
  }
  fail("argument of type '" + c.type_name() + "' is not iterable");
}

namespace {

int64_t as_i(const Value& v) {
  return v.is_bool() ? v.as_bool() : v.as_int();
}
bool int_like(const Value& v) {
  return v.is_bool() || v.is_int();
}

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b) {
  fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(),
                   b.type_name()));
}

// CPython's float divmod, so -7.5 // 2 and -7.5 % 2 match.
std::pair<double, double> float_divmod(double x, double y) {
  double mod = std::fmod(x, y);
  double div = (x - mod) / y;
  if (mod != 0) {
    if ((y < 0) != (mod < 0)) {
      mod += y;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, y);
  }
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, x / y);
  }
  return {floordiv, mod};
}

Value repeat(const Value& seq, int64_t n) {
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.str();
    return out;
  }
  std::vector<Value> out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return Value::list(std::move(out), seq.is_tuple());
}

}  // namespace

Value binary(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  const bool nums = a.is_number() && b.is_number(), ints = int_like(a) && int_like(b);
  if (op == "+") {
    if (nums) return ints ? Value(as_i(a) + as_i(b)) : Value(a.to_double() + b.to_double());
    if (a.is_string() && b.is_string()) return a.str() + b.str();
    if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
      std::vector<Value> out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return Value::list(std::move(out), a.is_tuple());
    }
    if (a.is_string() || a.is_list())
      fail(fmt::format("can only concatenate {} (not \"{}\") to {}", a.type_name(), b.type_name(),
                       a.type_name()));
    unsupported(op, a, b);
  }
  if (op == "-") {
    if (!nums) unsupported(op, a, b);
    return ints ? Value(as_i(a) - as_i(b)) : Value(a.to_double() - b.to_double());
  }
  if (op == "*") {
    if (nums) return ints ? Value(as_i(a) * as_i(b)) : Value(a.to_double() * b.to_double());
    if ((a.is_string() || a.is_list()) && int_like(b)) return repeat(a, as_i(b));
    if ((b.is_string() || b.is_list()) && int_like(a)) return repeat(b, as_i(a));
    fail(fmt::format("can't multiply sequence by non-int of type '{}'",
                     (a.is_string() || a.is_list() ? b : a).type_name()));
  }
  if (op == "/") {
    if (!nums) unsupported(op, a, b);
    if (b.to_double() == 0) fail(ints ? "division by zero" : "float division by zero");
    return a.to_double() / b.to_double();
  }
  if (op == "//" || op == "%") {
    if (op == "%" && a.is_string()) return percent_format(a.str(), b);
    if (!nums) unsupported(op, a, b);
    if (ints) {
      int64_t x = as_i(a), y = as_i(b);
      if (y == 0) fail("integer division or modulo by zero");
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) {
        q -= 1;
        r += y;
      }
      return op == "//" ? Value(q) : Value(r);
    }
    if (b.to_double() == 0) fail(op == "//" ? "float floor division by zero" : "float modulo");
    auto [q, r] = float_divmod(a.to_double(), b.to_double());
    return op == "//" ? Value(q) : Value(r);
  }
  if (op == "**") {
    if (!nums) unsupported("** or pow()", a, b);
    if (ints && as_i(b) >= 0) {
      int64_t r = 1, base = as_i(a);
      for (int64_t e = as_i(b); e > 0; --e) r *= base;
      return r;
    }
    if (a.to_double() == 0 && b.to_double() < 0) fail("0.0 cannot be raised to a negative power");
    return std::pow(a.to_double(), b.to_double());
  }
  fail("unknown operator " + op);
}

// ---- strings ----------------------------------------------------------------------------------

std::u32string to_u32(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t n = utf8proc_ssize_t(s.size());
  while (n > 0) {
    utf8proc_int32_t c;
    utf8proc_ssize_t k = utf8proc_iterate(p, n, &c);
    if (k <= 0) {  // invalid byte: U+FFFD, one byte consumed
      c = 0xFFFD;
      k = 1;
    }
    out.push_back(char32_t(c));
    p += k;
    n -= k;
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  utf8proc_uint8_t buf[4];
  auto n = utf8proc_encode_char(utf8proc_int32_t(c), buf);
  out.append(reinterpret_cast<const char*>(buf), size_t(n));
}

std::string to_utf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

size_t rstrip_space(const std::string& s, size_t end) {
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    auto cp = to_u32(std::string_view(s).substr(start, end - start));
    if (cp.size() != 1 || !py_isspace(cp[0])) break;
    end = start;
  }
  return end;
}

size_t skip_space(const std::string& s, size_t pos) {
  while (pos < s.size()) {
    utf8proc_int32_t c;
    auto k = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data()) + pos,
                              utf8proc_ssize_t(s.size() - pos), &c);
    if (k <= 0 || !py_isspace(char32_t(c))) break;
    pos += size_t(k);
  }
  return pos;
}

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  if (!chars.is_undefined() && !chars.is_none() && !chars.is_string())
    fail("strip arg must be None or str");
  std::u32string u = to_u32(s), set = chars.is_string() ? to_u32(chars.str()) : U"";
  auto strip_it = [&](char32_t c) {
    return chars.is_string() ? set.find(c) != std::u32string::npos : py_isspace(c);
  };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return to_utf8(std::u32string_view(u).substr(b, e - b));
}

std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit,
                                  bool from_right) {
  std::vector<std::string> out;
  if (sep.is_undefined() || sep.is_none()) {
    std::u32string u = to_u32(s);
    if (!from_right) {
      size_t i = 0;
      while (true) {
        while (i < u.size() && py_isspace(u[i])) ++i;
        if (i == u.size()) break;
        if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
          out.push_back(to_utf8(std::u32string_view(u).substr(i)));
          break;
        }
        size_t j = i;
        while (j < u.size() && !py_isspace(u[j])) ++j;
        out.push_back(to_utf8(std::u32string_view(u).substr(i, j - i)));
        i = j;
      }
    } else {
      size_t e = u.size();
      while (true) {
        while (e > 0 && py_isspace(u[e - 1])) --e;
        if (e == 0) break;
        if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
          out.push_back(to_utf8(std::u32string_view(u).substr(0, e)));
          break;
        }
        size_t b = e;
        while (b > 0 && !py_isspace(u[b - 1])) --b;
        out.push_back(to_utf8(std::u32string_view(u).substr(b, e - b)));
        e = b;
      }
      std::reverse(out.begin(), out.end());
    }
    return out;
  }
  if (!sep.is_string()) fail("must be str or None, not " + sep.type_name());
  const std::string& d = sep.str();
  if (d.empty()) fail("empty separator");
  if (!from_right) {
    size_t i = 0;
    while (true) {
      size_t j = s.find(d, i);
      if (j == std::string::npos || (maxsplit >= 0 && int64_t(out.size()) == maxsplit)) {
        out.push_back(s.substr(i));
        break;
      }
      out.push_back(s.substr(i, j - i));
      i = j + d.size();
    }
  } else {
    size_t e = s.size();
    while (true) {
      size_t j = e >= d.size() ? s.rfind(d, e - d.size()) : std::string::npos;
      if (j == std::string::npos || (maxsplit >= 0 && int64_t(out.size()) == maxsplit)) {
        out.push_back(s.substr(0, e));
        break;
      }
      out.push_back(s.substr(j + d.size(), e - j - d.size()));
      e = j;
    }
    std::reverse(out.begin(), out.end());
  }
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::u32string u = to_u32(s);
  std::vector<std::string> out;
  size_t i = 0, start = 0;
  while (i < u.size()) {
    char32_t c = u[i];
    bool nl = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d ||
              c == 0x1e || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!nl) {
      ++i;
      continue;
    }
    size_t eol = i + ((c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ? 2 : 1);
    out.push_back(to_utf8(std::u32string_view(u).substr(start, (keepends ? eol : i) - start)));
    start = i = eol;
  }
  if (start < u.size()) out.push_back(to_utf8(std::u32string_view(u).substr(start)));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count) {
  std::string out;
  if (old.empty()) {
    std::u32string u = to_u32(s);
    int64_t n = 0;
    for (char32_t c : u) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      append_utf8(out, c);
    }
    if (count < 0 || n < count) out += repl;
    return out;
  }
  size_t i = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    size_t j = s.find(old, i);
    if (j == std::string::npos) break;
    out.append(s, i, j - i);
    out += repl;
    i = j + old.size();
    ++n;
  }
  out.append(s, i, std::string::npos);
  return out;
}

namespace {
bool is_cased(char32_t c) {
  auto cat = utf8proc_category(utf8proc_int32_t(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}
void append_upper(std::string& out, char32_t c) {
  if (c == 0xDF) {  // ß: Python's full case mapping
    out += "SS";
    return;
  }
  append_utf8(out, char32_t(utf8proc_toupper(utf8proc_int32_t(c))));
}
void append_lower(std::string& out, char32_t c) {
  append_utf8(out, char32_t(utf8proc_tolower(utf8proc_int32_t(c))));
}
void append_title(std::string& out, char32_t c) {
  append_utf8(out, char32_t(utf8proc_totitle(utf8proc_int32_t(c))));
}
}  // namespace

std::string py_upper(const std::string& s) {
  std::string out;
  for (char32_t c : to_u32(s)) append_upper(out, c);
  return out;
}

std::string py_lower(const std::string& s) {
  std::string out;
  for (char32_t c : to_u32(s)) append_lower(out, c);
  return out;
}

std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t c : to_u32(s)) {
    if (prev_cased)
      append_lower(out, c);
    else
      append_title(out, c);
    prev_cased = is_cased(c);
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (char32_t c : to_u32(s)) {
    if (first)
      append_title(out, c);
    else
      append_lower(out, c);
    first = false;
  }
  return out;
}

bool py_is(const std::string& s, const char* what) {
  std::u32string u = to_u32(s);
  if (u.empty()) return false;
  std::string_view w(what);
  bool any_cased = false;
  for (char32_t c : u) {
    auto cat = utf8proc_category(utf8proc_int32_t(c));
    bool alpha = cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
    bool digit = cat == UTF8PROC_CATEGORY_ND;
    bool numeric = digit || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
    if (w == "isdigit" && !digit) return false;
    if (w == "isalpha" && !alpha) return false;
    if (w == "isalnum" && !alpha && !numeric) return false;
    if (w == "isspace" && !py_isspace(c)) return false;
    if (w == "isupper" && (cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT))
      return false;
    if (w == "islower" && (cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LT))
      return false;
    any_cased = any_cased || is_cased(c);
  }
  return (w == "isupper" || w == "islower") ? any_cased : true;
}

std::string py_repr_str(const std::string& s) {
  std::u32string u = to_u32(s);
  bool has_single = u.find(U'\'') != std::u32string::npos,
       has_double = u.find(U'"') != std::u32string::npos;
  char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (char32_t c : u) {
    if (c == char32_t(q) || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", unsigned(c));
    } else if (c < 0x7f) {
      out += char(c);
    } else {
      auto cat = utf8proc_category(utf8proc_int32_t(c));
      bool printable = !(cat == UTF8PROC_CATEGORY_CC || cat == UTF8PROC_CATEGORY_CF ||
                         cat == UTF8PROC_CATEGORY_CS || cat == UTF8PROC_CATEGORY_CO ||
                         cat == UTF8PROC_CATEGORY_CN || cat == UTF8PROC_CATEGORY_ZL ||
                         cat == UTF8PROC_CATEGORY_ZP || cat == UTF8PROC_CATEGORY_ZS);
      if (printable)
        append_utf8(out, c);
      else if (c <= 0xff)
        out += fmt::format("\\x{:02x}", unsigned(c));
      else if (c <= 0xffff)
        out += fmt::format("\\u{:04x}", unsigned(c));
      else
        out += fmt::format("\\U{:08x}", unsigned(c));
    }
  }
  return out + q;
}

// ---- % formatting and str.format --------------------------------------------------------------

namespace {

std::string pad(std::string s, size_t width, bool left_align, char fill = ' ') {
  size_t n = to_u32(s).size();
  if (n >= width) return s;
  std::string p(width - n, fill);
  return left_align ? s + p : p + s;
}

int64_t int_arg(const Value& v, char conv) {
  if (v.is_bool()) return v.as_bool();
  if (v.is_int()) return v.as_int();
  if (v.is_float() && conv != 'x' && conv != 'X' && conv != 'o' && conv != 'c')
    return int64_t(std::trunc(v.as_float()));
  fail(fmt::format("%{} format: {} is required, not {}", conv,
                   conv == 'c'                                   ? "an integer"
                   : (conv == 'x' || conv == 'X' || conv == 'o') ? "an integer"
                                                                 : "a real number",
                   v.type_name()));
}

}  // namespace

std::string percent_format(const std::string& f, const Value& args) {
  std::vector<Value> pos;
  const Value* mapping = nullptr;
  if (args.is_tuple())
    pos = args.items();
  else if (args.is_dict())
    mapping = &args;
  else
    pos.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') {
      out += f[i];
      continue;
    }
    if (++i >= f.size()) fail("incomplete format");
    const Value* arg = nullptr;
    Value keyed;
    if (f[i] == '(') {
      size_t close = f.find(')', i);
      if (close == std::string::npos) fail("incomplete format key");
      if (!mapping) fail("format requires a mapping");
      const Value* v = mapping->dict_data().find(f.substr(i + 1, close - i - 1));
      if (!v) fail("'" + f.substr(i + 1, close - i - 1) + "'");
      keyed = *v;
      arg = &keyed;
      i = close + 1;
    }
    std::string flags;
    while (i < f.size() && std::strchr("-+ #0", f[i])) flags += f[i++];
    auto take = [&]() -> const Value& {
      if (arg) return *arg;
      if (next >= pos.size()) fail("not enough arguments for format string");
      return pos[next++];
    };
    int width = -1, prec = -1;
    if (i < f.size() && f[i] == '*') {
      width = int(int_arg(take(), 'd'));
      ++i;
    } else {
      while (i < f.size() && std::isdigit(static_cast<unsigned char>(f[i])))
        width = std::max(width, 0) * 10 + (f[i++] - '0');
    }
    if (i < f.size() && f[i] == '.') {
      ++i;
      prec = 0;
      if (i < f.size() && f[i] == '*') {
        prec = int(int_arg(take(), 'd'));
        ++i;
      } else {
        while (i < f.size() && std::isdigit(static_cast<unsigned char>(f[i])))
          prec = prec * 10 + (f[i++] - '0');
      }
    }
    while (i < f.size() && std::strchr("hlL", f[i])) ++i;
    if (i >= f.size()) fail("incomplete format");
    char conv = f[i];
    if (conv == '%') {
      out += '%';
      continue;
    }
    const Value& v = take();
    bool left = flags.find('-') != std::string::npos;
    std::string piece;
    if (conv == 's' || conv == 'r' || conv == 'a') {
      piece = conv == 's' ? v.to_str() : v.repr();
      if (prec >= 0) {
        auto u = to_u32(piece);
        if (u.size() > size_t(prec)) piece = to_utf8(std::u32string_view(u).substr(0, prec));
      }
      out += pad(piece, width < 0 ? 0 : size_t(width), left);
      continue;
    }
    std::string spec = "%" + flags + (width >= 0 ? std::to_string(width) : "") +
                       (prec >= 0 ? "." + std::to_string(prec) : "");
    char buf[512];
    if (std::strchr("diu", conv)) {
      snprintf(buf, sizeof buf, (spec + "lld").c_str(), static_cast<long long>(int_arg(v, conv)));
    } else if (std::strchr("xXo", conv)) {
      snprintf(buf, sizeof buf, (spec + "ll" + conv).c_str(),
               static_cast<long long>(int_arg(v, conv)));
    } else if (std::strchr("eEfFgG", conv)) {
      if (!v.is_number()) fail(fmt::format("must be real number, not {}", v.type_name()));
      snprintf(buf, sizeof buf, (spec + conv).c_str(), v.to_double());
    } else if (conv == 'c') {
      std::string ch;
      if (v.is_string()) {
        if (to_u32(v.str()).size() != 1) fail("%c requires int or char");
        ch = v.str();
      } else {
        append_utf8(ch, char32_t(int_arg(v, 'c')));
      }
      out += pad(ch, width < 0 ? 0 : size_t(width), left);
      continue;
    } else {
      fail(fmt::format("unsupported format character '{}' (0x{:x}) at index {}", conv, int(conv),
                       i));
    }
    out += buf;
  }
  if (!mapping && next < pos.size()) fail("not all arguments converted during string formatting");
  return out;
}

std::string str_format(const std::string& f, Args& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    char c = f[i];
    if (c == '}') {
      if (i + 1 < f.size() && f[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      fail("Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < f.size() && f[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    size_t close = f.find('}', i);
    if (close == std::string::npos) fail("Single '{' encountered in format string");
    std::string field = f.substr(i + 1, close - i - 1), spec;
    if (size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field = field.substr(0, colon);
    }
    if (size_t bang = field.find('!'); bang != std::string::npos) field = field.substr(0, bang);
    Value v;
    if (field.empty()) {
      if (auto_index >= args.pos.size())
        fail(
            fmt::format("Replacement index {} out of range for positional args tuple", auto_index));
      v = args.pos[auto_index++];
    } else if (std::all_of(field.begin(), field.end(),
                           [](char d) { return std::isdigit(static_cast<unsigned char>(d)); })) {
      size_t k = std::stoul(field);
      if (k >= args.pos.size())
        fail(fmt::format("Replacement index {} out of range for positional args tuple", k));
      v = args.pos[k];
    } else {
      bool found = false;
      for (const auto& [name, x] : args.kw)
        if (name == field) {
          v = x;
          found = true;
        }
      if (!found) fail("'" + field + "'");
    }
    if (spec.empty()) {
      out += v.to_str();
    } else {
      // [[fill]align][width][.precision][type], enough for the templates seen in the wild.
      char fill = ' ', align = 0;
      size_t k = 0;
      if (spec.size() >= 2 && std::strchr("<>^", spec[1])) {
        fill = spec[0];
        align = spec[1];
        k = 2;
      } else if (!spec.empty() && std::strchr("<>^", spec[0])) {
        align = spec[0];
        k = 1;
      }
      size_t width = 0;
      while (k < spec.size() && std::isdigit(static_cast<unsigned char>(spec[k])))
        width = width * 10 + (spec[k++] - '0');
      std::string piece = v.to_str();
      if (k < spec.size()) {
        std::string rest = spec.substr(k);
        if (!v.is_number())
          fail("Unknown format code '" + rest.substr(rest.size() - 1) + "' for object of type '" +
               v.type_name() + "'");
        char buf[128];
        std::string cf =
            "%" + (rest.back() == 'd' ? rest.substr(0, rest.size() - 1) + "lld" : rest);
        if (rest.back() == 'd')
          snprintf(buf, sizeof buf, cf.c_str(), static_cast<long long>(int_arg(v, 'd')));
        else
          snprintf(buf, sizeof buf, cf.c_str(), v.to_double());
        piece = buf;
      }
      if (!align) align = v.is_number() ? '>' : '<';
      size_t n = to_u32(piece).size();
      if (n < width) {
        size_t padn = width - n, l = align == '<' ? 0 : align == '>' ? padn : padn / 2;
        piece = std::string(l, fill) + piece + std::string(padn - l, fill);
      }
      out += piece;
    }
    i = close;
  }
  return out;
}

}  // namespace detail
}  // namespace rig::jinja
