// Lexer and parser of the Jinja2 interpreter. The lexer follows Jinja2's own (jinja2/lexer.py)
// with trim_blocks and lstrip_blocks on, as transformers configures it: the whitespace a chat
// template renders depends on every rule here (one trailing newline of the source dropped,
// lstrip only of whitespace that starts a line, "-" stripping Python's \s, the newline after
// a block or comment tag removed). The parser follows jinja2/parser.py's grammar and precedence.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>

#include "rig/text/jinja_internal.h"

namespace rig::jinja::detail {

namespace {

enum class T {
  Data,
  VarBegin,
  VarEnd,
  BlockBegin,
  BlockEnd,
  Name,
  String,
  Integer,
  Float,
  Op,
  Eof
};

struct Token {
  T type = T::Eof;
  std::string text;  // data, name, operator, or the literal's source
  Value value;       // string and number literals
  int line = 1;
};

bool is_digit(char c) {
  return c >= '0' && c <= '9';
}
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}
bool is_name_char(char c) {
  return is_name_start(c) || is_digit(c);
}
int count_nl(std::string_view s) {
  return int(std::count(s.begin(), s.end(), '\n'));
}

class Lexer {
 public:
  Lexer(std::string_view source, const std::string& name) : name_(name) {
    // Jinja2 treats \r\n, \r and \n alike, and drops one trailing newline
    // (keep_trailing_newline=False).
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;  // the previous match ended a line (lstrip_blocks applies from here)
    const size_t n = src_.size();
    while (pos < n) {
      size_t idx = find_tag(pos);
      if (idx == std::string::npos) {
        emit(T::Data, src_.substr(pos));
        break;
      }
      const char kind = src_[idx + 1];
      size_t p = idx + 2;
      char sign = 0;
      if (p < n && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      size_t raw_end = kind == '%' ? match_raw(p, "raw") : std::string::npos;
      std::string text = src_.substr(pos, idx - pos);
      const int text_lines = count_nl(text);
      emit(T::Data, strip_before(std::move(text), sign, kind != '{', line_starting));
      line_ += text_lines;
      if (raw_end != std::string::npos) {
        pos = lex_raw(idx, raw_end);
        line_starting = src_[pos - 1] == '\n';
        continue;
      }
      if (kind == '#') {
        size_t end = comment_end(p);
        line_ += count_nl(std::string_view(src_).substr(idx, end - idx));
        pos = end;
        line_starting = src_[end - 1] == '\n';
        continue;
      }
      emit(kind == '{' ? T::VarBegin : T::BlockBegin, "");
      pos = lex_tag(p, kind == '%');
      line_starting = pos > 0 && src_[pos - 1] == '\n';
    }
    emit(T::Eof, "");
    return std::move(toks_);
  }

 private:
  [[noreturn]] void error(const std::string& msg) { throw TemplateError(name_, line_, msg); }

  void emit(T type, std::string text, Value value = Value()) {
    if (type == T::Data && text.empty()) return;
    toks_.push_back(Token{type, std::move(text), std::move(value), line_});
  }

  bool starts(size_t pos, const char* s) const { return src_.compare(pos, std::strlen(s), s) == 0; }

  size_t find_tag(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string::npos; i = src_.find('{', i + 1))
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))
        return i;
    return std::string::npos;
  }

  // "-" strips all whitespace before the tag; otherwise lstrip_blocks strips the spaces that
  // start the tag's line, for block and comment tags only, and only if nothing else is on it.
  static std::string strip_before(std::string text, char sign, bool lstrip, bool line_starting) {
    if (sign == '-') {
      text.resize(rstrip_space(text, text.size()));
    } else if (sign != '+' && lstrip) {
      size_t l_pos = text.rfind('\n');
      l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
          skip_space(text, l_pos) == text.size())
        text.resize(l_pos);
    }
    return text;
  }

  // After "{%" (and its sign) at p: `\s*WORD\s*` then the block end; the position after it.
  size_t match_raw(size_t p, const char* word) const {
    p = skip_space(src_, p);
    if (!starts(p, word)) return std::string::npos;
    p = skip_space(src_, p + std::strlen(word));
    return block_end(p, word[0] == 'e');
  }

  // A block end at p ("+%}", "-%}" and whitespace, "%}" and one newline when `trim`); npos if none.
  size_t block_end(size_t p, bool trim) const {
    if (starts(p, "+%}")) return p + 3;
    if (starts(p, "-%}")) return skip_space(src_, p + 3);
    if (starts(p, "%}"))
      return p + 2 + (trim && p + 2 < src_.size() && src_[p + 2] == '\n' ? 1 : 0);
    return std::string::npos;
  }

  size_t lex_raw(size_t tag_start, size_t body_start) {
    line_ += count_nl(std::string_view(src_).substr(tag_start, body_start - tag_start));
    bool body_line_starting = src_[body_start - 1] == '\n';
    for (size_t i = src_.find("{%", body_start); i != std::string::npos;
         i = src_.find("{%", i + 1)) {
      size_t p = i + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      size_t end = match_raw(p, "endraw");
      if (end == std::string::npos) continue;
      std::string body = src_.substr(body_start, i - body_start);
      int body_lines = count_nl(body);
      emit(T::Data, strip_before(std::move(body), sign, true, body_line_starting));
      line_ += body_lines + count_nl(std::string_view(src_).substr(i, end - i));
      return end;
    }
    error("Missing end of raw directive");
  }

  size_t comment_end(size_t p) {
    for (size_t i = p; i < src_.size(); ++i) {
      if (starts(i, "+#}")) return i + 3;
      if (starts(i, "-#}")) return skip_space(src_, i + 3);
      if (starts(i, "#}")) return i + 2 + (i + 2 < src_.size() && src_[i + 2] == '\n' ? 1 : 0);
    }
    error("Missing end of comment tag");
  }

  // Digits with single underscores between them: (\d+_)*\d+. Returns p when none.
  size_t digits(size_t p) const {
    size_t q = p;
    while (q < src_.size() && is_digit(src_[q])) {
      ++q;
      if (q + 1 < src_.size() && src_[q] == '_' && is_digit(src_[q + 1])) ++q;
    }
    return q;
  }

  // Tokens of a {{ }} or {% %} tag from p; returns the position after its end.
  size_t lex_tag(size_t pos, bool block) {
    std::vector<char> balance;
    const size_t n = src_.size();
    while (pos < n) {
      if (balance.empty()) {
        size_t end = std::string::npos;
        if (block)
          end = block_end(pos, true);
        else if (starts(pos, "-}}"))
          end = skip_space(src_, pos + 3);
        else if (starts(pos, "}}"))
          end = pos + 2;
        if (end != std::string::npos) {
          line_ += count_nl(std::string_view(src_).substr(pos, end - pos));
          emit(block ? T::BlockEnd : T::VarEnd, "");
          return end;
        }
      }
      if (size_t e = skip_space(src_, pos); e > pos) {
        line_ += count_nl(std::string_view(src_).substr(pos, e - pos));
        pos = e;
        continue;
      }
      const char c = src_[pos];
      if (is_digit(c)) {
        pos = lex_number(pos);
        continue;
      }
      if (is_name_start(c)) {
        size_t e = pos;
        while (e < n && is_name_char(src_[e])) ++e;
        emit(T::Name, src_.substr(pos, e - pos));
        pos = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t e = pos + 1;
        while (e < n && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
        if (e < n) {
          std::string body = src_.substr(pos + 1, e - pos - 1);
          emit(T::String, src_.substr(pos, e + 1 - pos), Value(unescape(body)));
          line_ += count_nl(body);
          pos = e + 1;
          continue;
        }
      }
      static const char* const ops2[] = {"**", "//", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* o : ops2)
        if (starts(pos, o)) op = o;
      if (op.empty() && std::strchr("+-/*%~[](){}><=.:|,;", c) && c != 0) op = std::string(1, c);
      if (op.empty())
        error(fmt::format("unexpected char {} at {}", py_repr_str(std::string(1, c)), pos));
      if (op == "{" || op == "(" || op == "[") {
        balance.push_back(op == "{" ? '}' : op == "(" ? ')' : ']');
      } else if (op == "}" || op == ")" || op == "]") {
        if (balance.empty()) error(fmt::format("unexpected '{}'", op));
        if (balance.back() != op[0])
          error(fmt::format("unexpected '{}', expected '{}'", op, balance.back()));
        balance.pop_back();
      }
      emit(T::Op, op);
      pos += op.size();
    }
    return pos;  // end of template inside a tag: the parser reports it
  }

  size_t lex_number(size_t pos) {
    const size_t n = src_.size();
    auto clean = [](std::string s) {
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      return s;
    };
    // Float: digits, then a fraction and/or an exponent; not right after a dot (a.0.1 is a[0][1]).
    if (pos == 0 || src_[pos - 1] != '.') {
      size_t q = digits(pos), r = q;
      bool frac = false;
      if (q + 1 < n && src_[q] == '.' && is_digit(src_[q + 1])) {
        r = digits(q + 1);
        frac = true;
      }
      size_t end = frac ? r : std::string::npos;
      if (r < n && (src_[r] == 'e' || src_[r] == 'E')) {
        size_t s = r + 1;
        if (s < n && (src_[s] == '+' || src_[s] == '-')) ++s;
        if (s < n && is_digit(src_[s])) end = digits(s);
      }
      if (end != std::string::npos) {
        std::string text = src_.substr(pos, end - pos);
        emit(T::Float, text, Value(std::strtod(clean(text).c_str(), nullptr)));
        return end;
      }
    }
    size_t end = pos + 1;
    int base = 10;
    char p1 = pos + 1 < n ? char(src_[pos + 1] | 0x20) : 0;
    auto prefixed = [&](int b, auto ok) {
      size_t e = pos + 2;
      while (e < n && (ok(src_[e]) || (src_[e] == '_' && e + 1 < n && ok(src_[e + 1])))) ++e;
      if (e == pos + 2) return false;
      base = b;
      end = e;
      return true;
    };
    if (src_[pos] == '0' && p1 == 'b' && prefixed(2, [](char c) { return c == '0' || c == '1'; })) {
    } else if (src_[pos] == '0' && p1 == 'o' &&
               prefixed(8, [](char c) { return c >= '0' && c <= '7'; })) {
    } else if (src_[pos] == '0' && p1 == 'x' && prefixed(16, [](char c) {
                 return std::isxdigit(static_cast<unsigned char>(c)) != 0;
               })) {
    } else if (src_[pos] == '0') {
      while (end < n &&
             (src_[end] == '0' || (src_[end] == '_' && end + 1 < n && src_[end + 1] == '0')))
        ++end;
    } else {
      end = digits(pos);
    }
    std::string text = src_.substr(pos, end - pos);
    std::string body = clean(base == 10 ? text : text.substr(2));
    emit(T::Integer, text, Value(int64_t(std::stoll(body, nullptr, base))));
    return end;
  }

  // Python's unicode-escape decoding of a string literal's body.
  std::string unescape(const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != '\\' || i + 1 >= s.size()) {
        out += s[i];
        continue;
      }
      char d = s[++i];
      auto hex = [&](int count, const char* what) {
        char32_t v = 0;
        for (int k = 0; k < count; ++k) {
          if (i + 1 >= s.size() || !std::isxdigit(static_cast<unsigned char>(s[i + 1])))
            error(fmt::format("truncated \\{} escape", what));
          char h = s[++i];
          v = v * 16 + char32_t(is_digit(h) ? h - '0' : (h | 0x20) - 'a' + 10);
        }
        if (v > 0x10FFFF) error("illegal Unicode character");
        append_utf8(out, v);
      };
      switch (d) {
        case '\n':
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          hex(2, "xXX");
          break;
        case 'u':
          hex(4, "uXXXX");
          break;
        case 'U':
          hex(8, "UXXXXXXXX");
          break;
        case 'N':
          error("\\N{...} escapes are not supported");
        default:
          if (d >= '0' && d <= '7') {
            char32_t v = char32_t(d - '0');
            for (int k = 0; k < 2 && i + 1 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7'; ++k)
              v = v * 8 + char32_t(s[++i] - '0');
            append_utf8(out, v);
          } else if (d == '\\' || d == '\'' || d == '"') {
            out += d;
          } else {
            out += '\\';
            out += d;
          }
      }
    }
    return out;
  }

  std::string src_;
  const std::string& name_;
  int line_ = 1;
  std::vector<Token> toks_;
};

