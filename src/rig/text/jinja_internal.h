// Internals of the Jinja2 interpreter (jinja.h): the syntax tree the parser builds, and the
// Python-semantics helpers shared by the parser, the interpreter and the built-in filters.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "rig/text/jinja.h"

namespace rig::jinja::detail {

// A rendering failure before it knows its line: the interpreter adds the template name and the
// line of the expression being evaluated. `raised` marks raise_exception().
struct Failure {
  std::string message;
  bool raised = false;
};
[[noreturn]] void fail(std::string message);

// ---- syntax tree ------------------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  Const,    // value
  Name,     // name
  NSRef,    // name.attr as an assignment target
  List,     // items
  Tuple,    // items
  Dict,     // items: key, value, key, value...
  Getattr,  // a.attr
  Getitem,  // a[b]
  Slice,    // items: start, stop, step (null when left out)
  Call,     // a(items..., kwargs..., *dyn_args, **dyn_kwargs)
  Filter,   // a | name(items..., kwargs...); a is null inside {% filter %} and {% set x | f %}
  Test,     // a is [not] name(items...)
  Neg,
  Pos,
  Not,  // a
  And,
  Or,       // a, b
  Binary,   // a op b, op in + - * / // % **
  Concat,   // items joined with ~
  Compare,  // a then ops[i] items[i]
  Cond,     // b if a else c (c may be null)
};

struct Expr {
  ExprKind kind = ExprKind::Const;
  int line = 0;
  Value value;
  std::string name;  // Name, NSRef, Filter, Test; Binary operator
  std::string attr;  // Getattr, NSRef
  ExprPtr a, b, c;
  std::vector<ExprPtr> items;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr dyn_args, dyn_kwargs;
  std::vector<std::string> ops;
  bool negated = false;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

enum class StmtKind {
  Output,       // text
  Print,        // expr
  If,           // conds[i] -> bodies[i]; else_body
  For,          // for target in expr [if filter]: body; else_body
  Set,          // target = expr
  SetBlock,     // target = rendered body, through filter (may be null)
  Macro,        // name(params = defaults): body
  CallBlock,    // expr is the call; params/defaults of caller(); body
  FilterBlock,  // filter applied to rendered body
  With,         // targets = values: body
  Break,
  Continue,
  Generation,  // body, tracked
};

struct Stmt {
  StmtKind kind = StmtKind::Output;
  int line = 0;
  std::string text;
  ExprPtr target, expr, filter;
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  Body body, else_body;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // aligned to the last params
  std::vector<ExprPtr> targets, values;
};

struct Program {
  std::string name;
  Body body;
  bool has_generation = false;
};

Program parse(std::string_view source, const std::string& name);

// ---- built-ins (jinja_builtins.cpp) -----------------------------------------------------------

using FilterFn = Value (*)(const Value& subject, Args& args);
using TestFn = bool (*)(const Value& subject, Args& args);
FilterFn find_filter(std::string_view name);
TestFn find_test(std::string_view name);

Value get_attr(const Value& obj, const std::string& name);  // obj.name (attribute first)
Value get_item(const Value& obj, const Value& key);         // obj[key] (item first)
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
std::vector<Value> iterate(const Value& v);  // what `for` sees; fails on non-iterables
int64_t length(const Value& v);              // len()
Value call(const Value& callee, Args& args);
// range, dict, namespace, raise_exception, strftime_now.
void add_globals(Value& globals, const RenderOptions& opt);

// ---- Python semantics (jinja_value.cpp) -------------------------------------------------------

[[noreturn]] void fail_undefined(const Value& v);  // UndefinedError with the value's hint
int compare(const Value& a, const Value& b, const char* op);  // <0, 0, >0; fails like Python
bool contains(const Value& container, const Value& item);     // `item in container`
Value binary(const std::string& op, const Value& a, const Value& b);
std::string percent_format(const std::string& fmt, const Value& args);  // str % args
std::string str_format(const std::string& fmt, Args& args);             // str.format

std::u32string to_u32(std::string_view s);
std::string to_utf8(std::u32string_view s);
void append_utf8(std::string& out, char32_t c);
bool py_isspace(char32_t c);
// Python str.strip/lstrip/rstrip; `chars` null strips whitespace.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right);
std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit,
                                  bool from_right);
std::vector<std::string> py_splitlines(const std::string& s, bool keepends);
std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count);
std::string py_upper(const std::string& s);
std::string py_lower(const std::string& s);
std::string py_title(const std::string& s);       // str.title()
std::string py_capitalize(const std::string& s);  // str.capitalize()
bool py_is(const std::string& s,
           const char* what);  // isdigit/isalpha/isalnum/isspace/isupper/islower
std::string py_repr_str(const std::string& s);
// Whitespace (Python's \s) ending at `end` / starting at `pos` in UTF-8 text.
size_t rstrip_space(const std::string& s, size_t end);
size_t skip_space(const std::string& s, size_t pos);

}  // namespace rig::jinja::detail
