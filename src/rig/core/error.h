// Errors carry context: the file, tensor, line or offset, and what was expected.
// Library code throws rig::Error; the CLI prints its message as one line and exits non-zero.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace rig {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Raised for bad user input (files, configs, flags) as opposed to internal failures.
class InputError : public Error {
 public:
  using Error::Error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void bad_input(fmt::format_string<Args...> f, Args&&... args) {
  throw InputError(fmt::format(f, std::forward<Args>(args)...));
}

// The rank recorded in error messages of collective and device calls (-1: not distributed).
int current_rank();
void set_current_rank(int rank);

// Formats "statement failed at file:line (rank N): detail".
std::string call_site(const char* stmt, const char* file, int line, const std::string& detail);

}  // namespace rig

#define RIG_CHECK(cond, ...)                                                    \
  do {                                                                          \
    if (!(cond)) ::rig::fail("{}", ::rig::call_site(#cond, __FILE__, __LINE__, \
                                                    fmt::format(__VA_ARGS__))); \
  } while (0)