// ---- parser -----------------------------------------------------------------------------------

class Parser {
 public:
  Parser(std::vector<Token> toks, Program& prog) : toks_(std::move(toks)), prog_(prog) {}

  Body parse_template() { return subparse({}); }

 private:
  using Ends = std::vector<std::string>;

  const Token& cur() const { return toks_[i_]; }
  const Token& look() const { return toks_[std::min(i_ + 1, toks_.size() - 1)]; }
  const Token& next() { return toks_[i_ < toks_.size() - 1 ? i_++ : i_]; }
  bool is_op(const char* op) const { return cur().type == T::Op && cur().text == op; }
  bool is_name(const char* n) const { return cur().type == T::Name && cur().text == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++i_;
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    ++i_;
    return true;
  }

  [[noreturn]] void error(const std::string& msg, int line = -1) {
    throw TemplateError(prog_.name, line < 0 ? cur().line : line, msg);
  }

  static std::string describe_type(T t) {
    switch (t) {
      case T::VarBegin:
        return "begin of print statement";
      case T::VarEnd:
        return "end of print statement";
      case T::BlockBegin:
        return "begin of statement block";
      case T::BlockEnd:
        return "end of statement block";
      case T::String:
        return "string";
      case T::Integer:
        return "integer";
      case T::Float:
        return "float";
      case T::Data:
        return "template data / text";
      case T::Eof:
        return "end of template";
      default:
        return "name";
    }
  }
  static std::string describe(const Token& t) {
    return t.type == T::Name || t.type == T::Op ? t.text : describe_type(t.type);
  }

