#include "flags.h"

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <functional>
#include <ostream>
#include <string_view>

namespace rig::cli {

namespace {

// A bound as the messages print it: whole numbers in full, the rest in the shortest form.
std::string num_text(long double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e19L) {
    if (v < 0) return fmt::format("{}", static_cast<long long>(v));
    return fmt::format("{}", static_cast<unsigned long long>(v));
  }
  return fmt::format("{}", static_cast<double>(v));
}

// The range with whole-number ends (closed) for an integer flag.
Range effective(const Range& r, const NumberType& t) {
  Range e = r;
  if (!t.whole) return e;
  if (std::isfinite(e.lo)) {
    const double f = std::floor(e.lo);
    e.lo = (f == e.lo && !e.lo_open) ? f : f + 1;
    e.lo_open = false;
  }
  if (std::isfinite(e.hi)) {
    const double c = std::ceil(e.hi);
    e.hi = (c == e.hi && !e.hi_open) ? c : c - 1;
    e.hi_open = false;
  }
  return e;
}

bool inside(long double v, const Range& e) {
  return (e.lo_open ? v > e.lo : v >= e.lo) && (e.hi_open ? v < e.hi : v <= e.hi);
}

// The number `text` holds: whole numbers exactly (also "1e3" and "2.0"); nothing when the text is
// not a finite number, or not a whole one for an integer flag.
std::optional<long double> parse_number(const std::string& text, bool whole) {
  if (text.empty()) return std::nullopt;
  if (whole) {
    std::string_view v = text;
    if (v.front() == '+') v.remove_prefix(1);
    long long x = 0;
    auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec == std::errc() && p == v.data() + v.size()) return static_cast<long double>(x);
    unsigned long long u = 0;
    auto [q, ec2] = std::from_chars(v.data(), v.data() + v.size(), u);
    if (ec2 == std::errc() && q == v.data() + v.size()) return static_cast<long double>(u);
  }
  char* end = nullptr;
  errno = 0;
  const double d = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(d)) return std::nullopt;
  if (whole && d != std::floor(d)) return std::nullopt;
  return d;
}

std::string interval(const Range& e) {
  return fmt::format("{}{}, {}{}", e.lo_open ? "(" : "[", num_text(e.lo), num_text(e.hi),
                     e.hi_open ? ")" : "]");
}

std::string also_text(const Range& e) {
  if (!e.also) return "";
  return num_text(*e.also) + (e.also_means.empty() ? "" : " (" + e.also_means + ")") + " or ";
}

}  // namespace

std::string describe(const Range& r, const NumberType& t) {
  const Range e = effective(r, t);
  const std::string kind = t.whole ? "a whole number" : "a finite number";
  const bool lo = std::isfinite(e.lo), hi = std::isfinite(e.hi);
  std::string s = kind;
  if (lo && hi)
    s += t.whole ? fmt::format(" from {} to {}", num_text(e.lo), num_text(e.hi))
                 : " in " + interval(e);
  else if (lo)
    s += fmt::format(" {} {}", e.lo_open ? ">" : ">=", num_text(e.lo));
  else if (hi)
    s += fmt::format(" {} {}", e.hi_open ? "<" : "<=", num_text(e.hi));
  return also_text(e) + s;
}

std::string describe_short(const Range& r, const NumberType& t) {
  const Range e = effective(r, t);
  const bool lo = std::isfinite(e.lo), hi = std::isfinite(e.hi);
  std::string s;
  if (lo && hi)
    s = interval(e);
  else if (lo)
    s = fmt::format("{} {}", e.lo_open ? ">" : ">=", num_text(e.lo));
  else if (hi)
    s = fmt::format("{} {}", e.hi_open ? "<" : "<=", num_text(e.hi));
  else
    s = "finite";
  return e.also ? num_text(*e.also) + " or " + s : s;
}

std::string check_number(std::string& text, const Range& r, const NumberType& t) {
  const std::optional<long double> v = parse_number(text, t.whole);
  const Range e = effective(r, t);
  if (!v || !(inside(*v, e) || (e.also && *v == *e.also)))
    return fmt::format("must be {}, got {}", describe(r, t), text);
  // In range for the flag, but not representable in the variable (an int flag given 1e10).
  if (*v < t.lo || *v > t.hi)
    return fmt::format("must be {} and at most {}, got {}", describe(r, t), num_text(t.hi), text);
  if (t.whole) text = num_text(*v);  // plain decimal: CLI11 reads "010" as octal, "1e3" not at all
  return "";
}

CLI::Validator number_validator(const Range& r, const NumberType& t) {
  return CLI::Validator([r, t](std::string& text) { return check_number(text, r, t); },
                        describe_short(r, t), "NUMBER");
}

// ---- sizes -----------------------------------------------------------------------------------

