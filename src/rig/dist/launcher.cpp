#include "rig/dist/launcher.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

namespace rig::dist {

using Clock = std::chrono::steady_clock;

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("socket(): {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    int e = errno;
    ::close(fd);
    fail("cannot find a free port: {}", std::strerror(e));
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

void parse_master(const std::string& s, LaunchOptions& opts) {
  size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size())
    bad_input("--master '{}': expected HOST:PORT", s);
  opts.master_addr = s.substr(0, colon);
  try {
    size_t used = 0;
    opts.master_port = std::stoi(s.substr(colon + 1), &used);
    if (used != s.size() - colon - 1 || opts.master_port <= 0 || opts.master_port > 65535) throw 0;
  } catch (...) {
    bad_input("--master '{}': '{}' is not a TCP port", s, s.substr(colon + 1));
  }
}

std::vector<std::string> strip_launch_flags(const std::vector<std::string>& argv) {
  static const char* flags[] = {"--nproc-per-node", "--nnodes", "--node-rank", "--master", "--launch-grace-ms"};
  std::vector<std::string> out;
  for (size_t i = 0; i < argv.size(); i++) {
    bool skip = false;
    for (const char* f : flags) {
      if (argv[i] == f) {
        skip = true;
        i++;  // and its value
        break;
      }
      if (argv[i].rfind(std::string(f) + "=", 0) == 0) {
        skip = true;
        break;
      }
    }
    if (!skip) out.push_back(argv[i]);
  }
  return out;
}

std::vector<std::string> self_argv_without_launch_flags() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> argv;
  size_t start = 0;
  for (size_t i = 0; i < all.size(); i++)
    if (all[i] == '\0') {
      argv.push_back(all.substr(start, i - start));
      start = i + 1;
    }
  return strip_launch_flags(argv);
}

bool launched_worker() {
  const char* v = std::getenv("RIG_LAUNCHED");
  return v && std::string(v) == "1";
}

