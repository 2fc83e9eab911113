// The Jinja2 interpreter: walks the syntax tree of jinja_parse.cpp with Jinja2's scoping (a for
// loop's body gets a fresh scope each iteration, so `set` inside a loop does not outlive the
// iteration; if-blocks share their enclosing scope; macros see their defining scope; namespace()
// objects are the one thing assignments can mutate across scopes).
#include <memory>

#include "rig/text/jinja_internal.h"

namespace rig::jinja {
namespace detail {
namespace {

struct Scope;
using ScopePtr = std::shared_ptr<Scope>;

struct Scope {
  ScopePtr parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (auto it = s->vars.rbegin(); it != s->vars.rend(); ++it)
        if (it->first == name) return &it->second;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars)
      if (k == name) {
        old = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};

ScopePtr child(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

enum class Flow { Normal, Break, Continue };

class Interp {
 public:
  Interp(const Program& prog, std::string* top) : prog_(prog), top_(top) {}

  int line = 0;  // of the expression being evaluated, for error messages
  std::vector<std::pair<size_t, size_t>> generation;

  Flow exec_body(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& s : body) {
      Flow f = exec(*s, scope, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

 private:
  Flow exec(const Stmt& s, const ScopePtr& scope, std::string& out) {
    line = s.line;
    switch (s.kind) {
      case StmtKind::Output:
        out += s.text;
        return Flow::Normal;
      case StmtKind::Print:
        out += eval(*s.expr, scope).to_str();
        return Flow::Normal;
      case StmtKind::If:
        for (size_t i = 0; i < s.conds.size(); ++i)
          if (eval(*s.conds[i], scope).truthy()) return exec_body(s.bodies[i], scope, out);
        return exec_body(s.else_body, scope, out);
      case StmtKind::For:
        return exec_for(s, scope, out);
      case StmtKind::Set:
        assign(*s.target, eval(*s.expr, scope), scope);
        return Flow::Normal;
      case StmtKind::SetBlock: {
        std::string buf;
        exec_body(s.body, scope, buf);
        Value v(std::move(buf));
        if (s.filter) v = apply_filters(*s.filter, v, scope);
        assign(*s.target, v, scope);
        return Flow::Normal;
      }
      case StmtKind::Macro:
        scope->set(s.name, make_macro(s, s.name, scope));
        return Flow::Normal;
      case StmtKind::CallBlock: {
        const Expr& c = *s.expr;
        Value callee = eval(*c.a, scope);
        Args args = eval_args(c, scope);
        args.kw.emplace_back("caller", make_macro(s, "caller", scope));
        line = c.line;
        out += call(callee, args).to_str();
        return Flow::Normal;
      }
      case StmtKind::FilterBlock: {
        std::string buf;
        exec_body(s.body, scope, buf);
        out += apply_filters(*s.filter, Value(std::move(buf)), scope).to_str();
        return Flow::Normal;
      }
      case StmtKind::With: {
        auto inner = child(scope);
        for (size_t i = 0; i < s.targets.size(); ++i)
          assign(*s.targets[i], eval(*s.values[i], scope), inner);
        return exec_body(s.body, inner, out);
      }
      case StmtKind::Break:
        return Flow::Break;
      case StmtKind::Continue:
        return Flow::Continue;
      case StmtKind::Generation: {
        size_t start = out.size();
        Flow f = exec_body(s.body, scope, out);
        // transformers records offsets into the top-level output only.
        if (&out == top_) generation.emplace_back(start, out.size());
        return f;
      }
    }
    return Flow::Normal;
  }

  Flow exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    Value seq = eval(*s.expr, scope);
    line = s.line;
    std::vector<Value> items = iterate(seq);
    if (s.filter) {  // `for x in xs if cond`: filtered before the loop, so loop.* counts the kept
                     // items
      std::vector<Value> kept;
      for (auto& item : items) {
        auto probe = child(scope);
        assign(*s.target, item, probe);
        if (eval(*s.filter, probe).truthy()) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    const int64_t n = int64_t(items.size());
    auto last_changed = std::make_shared<std::optional<std::vector<Value>>>();
    for (int64_t i = 0; i < n; ++i) {
      auto iter_scope = child(scope);
      assign(*s.target, items[size_t(i)], iter_scope);
      Value loop = Value::object("LoopContext");
      loop.set("index0", i).set("index", i + 1).set("revindex", n - i).set("revindex0", n - i - 1);
      loop.set("first", i == 0)
          .set("last", i == n - 1)
          .set("length", n)
          .set("depth", 1)
          .set("depth0", 0);
      loop.set("previtem",
               i > 0 ? items[size_t(i - 1)] : Value::undefined("there is no previous item"));
      loop.set("nextitem",
               i + 1 < n ? items[size_t(i + 1)] : Value::undefined("there is no next item"));
      loop.set("cycle", Value::function("cycle", [i](Args& a) {
                 if (a.pos.empty()) fail("no items for cycling given");
                 return a.pos[size_t(i) % a.pos.size()];
               }));
      loop.set("changed", Value::function("changed", [last_changed](Args& a) {
                 if (*last_changed && **last_changed == a.pos) return Value(false);
                 *last_changed = a.pos;
                 return Value(true);
               }));
      iter_scope->set("loop", std::move(loop));
      Flow f = exec_body(s.body, iter_scope, out);
      if (f == Flow::Break) break;
    }
    if (n == 0) exec_body(s.else_body, child(scope), out);
    return Flow::Normal;
  }

  void assign(const Expr& target, const Value& v, const ScopePtr& scope) {
    switch (target.kind) {
      case ExprKind::Name:
        scope->set(target.name, v);
        return;
      case ExprKind::Tuple: {
        std::vector<Value> vals = iterate(v);
        const size_t want = target.items.size();
        if (vals.size() > want) fail(fmt::format("too many values to unpack (expected {})", want));
        if (vals.size() < want)
          fail(fmt::format("not enough values to unpack (expected {}, got {})", want, vals.size()));
        for (size_t i = 0; i < want; ++i) assign(*target.items[i], vals[i], scope);
        return;
      }
      case ExprKind::NSRef: {
        const Value* ns = scope->find(target.name);
        if (!ns || !ns->is_object() || ns->dict_data().object != "Namespace")
          fail("cannot assign attribute on non-namespace object");
        Value shared = *ns;  // shares the namespace's storage
        shared.set(target.attr, v);
        return;
      }
      default:
        fail("can't assign to this expression");
    }
  }

  // A macro, or the caller() of a {% call %} block: renders `s.body` with its parameters bound.
  Value make_macro(const Stmt& s, const std::string& name, const ScopePtr& defining) {
    return Value::function(
        name,
        [this, &s, defining, name](Args& a) -> Value {
          auto sc = child(defining);
          const size_t np = s.params.size(), nd = s.defaults.size();
          std::vector<bool> used(a.kw.size(), false);
          for (size_t i = 0; i < np; ++i) {
            const std::string& p = s.params[i];
            Value v;
            bool found = false;
            if (i < a.pos.size()) {
              v = a.pos[i];
              found = true;
            }
            for (size_t k = 0; k < a.kw.size() && !found; ++k)
              if (a.kw[k].first == p) {
                v = a.kw[k].second;
                used[k] = found = true;
              }
            if (!found)
              v = i >= np - nd
                      ? eval(*s.defaults[i - (np - nd)], sc)
                      : Value::undefined(fmt::format("parameter '{}' was not provided", p));
            sc->set(p, v);
          }
          std::vector<Value> varargs(a.pos.size() > np ? a.pos.begin() + long(np) : a.pos.end(),
                                     a.pos.end());
          Value kwargs = Value::dict();
          for (size_t k = 0; k < a.kw.size(); ++k) {
            if (used[k]) continue;
            if (a.kw[k].first == "caller")
              sc->set("caller", a.kw[k].second);
            else
              kwargs.set(a.kw[k].first, a.kw[k].second);
          }
          sc->set("varargs", Value::list(std::move(varargs), true));
          sc->set("kwargs", kwargs);
          if (++depth_ > 200)
            fail("maximum recursion depth exceeded while calling macro '" + name + "'");
          std::string buf;
          int saved = line;
          exec_body(s.body, sc, buf);
          line = saved;
          --depth_;
          return Value(std::move(buf));
        },
        true);
  }

  Args eval_args(const Expr& e, const ScopePtr& scope) {
    Args args;
    for (const auto& x : e.items) args.pos.push_back(eval(*x, scope));
    for (const auto& [k, x] : e.kwargs) args.kw.emplace_back(k, eval(*x, scope));
    if (e.dyn_args)
      for (auto& v : iterate(eval(*e.dyn_args, scope))) args.pos.push_back(std::move(v));
    if (e.dyn_kwargs) {
      Value d = eval(*e.dyn_kwargs, scope);
      if (!d.is_dict()) fail("argument after ** must be a mapping, not " + d.type_name());
      for (const auto& kv : d.dict_data().items) args.kw.push_back(kv);
    }
    return args;
  }

  Value apply_filters(const Expr& f, Value subject, const ScopePtr& scope) {
    if (f.a) subject = apply_filters(*f.a, std::move(subject), scope);
    Args args = eval_args(f, scope);
    line = f.line;
    return find_filter(f.name)(subject, args);
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case ExprKind::Const:
        return e.value;
      case ExprKind::Name: {
        const Value* v = scope->find(e.name);
        return v ? *v : Value::undefined(fmt::format("'{}' is undefined", e.name));
      }
      case ExprKind::List:
      case ExprKind::Tuple: {
        std::vector<Value> items;
        for (const auto& x : e.items) items.push_back(eval(*x, scope));
        return Value::list(std::move(items), e.kind == ExprKind::Tuple);
      }
      case ExprKind::Dict: {
        Value d = Value::dict();
        for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
          Value k = eval(*e.items[i], scope);
          line = e.line;
          if (!k.is_string())
            fail("rig's templates support only string dict keys, not " + k.type_name());
          d.set(k.str(), eval(*e.items[i + 1], scope));
        }
        return d;
      }
      case ExprKind::Getattr: {
        Value obj = eval(*e.a, scope);
        line = e.line;
        if (obj.is_undefined()) fail_undefined(obj);
        return get_attr(obj, e.attr);
      }
      case ExprKind::Getitem: {
        Value obj = eval(*e.a, scope);
        if (e.b->kind == ExprKind::Slice) {
          Value parts[3];
          for (int i = 0; i < 3; ++i)
            parts[i] = e.b->items[size_t(i)] ? eval(*e.b->items[size_t(i)], scope) : Value::none();
          line = e.line;
          if (obj.is_undefined()) fail_undefined(obj);
          return slice(obj, parts[0], parts[1], parts[2]);
        }
        Value key = eval(*e.b, scope);
        line = e.line;
        if (obj.is_undefined()) fail_undefined(obj);
        return get_item(obj, key);
      }
      case ExprKind::Call: {
        Value callee = eval(*e.a, scope);
        Args args = eval_args(e, scope);
        line = e.line;
        return call(callee, args);
      }
      case ExprKind::Filter: {
        Value subject = eval(*e.a, scope);
        Args args = eval_args(e, scope);
        line = e.line;
        return find_filter(e.name)(subject, args);
      }
      case ExprKind::Test: {
        Value subject = eval(*e.a, scope);
        Args args = eval_args(e, scope);
        line = e.line;
        return find_test(e.name)(subject, args);
      }
      case ExprKind::Neg:
      case ExprKind::Pos: {
        Value v = eval(*e.a, scope);
        line = e.line;
        if (v.is_undefined()) fail_undefined(v);
        const char* op = e.kind == ExprKind::Neg ? "-" : "+";
        if (!v.is_number())
          fail(fmt::format("bad operand type for unary {}: '{}'", op, v.type_name()));
        if (v.is_float()) return e.kind == ExprKind::Neg ? Value(-v.as_float()) : v;
        int64_t i = v.is_bool() ? v.as_bool() : v.as_int();
        return Value(e.kind == ExprKind::Neg ? -i : i);
      }
      case ExprKind::Not:
        return Value(!eval(*e.a, scope).truthy());
      case ExprKind::And: {
        Value l = eval(*e.a, scope);
        return l.truthy() ? eval(*e.b, scope) : l;
      }
      case ExprKind::Or: {
        Value l = eval(*e.a, scope);
        return l.truthy() ? l : eval(*e.b, scope);
      }
      case ExprKind::Binary: {
        Value l = eval(*e.a, scope), r = eval(*e.b, scope);
        line = e.line;
        return binary(e.name, l, r);
      }
      case ExprKind::Concat: {
        std::string s;
        for (const auto& x : e.items) s += eval(*x, scope).to_str();
        return Value(std::move(s));
      }
      case ExprKind::Compare: {
        Value left = eval(*e.a, scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i], scope);
          line = e.line;
          const std::string& op = e.ops[i];
          bool ok;
          if (op == "==")
            ok = left == right;
          else if (op == "!=")
            ok = left != right;
          else if (op == "in")
            ok = contains(right, left);
          else if (op == "not in")
            ok = !contains(right, left);
          else {
            int c = compare(left, right, op.c_str());
            ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
          }
          if (!ok) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case ExprKind::Cond:
        if (eval(*e.a, scope).truthy()) return eval(*e.b, scope);
        if (e.c) return eval(*e.c, scope);
        return Value::undefined(
            fmt::format("the inline if-expression on line {} evaluated to false and no else "
                        "section was defined.",
                        e.line));
      case ExprKind::NSRef:
      case ExprKind::Slice:
        break;
    }
    fail("invalid expression");
  }

  const Program& prog_;
  std::string* top_;
  int depth_ = 0;
};

}  // namespace
}  // namespace detail

Template::Template(std::string_view source, std::string name)
    : prog_(std::make_unique<detail::Program>(detail::parse(source, name))) {}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

const std::string& Template::name() const {
  return prog_->name;
}
bool Template::has_generation_tags() const {
  return prog_->has_generation;
}

std::string Template::render(const Value& context, const RenderOptions& opt) const {
  return render_tracked(context, opt).text;
}

Rendered Template::render_tracked(const Value& context, const RenderOptions& opt) const {
  using namespace detail;
  Rendered r;
  Interp in(*prog_, &r.text);
  auto globals = std::make_shared<Scope>();
  Value g = Value::dict();
  add_globals(g, opt);
  globals->vars = g.dict_data().items;
  auto ctx = child(globals);
  if (context.is_dict()) ctx->vars = context.dict_data().items;
  try {
    in.exec_body(prog_->body, child(ctx), r.text);
  } catch (const Failure& f) {
    if (f.raised) throw RaisedError(prog_->name, in.line, f.message);
    throw TemplateError(prog_->name, in.line, f.message);
  }
  r.generation = std::move(in.generation);
  return r;
}

}  // namespace rig::jinja
