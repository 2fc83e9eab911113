// The one check every numeric command-line flag goes through, while the command line is parsed
// and before any work starts: the value must be a finite number (nan, inf and 1e400 are not), a
// whole number for an integer flag, inside the flag's range and the C++ type's. A failure is one
// line naming the flag, e.g. "rig plan: --efficiency must be a finite number in (0, 1], got nan",
// and a non-zero exit. Sizes ("256M", "22GiB") take the same path through add_size.
//
//   add_number(app, "--efficiency", in.efficiency, "achieved fraction", in_range(0, 1).open_low());
//   add_number(app, "--steps", o.steps, "timed steps", at_least(1));
//   add_size(app, "--max-bytes", a.max_bytes, "largest size", SizeRule{4, 0x1p34, true});
//
// `rig --list-numeric-flags` (hidden) prints every numeric option of every subcommand and whether
// it is checked here; tests/unit/cli_sweep_test.cpp sweeps them all with 0, -1, nan, inf, 1e30.
#pragma once
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <iosfwd>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

namespace rig::cli {

// The values a numeric flag takes: a range whose ends may be open or infinite, and optionally one
// more value outside it (0 meaning "off").
struct Range {
  double lo = -HUGE_VAL, hi = HUGE_VAL;
  bool lo_open = false, hi_open = false;
  std::optional<double> also;
  std::string also_means;  // what `also` means, for the message: "whole rows", "off"

  Range open_low() const {
    Range r = *this;
    r.lo_open = true;
    return r;
  }
  Range at_most(double h) const {
    Range r = *this;
    r.hi = h;
    r.hi_open = false;
    return r;
  }
  Range or_value(double v, std::string means = "") const {
    Range r = *this;
    r.also = v;
    r.also_means = std::move(means);
    return r;
  }
};

inline Range finite() {
  return {};
}
inline Range at_least(double lo) {
  Range r;
  r.lo = lo;
  return r;
}
// > 0 (>= 1 for integers)
inline Range positive() {
  return at_least(0).open_low();
}
inline Range in_range(double lo, double hi) {
  return at_least(lo).at_most(hi);
}

// The C++ type a flag is read into: integer or not, and its limits.
struct NumberType {
  bool whole = false;
  long double lo = 0, hi = 0;
};

template <typename T>
struct flag_value {
  using type = T;
};
template <typename T>
struct flag_value<std::optional<T>> {
  using type = T;
};

template <typename T>
NumberType number_type() {
  using V = typename flag_value<T>::type;
  static_assert(std::is_arithmetic_v<V> && !std::is_same_v<V, bool>, "add_number: not a number");
  if constexpr (std::is_floating_point_v<V> && sizeof(V) >= sizeof(double))
    return {false, -HUGE_VALL, HUGE_VALL};  // every finite number fits
  else
    return {std::is_integral_v<V>, static_cast<long double>(std::numeric_limits<V>::lowest()),
            static_cast<long double>(std::numeric_limits<V>::max())};
}

// "" when `text` is allowed (and then rewritten in plain decimal, so CLI11 reads exactly the value
// that was checked), else "must be <the allowed values>, got <text>".
std::string check_number(std::string& text, const Range& r, const NumberType& t);
// The allowed values in words, as the messages say them ("a whole number >= 1").
std::string describe(const Range& r, const NumberType& t);
// The same for --help ("(0, 1]", ">= 1").
std::string describe_short(const Range& r, const NumberType& t);

CLI::Validator number_validator(const Range& r, const NumberType& t);

template <typename T>
CLI::Option* add_number(CLI::App& app, const std::string& name, T& var, const std::string& help,
                        const Range& r) {
  return app.add_option(name, var, help)->transform(number_validator(r, number_type<T>()));
}

// A byte size: a number with an optional unit. Decimal units take K as 1000 and KiB as 1024 (as
// rig train's max_memory does); binary ones take K, KB and KiB all as 1024 (as nccl-tests does).
struct SizeRule {
  double min = 1, max = 0x1p50;  // bytes
  bool binary = false;
};
// Bytes, or nothing when `text` is not a finite non-negative size.
std::optional<double> parse_size(const std::string& text, bool binary);
CLI::Validator size_validator(const SizeRule& r);

// The option reads the size in bytes (the validator hands CLI11 the plain byte count).
template <typename T>
CLI::Option* add_size(CLI::App& app, const std::string& name, T& var, const std::string& help,
                      const SizeRule& r) {
  static_assert(std::is_arithmetic_v<T>, "add_size: not a number");
  return app.add_option(name, var, help)->transform(size_validator(r))->type_name("SIZE");
}

// The failure message of every command-line error: one line, "rig SUBCOMMAND: what".
std::string failure_message(const CLI::App* app, const CLI::Error& e);

// Every option of every subcommand that takes a number, one a line:
// "SUBCOMMAND\tFLAG\tTYPE\tchecked|unchecked" (TYPE: INT, UINT, FLOAT or SIZE).
void list_numeric_flags(const CLI::App& app, std::ostream& out);

}  // namespace rig::cli
