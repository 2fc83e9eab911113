#pragma once
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

namespace rig::test {

// A path compiled in, unless the environment moves it (the GPU tests run from a bundle elsewhere).
inline std::string path_or_env(const char* name, const char* compiled) {
  const char* v = std::getenv(name);
  return v && *v ? v : compiled;
}
inline std::string data_path(const std::string& rel) {
  return path_or_env("RIG_TEST_DATA", RIG_TEST_DATA) + "/" + rel;
}
inline std::string source_dir() {
  return path_or_env("RIG_SOURCE_DIR", RIG_SOURCE_DIR);
}

// A fresh empty folder under the build tree, removed at the start of each use.
inline std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::path(path_or_env("RIG_BUILD_DIR", RIG_BUILD_DIR)) / "test-tmp" / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// The first 400 samples of the demo task: enough for a few training steps, quick to tokenize.
inline std::string small_data() {
  static const std::string path = [] {
    std::string dir = temp_dir("small_data");
    std::ifstream in(source_dir() + "/data/demo/reverse.jsonl");
    std::ofstream out(dir + "/reverse400.jsonl");
    std::string line;
    for (int i = 0; i < 400 && std::getline(in, line); ++i) out << line << "\n";
    return dir + "/reverse400.jsonl";
  }();
  return path;
}

// CI sets CI=true (.ci/run exports it): there a test whose asset is missing fails.
inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

// A test asset that is not committed (tokenizer.json files fetched by
// scripts/fetch-test-assets.sh) or not generated yet is missing: skip with the reason, or fail
// in CI, where a skip would hide that the test never ran. `msg` is a stream expression.
#define RIG_MISSING_ASSET(msg)                                                           \
  do {                                                                                   \
    if (::rig::test::in_ci())                                                            \
      GTEST_FAIL() << msg << " (CI=true: missing test assets fail instead of skipping)"; \
    else                                                                                 \
      GTEST_SKIP() << msg;                                                               \
  } while (0)

// The same for a program a test drives (headless chromium, which scripts/setup.sh installs)
// that is missing or cannot run here.
#define RIG_MISSING_TOOL(msg)                                                        \
  do {                                                                               \
    if (::rig::test::in_ci())                                                        \
      GTEST_FAIL() << msg << " (CI=true: a missing tool fails instead of skipping; " \
                   << "scripts/setup.sh installs it)";                               \
    else                                                                             \
      GTEST_SKIP() << msg;                                                           \
  } while (0)

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

// The harness of the tests that signal or kill a running rig.

// Starts `rig ARGS > LOG 2>&1` in the background (the shell execs rig: the pid is rig's).
inline pid_t spawn_rig(const std::string& args, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    std::string cmd = std::string(RIG_BINARY) + " " + args + " > " + log + " 2>&1";
    execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

// Waits for a child to end; its waitpid status.
inline int wait_status(pid_t pid) {
  int st = 0;
  waitpid(pid, &st, 0);
  return st;
}

// Waits for a child to end; its exit code as a shell gives it (128 + signal when killed).
inline int wait_exit(pid_t pid) {
  const int st = wait_status(pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Polls `ready` every 20 ms until it holds; false when it still does not after `seconds`. The
// tests wait for events this way (a file appears, a line is logged, a child ends), never for a
// fixed time: give a deadline generous enough for a loaded 2-core machine under the sanitizers.
template <class Pred>
bool wait_until(Pred ready, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    if (ready()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The whole file, or "" when it cannot be read.
inline std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Polls until `path` exists and is not empty (a run's metrics.jsonl: training runs); false
// after `seconds`.
inline bool wait_for_nonempty(const std::string& path, double seconds) {
  return wait_until(
      [&] {
        std::error_code ec;
        return std::filesystem::file_size(path, ec) > 0 && !ec;
      },
      seconds);
}

// Polls until the file at `path` contains `text` (a line a running rig logs); false after
// `seconds`.
inline bool wait_for_text(const std::string& path, const std::string& text, double seconds) {
  return wait_until([&] { return file_text(path).find(text) != std::string::npos; }, seconds);
}

// Waits up to `seconds` for a child to end: its exit code as wait_exit gives it, or -1 when it
// was still running (it is then killed with SIGKILL and reaped).
inline int wait_exit_within(pid_t pid, double seconds) {
  int st = 0;
  if (wait_until([&] { return waitpid(pid, &st, WNOHANG) == pid; }, seconds))
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return -1;
}

}  // namespace rig::test