std::optional<double> parse_size(const std::string& text, bool binary) {
  const std::string& s = text;
  const auto digit = [&](size_t k) { return k < s.size() && s[k] >= '0' && s[k] <= '9'; };
  size_t i = 0;
  bool any_digit = false;
  while (i < s.size() && (digit(i) || s[i] == '.')) any_digit |= digit(i++);
  if (!any_digit) return std::nullopt;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E') &&
      (digit(i + 1) || ((s[i + 1] == '+' || s[i + 1] == '-') && digit(i + 2)))) {
    i += 2;
    while (digit(i)) ++i;
  }
  const std::string num = s.substr(0, i);
  std::string unit = s.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || !std::isfinite(v)) return std::nullopt;
  struct Unit {
    const char* name;
    double decimal, binary;
  };
  static const Unit units[] = {{"", 1, 1},
                               {"B", 1, 1},
                               {"K", 1e3, 0x1p10},
                               {"KB", 1e3, 0x1p10},
                               {"KiB", 0x1p10, 0x1p10},
                               {"M", 1e6, 0x1p20},
                               {"MB", 1e6, 0x1p20},
                               {"MiB", 0x1p20, 0x1p20},
                               {"G", 1e9, 0x1p30},
                               {"GB", 1e9, 0x1p30},
                               {"GiB", 0x1p30, 0x1p30},
                               {"T", 1e12, 0x1p40},
                               {"TB", 1e12, 0x1p40},
                               {"TiB", 0x1p40, 0x1p40}};
  for (const auto& u : units)
    if (unit == u.name) {
      const double bytes = v * (binary ? u.binary : u.decimal);
      if (!std::isfinite(bytes)) return std::nullopt;
      return bytes;
    }
  return std::nullopt;
}

namespace {

std::string size_text(double bytes) {
  static const std::pair<const char*, double> units[] = {
      {"PiB", 0x1p50}, {"TiB", 0x1p40}, {"GiB", 0x1p30}, {"MiB", 0x1p20}, {"KiB", 0x1p10}};
  for (const auto& [name, mult] : units)
    if (bytes >= mult && std::fmod(bytes, mult) == 0)
      return fmt::format("{} {}", bytes / mult, name);
  return fmt::format("{} B", bytes);
}

}  // namespace

CLI::Validator size_validator(const SizeRule& r) {
  const std::string range = fmt::format("{} to {}", size_text(r.min), size_text(r.max));
  return CLI::Validator(
      [r, range](std::string& text) -> std::string {
        const std::optional<double> v = parse_size(text, r.binary);
        if (!v || *v < r.min || *v > r.max)
          return fmt::format("must be a size from {} (e.g. {}), got {}", range,
                             r.binary ? "4096, 64K, 256M, 1G" : "4096, 512MiB, 22GiB, 1.5GB", text);
        text = fmt::format("{:.0f}", std::round(*v));
        return "";
      },
      range, "SIZE");
}

// ---- messages and the list of flags
// ---------------------------------------------------------------

std::string failure_message(const CLI::App* app, const CLI::Error& e) {
  std::string path = "rig";
  for (const CLI::App* a = app;;) {
    const auto subs = a->get_subcommands();
    if (subs.empty()) break;
    a = subs.front();
    path += " " + a->get_name();
  }
  std::string what = e.what();
  // A check of this file reads "--flag: must be ..." in CLI11's words: "--flag must be ...".
  const size_t p = what.find(": must be ");
  if (p != std::string::npos && what.rfind("-", 0) == 0 && what.find(' ') > p)
    return fmt::format("{}: {}{}\n", path, what.substr(0, p), what.substr(p + 1));
  return fmt::format("{}: {} (see {} --help)\n", path, what, path);
}

namespace {

bool has_validator(CLI::Option* o, const std::string& name) {
  try {
    return o->get_validator(name) != nullptr;
  } catch (const CLI::OptionNotFound&) {
    return false;
  }
}

void list_app(const CLI::App& app, const std::string& path, std::ostream& out) {
  auto& a = const_cast<CLI::App&>(app);  // CLI11 2.1 looks validators up on non-const options
  for (CLI::Option* o : a.get_options()) {
    if (o->get_type_size_max() == 0) continue;  // a flag
    std::string type = o->get_type_name();
    type = type.substr(0, type.find(':'));
    const bool checked = has_validator(o, "NUMBER") || has_validator(o, "SIZE");
    if (!checked && type != "INT" && type != "UINT" && type != "FLOAT" && type != "NUMBER")
      continue;
    std::string name = !o->get_lnames().empty()   ? "--" + o->get_lnames().front()
                       : !o->get_snames().empty() ? "-" + o->get_snames().front()
                                                  : o->get_single_name();
    out << path << "\t" << name << "\t" << type << "\t" << (checked ? "checked" : "unchecked")
        << "\n";
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    list_app(*sub, path.empty() ? sub->get_name() : path + " " + sub->get_name(), out);
}

}  // namespace

void list_numeric_flags(const CLI::App& app, std::ostream& out) {
  list_app(app, "", out);
}

}  // namespace rig::cli
