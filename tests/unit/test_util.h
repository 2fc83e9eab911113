#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

namespace rig::test {

inline std::string data_path(const std::string& rel) { return std::string(RIG_TEST_DATA) + "/" + rel; }

// A fresh empty folder under the build tree, removed at the start of each use.
inline std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::path(RIG_BUILD_DIR) / "test-tmp" / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

struct RunResult {
  int code = -1;
  std::string out;  // stdout and stderr together
};

// Runs the rig binary with `args` (a shell-quoted string).
inline RunResult run_rig(const std::string& args, const std::string& stdin_file = "") {
  std::string cmd = std::string(RIG_BINARY) + " " + args + " 2>&1";
  if (!stdin_file.empty()) cmd += " < " + stdin_file;
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

}  // namespace rig::test