  void expect(T type) {
    if (cur().type == T::Eof && type != T::Eof)
      error(fmt::format("unexpected end of template, expected '{}'.", describe_type(type)));
    if (cur().type != type)
      error(fmt::format("expected token '{}', got '{}'", describe_type(type), describe(cur())));
    ++i_;
  }
  void expect_op(const char* op) {
    if (cur().type == T::Eof) error(fmt::format("unexpected end of template, expected '{}'.", op));
    if (!is_op(op)) error(fmt::format("expected token '{}', got '{}'", op, describe(cur())));
    ++i_;
  }
  std::string expect_name() {
    if (cur().type != T::Name) {
      if (cur().type == T::Eof) error("unexpected end of template, expected 'name'.");
      error(fmt::format("expected token 'name', got '{}'", describe(cur())));
    }
    return next().text;
  }
  void expect_name(const char* n) {
    if (!is_name(n)) error(fmt::format("expected token '{}', got '{}'", n, describe(cur())));
    ++i_;
  }

  // Jinja2's message for an unknown tag (name) or the end of the template (no name) inside blocks.
  [[noreturn]] void fail_unknown(const std::string* name, int line) {
    std::string msg =
        name ? fmt::format("Encountered unknown tag '{}'.", *name) : "Unexpected end of template.";
    if (!end_stack_.empty()) {
      std::set<std::string> expected;
      for (const auto& e : end_stack_) expected.insert(e.begin(), e.end());
      std::string looking;
      for (const auto& e : end_stack_.back())
        looking += (looking.empty() ? "'" : " or '") + e + "'";
      if (name && expected.count(*name))
        msg +=
            " You probably made a nesting mistake. Jinja is expecting this tag, but currently "
            "looking for " +
            looking + ".";
      else
        msg += " Jinja was looking for the following tags: " + looking + ".";
    }
    if (!tag_stack_.empty())
      msg +=
          fmt::format(" The innermost block that needs to be closed is '{}'.", tag_stack_.back());
    error(msg, line);
  }

