// The launcher flags a distributed subcommand takes (--nproc-per-node, --nnodes, --node-rank,
// --master) and the relaunch they trigger: the command re-runs itself as N workers through
// rig::dist::launch_local, and each worker finds its rank in the environment.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "rig/dist/launcher.h"

namespace rig::cli {

struct LaunchFlags {
  int nproc = 0;  // 0: not given
  int nnodes = 1;
  int node_rank = 0;
  std::string master;
  int grace_ms = 15000;

  void add(CLI::App& app) {
    app.add_option("--nproc-per-node", nproc, "launch this many workers on this node (one per GPU)");
    app.add_option("--nnodes", nnodes, "number of nodes (one launcher per node)");
    app.add_option("--node-rank", node_rank, "this node's index, 0..nnodes-1");
    app.add_option("--master", master, "HOST:PORT of node 0's rendezvous (needed with --nnodes > 1)");
    app.add_option("--launch-grace-ms", grace_ms,
                   "after a worker fails, how long the others get to report before they are stopped");
  }
  // True when this process should launch workers instead of doing the work itself.
  bool wants_launch() const { return !dist::launched_worker() && (nproc > 0 || nnodes > 1); }
  int relaunch() const {
    dist::LaunchOptions o;
    o.nproc_per_node = nproc > 0 ? nproc : 1;
    o.nnodes = nnodes;
    o.node_rank = node_rank;
    o.grace = dist::Millis(grace_ms);
    if (!master.empty()) dist::parse_master(master, o);
    else if (nnodes > 1) bad_input("--nnodes {} needs --master HOST:PORT (node 0's address)", nnodes);
    return dist::launch_local(o, dist::self_argv_without_launch_flags());
  }
};

}  // namespace rig::cli
