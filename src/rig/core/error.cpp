#include "rig/core/error.h"

#include <atomic>

namespace rig {

namespace {
std::atomic<int> g_rank{-1};
}

int current_rank() { return g_rank.load(); }
void set_current_rank(int rank) { g_rank.store(rank); }

std::string call_site(const char* stmt, const char* file, int line, const std::string& detail) {
  std::string where = fmt::format("{}:{}", file, line);
  if (current_rank() >= 0) where += fmt::format(" (rank {})", current_rank());
  return fmt::format("{}: `{}` failed at {}", detail, stmt, where);
}

}  // namespace rig