  Body subparse(const Ends& ends) {
    Body body;
    if (!ends.empty()) end_stack_.push_back(ends);
    while (true) {
      const Token& t = cur();
      if (t.type == T::Data) {
        auto s = stmt(StmtKind::Output, t.line);
        s->text = t.text;
        body.push_back(std::move(s));
        ++i_;
      } else if (t.type == T::VarBegin) {
        ++i_;
        auto s = stmt(StmtKind::Print, t.line);
        s->expr = parse_tuple();
        expect(T::VarEnd);
        body.push_back(std::move(s));
      } else if (t.type == T::BlockBegin) {
        ++i_;
        if (!ends.empty() && cur().type == T::Name &&
            std::find(ends.begin(), ends.end(), cur().text) != ends.end())
          break;
        body.push_back(parse_statement());
        expect(T::BlockEnd);
      } else if (t.type == T::Eof) {
        break;
      } else {
        error(fmt::format("unexpected '{}'", describe(t)));
      }
    }
    if (!ends.empty()) end_stack_.pop_back();
    return body;
  }

  // After a tag's arguments: its block end, the body up to one of `ends`, and that end tag's name.
  Body statements(const Ends& ends, bool drop_needle) {
    skip_op(":");
    expect(T::BlockEnd);
    Body body = subparse(ends);
    if (cur().type == T::Eof) {
      end_stack_.push_back(ends);
      fail_unknown(nullptr, cur().line);
    }
    if (drop_needle) ++i_;
    return body;
  }

