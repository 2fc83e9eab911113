// The launcher flags a distributed subcommand takes (--nproc-per-node, --nnodes, --node-rank,
// --master) and the relaunch they trigger: the command re-runs itself as N workers through
// rig::dist::launch_local, and each worker finds its rank in the environment.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "flags.h"
#include "rig/dist/launcher.h"

namespace rig::cli {

struct LaunchFlags {
  int nproc = 0;  // 0: not given
  int nnodes = 1;
  int node_rank = 0;
  std::string master;
  int grace_ms = 15000;

  void add(CLI::App& app) {
    add_number(app, "--nproc-per-node", nproc,
               "launch this many workers on this node (one per GPU, or more sharing the GPUs)",
               in_range(1, 1024));
    add_number(app, "--nnodes", nnodes, "number of nodes (one launcher per node)",
               in_range(1, 65536));
    add_number(app, "--node-rank", node_rank, "this node's index, 0..nnodes-1", in_range(0, 65535));
    app.add_option("--master", master,
                   "HOST:PORT of node 0's rendezvous (needed with --nnodes > 1)");
    add_number(app, "--launch-grace-ms", grace_ms,
               "after a worker fails, how long the others get to report before they are stopped",
               in_range(0, 3600000));
  }
  // True when this process should launch workers instead of doing the work itself.
  bool wants_launch() const {
    if (dist::launched_worker()) return false;
    if (node_rank >= nnodes)
      bad_input("--node-rank {} must be below --nnodes {} (nodes count from 0)", node_rank, nnodes);
    return nproc > 0 || nnodes > 1;
  }
  int relaunch() const {
    dist::LaunchOptions o;
    o.nproc_per_node = nproc > 0 ? nproc : 1;
    o.nnodes = nnodes;
    o.node_rank = node_rank;
    o.grace = dist::Millis(grace_ms);
    if (!master.empty())
      dist::parse_master(master, o);
    else if (nnodes > 1)
      bad_input("--nnodes {} needs --master HOST:PORT (node 0's address)", nnodes);
    return dist::launch_local(o, dist::self_argv_without_launch_flags());
  }
};

}  // namespace rig::cli
