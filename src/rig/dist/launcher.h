// rig's own launcher (like torchrun): forks N workers of this same binary with RANK,
// LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, forwards SIGINT/SIGTERM to them, and
// when one fails, gives the others a short grace to report (they name the dead rank), then
// stops them. One launcher per node for multi-node runs.
#pragma once
#include <string>
#include <vector>

#include "rig/dist/env.h"
#include "rig/dist/store.h"

namespace rig::dist {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free local port (single node); 29500 when nnodes > 1
  // After the first worker fails, how long the others get to exit on their own before SIGTERM
  // (and 5 s later SIGKILL).
  Millis grace{std::chrono::seconds(15)};
  std::string exe;  // the program to run; empty: this binary (/proc/self/exe)
};

// Runs the workers with argv (argv[0] included) and waits for all. Returns 0 when every
// worker succeeded; otherwise the exit code of the first that failed (128 + signal for a
// signal), after printing "rig launch: rank R (pid P) exited with code C" to stderr. Meant
// for a single-threaded caller (the CLI): it blocks SIGINT/SIGTERM/SIGCHLD while it runs.
int launch_local(const LaunchOptions& opts, const std::vector<std::string>& argv, const EnvMap& extra_env = {});

// Parses "--master host:port" (port required).
void parse_master(const std::string& s, LaunchOptions& opts);

// This process's own command line (from /proc/self/cmdline) with the launcher flags
// (--nproc-per-node, --nnodes, --node-rank, --master, with their values) removed, so a command
// can relaunch itself as workers.
std::vector<std::string> self_argv_without_launch_flags();
std::vector<std::string> strip_launch_flags(const std::vector<std::string>& argv);

// True in a process started by launch_local (it sets RIG_LAUNCHED=1).
bool launched_worker();

// A free TCP port on this host (bound and released: fine for a launcher's rendezvous).
int free_port();

}  // namespace rig::dist