  static StmtPtr stmt(StmtKind k, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = k;
    s->line = line;
    return s;
  }

  StmtPtr parse_statement() {
    const Token& t = cur();
    if (t.type != T::Name) error("tag name expected");
    const std::string name = t.text;
    static const std::set<std::string> unsupported = {"block",  "extends", "include",
                                                      "import", "from",    "autoescape"};
    if (unsupported.count(name))
      error(
          fmt::format("tag '{}' is not supported by rig's template engine (no template inheritance "
                      "or includes)",
                      name));
    static const std::set<std::string> known = {"for",   "if",       "set",       "macro",
                                                "call",  "filter",   "with",      "print",
                                                "break", "continue", "generation"};
    if (!known.count(name)) fail_unknown(&name, t.line);
    tag_stack_.push_back(name);
    StmtPtr s;
    if (name == "for")
      s = parse_for();
    else if (name == "if")
      s = parse_if();
    else if (name == "set")
      s = parse_set();
    else if (name == "macro")
      s = parse_macro();
    else if (name == "call")
      s = parse_call_block();
    else if (name == "filter")
      s = parse_filter_block();
    else if (name == "with")
      s = parse_with();
    else if (name == "print")
      s = parse_print();
    else if (name == "generation")
      s = parse_generation();
    else
      s = parse_loop_control();
    tag_stack_.pop_back();
    return s;
  }

  StmtPtr parse_for() {
    auto s = stmt(StmtKind::For, next().line);
    s->target = parse_assign_target(true, false, {"in"});
    expect_name("in");
    s->expr = parse_tuple(false, false, {"recursive"});
    if (skip_name("if")) s->filter = parse_expression();
    if (is_name("recursive")) error("recursive loops are not supported by rig's template engine");
    ++loop_depth_;
    s->body = statements({"endfor", "else"}, false);
    --loop_depth_;
    if (next().text == "else") s->else_body = statements({"endfor"}, true);
    return s;
  }

  StmtPtr parse_if() {
    auto s = stmt(StmtKind::If, next().line);
    while (true) {
      s->conds.push_back(parse_tuple(false, false));
      s->bodies.push_back(statements({"elif", "else", "endif"}, false));
      const Token& t = next();
      if (t.text == "elif") continue;
      if (t.text == "else") s->else_body = statements({"endif"}, true);
      break;
    }
    return s;
  }

  StmtPtr parse_set() {
    int line = next().line;
    ExprPtr target = parse_assign_target(true, false, {}, true);
    if (skip_op("=")) {
      auto s = stmt(StmtKind::Set, line);
      s->target = std::move(target);
      s->expr = parse_tuple();
      return s;
    }
    auto s = stmt(StmtKind::SetBlock, line);
    if (target->kind != ExprKind::Name && target->kind != ExprKind::NSRef)
      error("can't assign a block to a tuple", line);
    s->target = std::move(target);
    s->filter = parse_filter(nullptr);
    s->body = statements({"endset"}, true);
    return s;
  }