namespace {

struct Child {
  int rank;
  pid_t pid;
  bool running = true;
  int status = 0;
};

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int s = WTERMSIG(status);
    return fmt::format("was killed by signal {} ({})", s, strsignal(s));
  }
  return "stopped";
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The environment of each local worker: this process's, extra_env, and the torchrun-style
// variables of its rank, as "KEY=value" strings.
std::vector<std::vector<std::string>> worker_envs(const LaunchOptions& o, int port,
                                                  const EnvMap& extra_env) {
  int world = o.nproc_per_node * o.nnodes;
  EnvMap base = process_env();
  for (auto& [k, v] : extra_env) base[k] = v;
  base["WORLD_SIZE"] = std::to_string(world);
  base["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc_per_node);
  base["NNODES"] = std::to_string(o.nnodes);
  base["GROUP_RANK"] = std::to_string(o.node_rank);
  base["MASTER_ADDR"] = o.master_addr;
  base["MASTER_PORT"] = std::to_string(port);
  base["RIG_LAUNCHED"] = std::string(1, '1');  // (a literal trips GCC 12's -Wrestrict bug)
  std::vector<std::vector<std::string>> envs;
  for (int l = 0; l < o.nproc_per_node; l++) {
    EnvMap e = base;
    e["RANK"] = std::to_string(o.node_rank * o.nproc_per_node + l);
    e["LOCAL_RANK"] = std::to_string(l);
    std::vector<std::string> flat;
    for (auto& [k, v] : e) flat.push_back(k + "=" + v);
    envs.push_back(std::move(flat));
  }
  return envs;
}

// Forks and execs one worker per local rank (signals blocked; `old` is the mask they get back).
// A failed fork kills the ones already started and throws.
std::vector<Child> fork_workers(const LaunchOptions& o, const std::string& exe,
                                std::vector<char*>& args,
                                const std::vector<std::vector<std::string>>& envs,
                                const sigset_t& old) {
  pid_t parent = getpid();
  std::vector<Child> kids;
  for (int l = 0; l < o.nproc_per_node; l++) {
    std::vector<char*> envp;
    for (auto& s : envs[size_t(l)]) envp.push_back(const_cast<char*>(s.c_str()));
    envp.push_back(nullptr);
    pid_t pid = fork();
    if (pid < 0) {
      int e = errno;
      for (auto& k : kids) ::kill(k.pid, SIGKILL);
      for (auto& k : kids) ::waitpid(k.pid, nullptr, 0);
      pthread_sigmask(SIG_SETMASK, &old, nullptr);
      fail("launch: fork() failed: {}", std::strerror(e));
    }
    if (pid == 0) {
      // Workers die with the launcher, even if it is SIGKILLed.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      pthread_sigmask(SIG_SETMASK, &old, nullptr);
      execve(exe.c_str(), args.data(), envp.data());
      const char msg[] = "rig launch: exec failed\n";
      [[maybe_unused]] auto w = write(2, msg, sizeof(msg) - 1);
      _exit(127);
    }
    kids.push_back({o.node_rank * o.nproc_per_node + l, pid});
  }
  return kids;
}

// Waits for the workers: passes SIGINT/SIGTERM on, and when one fails gives the others o.grace,
// then SIGTERM, then SIGKILL. Returns the launcher's exit code; `failed`: a worker failed first.
int supervise(std::vector<Child>& kids, const sigset_t& mask, const LaunchOptions& o,
              bool& failed) {
  int result = 0;
  int interrupted = 0;
  Clock::time_point term_at = Clock::time_point::max(), kill_at = Clock::time_point::max();
  auto running = [&] {
    int n = 0;
    for (auto& k : kids) n += k.running;
    return n;
  };
  auto signal_all = [&](int sig) {
    for (auto& k : kids)
      if (k.running) ::kill(k.pid, sig);
  };
  while (running() > 0) {
    timespec ts{0, 100 * 1000 * 1000};
    int sig = sigtimedwait(&mask, nullptr, &ts);
    if (sig == SIGINT || sig == SIGTERM) {
      if (!interrupted) {
        std::fprintf(stderr, "rig launch: got %s, passing it to %d workers\n", strsignal(sig), running());
        interrupted = sig;
        result = 128 + sig;
        kill_at = Clock::now() + std::chrono::seconds(10);
      }
      signal_all(sig);
    }
    // Reap everything that ended since the last look. When several failed at once, the one a
    // signal killed is the likely cause (the others exit after noticing it).
    Child* first = nullptr;
    for (auto& k : kids) {
      if (!k.running) continue;
      int st = 0;
      pid_t r = ::waitpid(k.pid, &st, WNOHANG);
      if (r != k.pid) continue;
      k.running = false;
      k.status = st;
      bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      if (!ok && (!first || (WIFSIGNALED(st) && !WIFSIGNALED(first->status)))) first = &k;
    }
    if (first && !failed && !interrupted) {
      failed = true;
      result = exit_code(first->status);
      std::fprintf(stderr, "rig launch: rank %d (pid %d) %s; stopping the other %d worker(s)\n", first->rank,
                   int(first->pid), describe(first->status).c_str(), running());
      term_at = Clock::now() + o.grace;
    }
    auto now = Clock::now();
    if (now >= term_at && running() > 0) {
      std::fprintf(stderr, "rig launch: %d worker(s) still running after %lld ms, sending SIGTERM\n", running(),
                   (long long)o.grace.count());
      signal_all(SIGTERM);
      term_at = Clock::time_point::max();
      kill_at = now + std::chrono::seconds(5);
    }
    if (now >= kill_at && running() > 0) {
      signal_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
  }
  return result;
}

}  // namespace

int launch_local(const LaunchOptions& o, const std::vector<std::string>& argv,
                 const EnvMap& extra_env) {
  if (o.nproc_per_node < 1) bad_input("--nproc-per-node {} must be at least 1", o.nproc_per_node);
  if (o.nnodes < 1) bad_input("--nnodes {} must be at least 1", o.nnodes);
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    bad_input("--node-rank {} is outside 0..{}", o.node_rank, o.nnodes - 1);
  if (argv.empty()) fail("launch: empty command");
  int port = o.master_port;
  if (port == 0) {
    if (o.nnodes > 1)
      port = 29500;
    else
      port = free_port();
  }
  std::string exe = o.exe.empty() ? "/proc/self/exe" : o.exe;

  // Everything the child needs is built before fork: only exec-safe calls after it.
  const std::vector<std::vector<std::string>> envs = worker_envs(o, port, extra_env);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  sigset_t mask, old;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &mask, &old);

  std::vector<Child> kids = fork_workers(o, exe, args, envs, old);
  bool failed = false;
  const int result = supervise(kids, mask, o, failed);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (failed) {
    for (auto& k : kids)
      if (!(WIFEXITED(k.status) && WEXITSTATUS(k.status) == 0))
        std::fprintf(stderr, "rig launch:   rank %d %s\n", k.rank, describe(k.status).c_str());
  }
  return result;
}

}  // namespace rig::dist
