// Where this process sits in a distributed run: rank, world and the master's address, read from
// the variables torchrun, Slurm, Open MPI or rig's own launcher set.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace rig::dist {

struct DistEnv {
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  int local_world = 1;
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "default";  // "torchrun", "slurm", "openmpi" or "default" (a world of 1)
};

using EnvMap = std::map<std::string, std::string>;

// Parses `env`. Priority: RANK/WORLD_SIZE (torchrun and rig's launcher), then Open MPI, then
// Slurm (a Slurm job that runs torchrun also sets SLURM_*, and torchrun's RANK wins). Throws
// InputError naming the variable on malformed or inconsistent values.
DistEnv parse_env(const EnvMap& env);
// parse_env over the process environment.
DistEnv env_from_process();
EnvMap process_env();

// Expands a Slurm node list: "node[01-04,07],gpu-a,x[1-2]" -> node01..node04,node07,gpu-a,x1,x2.
// Zero padding of ranges is kept. Throws InputError on unbalanced brackets or bad ranges.
std::vector<std::string> expand_nodelist(std::string_view list);

// Expands Slurm's SLURM_TASKS_PER_NODE form "2(x3),1" -> {2,2,2,1}.
std::vector<int> expand_tasks_per_node(std::string_view s);

}  // namespace rig::dist