  void parse_signature(Stmt& s) {
    expect_op("(");
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      s.params.push_back(expect_name());
      if (skip_op("="))
        s.defaults.push_back(parse_expression());
      else if (!s.defaults.empty())
        error("non-default argument follows default argument");
    }
    expect_op(")");
  }

  StmtPtr parse_macro() {
    auto s = stmt(StmtKind::Macro, next().line);
    s->name = expect_name();
    parse_signature(*s);
    int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = statements({"endmacro"}, true);
    loop_depth_ = saved;
    return s;
  }

  StmtPtr parse_call_block() {
    auto s = stmt(StmtKind::CallBlock, next().line);
    if (is_op("(")) parse_signature(*s);
    s->expr = parse_expression();
    if (s->expr->kind != ExprKind::Call) error("expected call", s->line);
    s->body = statements({"endcall"}, true);
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = stmt(StmtKind::FilterBlock, next().line);
    s->filter = parse_filter(nullptr, true);
    s->body = statements({"endfilter"}, true);
    return s;
  }

  StmtPtr parse_with() {
    auto s = stmt(StmtKind::With, next().line);
    while (cur().type != T::BlockEnd) {
      if (!s->targets.empty()) expect_op(",");
      s->targets.push_back(parse_assign_target());
      expect_op("=");
      s->values.push_back(parse_expression());
    }
    s->body = statements({"endwith"}, true);
    return s;
  }

  StmtPtr parse_print() {
    auto s = stmt(StmtKind::Print, next().line);
    auto cat = expr(ExprKind::Concat, s->line);
    while (cur().type != T::BlockEnd) {
      if (!cat->items.empty()) expect_op(",");
      cat->items.push_back(parse_expression());
    }
    s->expr = std::move(cat);
    return s;
  }

  StmtPtr parse_generation() {
    auto s = stmt(StmtKind::Generation, next().line);
    prog_.has_generation = true;
    s->body = statements({"endgeneration"}, true);
    return s;
  }

  StmtPtr parse_loop_control() {
    const Token& t = next();
    if (loop_depth_ == 0) error(fmt::format("'{}' outside of a loop", t.text), t.line);
    return stmt(t.text == "break" ? StmtKind::Break : StmtKind::Continue, t.line);
  }

  // ---- expressions ----

  static ExprPtr expr(ExprKind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  ExprPtr parse_assign_target(bool with_tuple = true, bool name_only = false,
                              const Ends& extra_end = {}, bool with_namespace = false) {
    ExprPtr target;
    if (name_only) {
      int line = cur().line;
      target = expr(ExprKind::Name, line);
      target->name = expect_name();
    } else if (with_tuple) {
      target = parse_tuple(true, true, extra_end, false, with_namespace);
    } else {
      target = parse_primary(with_namespace);
    }
    check_target(*target);
    return target;
  }

  void check_target(const Expr& e) {
    if (e.kind == ExprKind::Name || e.kind == ExprKind::NSRef) return;
    if (e.kind == ExprKind::Tuple) {
      for (const auto& x : e.items) check_target(*x);
      return;
    }
    error(fmt::format("can't assign to '{}'", e.kind == ExprKind::Const ? "const" : "expression"),
          e.line);
  }

  ExprPtr parse_expression(bool with_condexpr = true) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    int line = cur().line;
    ExprPtr e1 = parse_or();
    while (skip_name("if")) {
      auto c = expr(ExprKind::Cond, line);
      c->a = parse_or();
      c->b = std::move(e1);
      if (skip_name("else")) c->c = parse_condexpr();
      e1 = std::move(c);
      line = cur().line;
    }
    return e1;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      auto e = expr(ExprKind::Or, next().line);
      e->a = std::move(left);
      e->b = parse_and();
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      auto e = expr(ExprKind::And, next().line);
      e->a = std::move(left);
      e->b = parse_not();
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto e = expr(ExprKind::Not, next().line);
      e->a = parse_not();
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = cur().line;
    ExprPtr first = parse_math1();
    auto cmp = expr(ExprKind::Compare, line);
    while (true) {
      if (cur().type == T::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                  cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        cmp->ops.push_back(next().text);
      } else if (is_name("in")) {
        ++i_;
        cmp->ops.push_back("in");
      } else if (is_name("not") && look().type == T::Name && look().text == "in") {
        i_ += 2;
        cmp->ops.push_back("not in");
      } else {
        break;
      }
      cmp->items.push_back(parse_math1());
    }
    if (cmp->ops.empty()) return first;
    cmp->a = std::move(first);
    return cmp;
  }

  ExprPtr binary_chain(ExprPtr (Parser::*operand)(), std::initializer_list<const char*> ops) {
    ExprPtr left = (this->*operand)();
    while (cur().type == T::Op &&
           std::any_of(ops.begin(), ops.end(), [&](const char* o) { return cur().text == o; })) {
      auto e = expr(ExprKind::Binary, cur().line);
      e->name = next().text;
      e->a = std::move(left);
      e->b = (this->*operand)();
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_math1() { return binary_chain(&Parser::parse_concat, {"+", "-"}); }

  ExprPtr parse_concat() {
    int line = cur().line;
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto cat = expr(ExprKind::Concat, line);
    cat->items.push_back(std::move(first));
    while (skip_op("~")) cat->items.push_back(parse_math2());
    return cat;
  }

  ExprPtr parse_math2() { return binary_chain(&Parser::parse_pow, {"*", "/", "//", "%"}); }
  ExprPtr parse_pow() { return binary_chain(&Parser::parse_unary_filtered, {"**"}); }
  ExprPtr parse_unary_filtered() { return parse_unary(true); }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = expr(is_op("-") ? ExprKind::Neg : ExprKind::Pos, cur().line);
      ++i_;
      node->a = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary(bool with_namespace = false) {
    const Token& t = cur();
    int line = t.line;
    if (t.type == T::Name) {
      ++i_;
      if (t.text == "true" || t.text == "false" || t.text == "True" || t.text == "False") {
        auto e = expr(ExprKind::Const, line);
        e->value = Value(t.text == "true" || t.text == "True");
        return e;
      }
      if (t.text == "none" || t.text == "None") {
        auto e = expr(ExprKind::Const, line);
        e->value = Value::none();
        return e;
      }
      if (with_namespace && is_op(".")) {
        ++i_;
        auto e = expr(ExprKind::NSRef, line);
        e->name = t.text;
        e->attr = expect_name();
        return e;
      }
      auto e = expr(ExprKind::Name, line);
      e->name = t.text;
      return e;
    }
    if (t.type == T::String) {
      std::string s;
      while (cur().type == T::String) s += next().value.str();
      auto e = expr(ExprKind::Const, line);
      e->value = Value(std::move(s));
      return e;
    }
    if (t.type == T::Integer || t.type == T::Float) {
      auto e = expr(ExprKind::Const, line);
      e->value = next().value;
      return e;
    }
    if (is_op("(")) {
      ++i_;
      ExprPtr e = parse_tuple(false, true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++i_;
      auto e = expr(ExprKind::List, line);
      while (!is_op("]")) {
        if (!e->items.empty()) expect_op(",");
        if (is_op("]")) break;
        e->items.push_back(parse_expression());
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      ++i_;
      auto e = expr(ExprKind::Dict, line);
      while (!is_op("}")) {
        if (!e->items.empty()) expect_op(",");
        if (is_op("}")) break;
        e->items.push_back(parse_expression());
        expect_op(":");
        e->items.push_back(parse_expression());
      }
      expect_op("}");
      return e;
    }
    if (t.type == T::Eof) error("unexpected end of template");
    error(fmt::format("unexpected '{}'", describe(t)));
  }

  bool is_tuple_end(const Ends& extra_end) const {
    if (cur().type == T::VarEnd || cur().type == T::BlockEnd || is_op(")")) return true;
    return cur().type == T::Name &&
           std::find(extra_end.begin(), extra_end.end(), cur().text) != extra_end.end();
  }

  ExprPtr parse_tuple(bool simplified = false, bool with_condexpr = true,
                      const Ends& extra_end = {}, bool explicit_parentheses = false,
                      bool with_namespace = false) {
    int line = cur().line;
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      args.push_back(simplified ? parse_primary(with_namespace) : parse_expression(with_condexpr));
      if (is_op(","))
        is_tuple = true;
      else
        break;
      line = cur().line;
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parentheses)
        error(fmt::format("Expected an expression, got '{}'", describe(cur())));
    }
    auto e = expr(ExprKind::Tuple, line);
    e->items = std::move(args);
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("["))
        node = parse_subscript(std::move(node));
      else if (is_op("("))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|"))
        node = parse_filter(std::move(node));
      else if (is_name("is"))
        node = parse_test(std::move(node));
      else if (is_op("("))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& t = next();
    if (t.text == ".") {
      const Token& a = next();
      if (a.type == T::Name) {
        auto e = expr(ExprKind::Getattr, t.line);
        e->a = std::move(node);
        e->attr = a.text;
        return e;
      }
      if (a.type != T::Integer) error("expected name or number", a.line);
      auto e = expr(ExprKind::Getitem, t.line);
      e->a = std::move(node);
      e->b = expr(ExprKind::Const, a.line);
      e->b->value = a.value;
      return e;
    }
    std::vector<ExprPtr> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    auto e = expr(ExprKind::Getitem, t.line);
    e->a = std::move(node);
    if (args.size() == 1) {
      e->b = std::move(args[0]);
    } else {
      e->b = expr(ExprKind::Tuple, t.line);
      e->b->items = std::move(args);
    }
    return e;
  }

  ExprPtr parse_subscribed() {
    int line = cur().line;
    std::vector<ExprPtr> args;
    if (skip_op(":")) {
      args.push_back(nullptr);
    } else {
      ExprPtr node = parse_expression();
      if (!skip_op(":")) return node;
      args.push_back(std::move(node));
    }
    if (is_op(":") || is_op("]") || is_op(","))
      args.push_back(nullptr);
    else
      args.push_back(parse_expression());
    if (skip_op(":")) {
      if (is_op("]") || is_op(","))
        args.push_back(nullptr);
      else
        args.push_back(parse_expression());
    } else {
      args.push_back(nullptr);
    }
    auto e = expr(ExprKind::Slice, line);
    e->items = std::move(args);
    return e;
  }

  void parse_call_args(Expr& e) {
    int line = cur().line;
    expect_op("(");
    bool require_comma = false;
    auto ensure = [&](bool ok) {
      if (!ok) error("invalid syntax for function call expression", line);
    };
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (skip_op("*")) {
        ensure(!e.dyn_args && !e.dyn_kwargs);
        e.dyn_args = parse_expression();
      } else if (skip_op("**")) {
        ensure(!e.dyn_kwargs);
        e.dyn_kwargs = parse_expression();
      } else if (cur().type == T::Name && look().type == T::Op && look().text == "=") {
        ensure(!e.dyn_kwargs);
        std::string key = next().text;
        ++i_;
        e.kwargs.emplace_back(key, parse_expression());
      } else {
        ensure(!e.dyn_args && !e.dyn_kwargs && e.kwargs.empty());
        e.items.push_back(parse_expression());
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = expr(ExprKind::Call, cur().line);
    e->a = std::move(node);
    parse_call_args(*e);
    return e;
  }

  std::string dotted_name() {
    std::string name = expect_name();
    while (skip_op(".")) name += "." + expect_name();
    return name;
  }

  ExprPtr parse_filter(ExprPtr node, bool start_inline = false) {
    while (is_op("|") || start_inline) {
      if (!start_inline) ++i_;
      int line = cur().line;
      auto e = expr(ExprKind::Filter, line);
      e->name = dotted_name();
      if (!find_filter(e->name)) error(fmt::format("No filter named '{}'.", e->name), line);
      if (is_op("(")) parse_call_args(*e);
      e->a = std::move(node);
      node = std::move(e);
      start_inline = false;
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    int line = next().line;
    bool negated = skip_name("not");
    auto e = expr(ExprKind::Test, line);
    e->name = dotted_name();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((cur().type == T::Name || cur().type == T::String || cur().type == T::Integer ||
                cur().type == T::Float || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error("You cannot chain multiple tests with is");
      e->items.push_back(parse_postfix(parse_primary()));
    }
    if (!find_test(e->name)) error(fmt::format("No test named '{}'.", e->name), line);
    e->a = std::move(node);
    if (!negated) return e;
    auto n = expr(ExprKind::Not, line);
    n->a = std::move(e);
    return n;
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  Program& prog_;
  std::vector<Ends> end_stack_;
  std::vector<std::string> tag_stack_;
  int loop_depth_ = 0;
};

}  // namespace

Program parse(std::string_view source, const std::string& name) {
  Program prog;
  prog.name = name;
  Lexer lexer(source, prog.name);
  Parser parser(lexer.run(), prog);
  prog.body = parser.parse_template();
  return prog;
}

}  // namespace rig::jinja::detail
