#include "rig/dist/env.h"

#include <charconv>
#include <cstdlib>

#include "rig/core/error.h"

extern char** environ;

namespace rig::dist {

namespace {

const std::string* find(const EnvMap& env, const char* key) {
  auto it = env.find(key);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

int to_int(std::string_view s, const char* what) {
  int v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size())
    bad_input("environment variable {}='{}' is not an integer", what, s);
  return v;
}

int get_int(const EnvMap& env, const char* key, int fallback) {
  const std::string* v = find(env, key);
  return v ? to_int(*v, key) : fallback;
}

int require_int(const EnvMap& env, const char* key, const char* because) {
  const std::string* v = find(env, key);
  if (!v) bad_input("environment variable {} is missing ({} is set)", key, because);
  return to_int(*v, key);
}

std::vector<std::string> split_top_level(std::string_view s) {
  // Splits at commas that are not inside brackets.
  std::vector<std::string> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); i++) {
    if (i == s.size() || (s[i] == ',' && depth == 0)) {
      if (i > start) out.emplace_back(s.substr(start, i - start));
      start = i + 1;
    } else if (s[i] == '[') {
      depth++;
    } else if (s[i] == ']') {
      if (--depth < 0) bad_input("node list '{}': unbalanced ']' at offset {}", s, i);
    }
  }
  if (depth != 0) bad_input("node list '{}': unclosed '['", s);
  return out;
}

void expand_one(const std::string& item, const std::string& whole, std::vector<std::string>& out) {
  size_t lb = item.find('[');
  if (lb == std::string::npos) {
    out.push_back(item);
    return;
  }
  size_t rb = item.find(']', lb);
  std::string prefix = item.substr(0, lb), inside = item.substr(lb + 1, rb - lb - 1);
  std::string suffix = item.substr(rb + 1);
  if (inside.empty()) bad_input("node list '{}': empty brackets in '{}'", whole, item);
  std::vector<std::string> tails;
  expand_one(suffix, whole, tails);  // a second bracket group, as in "rack[1-2]-n[1-2]"
  if (suffix.empty()) tails = {""};
  size_t start = 0;
  while (start <= inside.size()) {
    size_t comma = inside.find(',', start);
    if (comma == std::string::npos) comma = inside.size();
    std::string part = inside.substr(start, comma - start);
    size_t dash = part.find('-');
    std::string lo = part.substr(0, dash), hi = dash == std::string::npos ? lo : part.substr(dash + 1);
    if (lo.empty() || hi.empty() || lo.find_first_not_of("0123456789") != std::string::npos ||
        hi.find_first_not_of("0123456789") != std::string::npos)
      bad_input("node list '{}': bad range '{}' in '{}'", whole, part, item);
    long a = std::stol(lo), b = std::stol(hi);
    if (b < a) bad_input("node list '{}': range '{}' runs backwards", whole, part);
    if (b - a > 100000) bad_input("node list '{}': range '{}' is too long", whole, part);
    for (long n = a; n <= b; n++) {
      std::string num = std::to_string(n);
      if (num.size() < lo.size()) num = std::string(lo.size() - num.size(), '0') + num;
      for (const auto& t : tails) out.push_back(prefix + num + t);
    }
    start = comma + 1;
  }
}

}  // namespace

std::vector<std::string> expand_nodelist(std::string_view list) {
  std::vector<std::string> out;
  std::string whole(list);
  for (const auto& item : split_top_level(list)) expand_one(item, whole, out);
  return out;
}

std::vector<int> expand_tasks_per_node(std::string_view s) {
  std::vector<int> out;
  for (const auto& item : split_top_level(s)) {
    size_t x = item.find("(x");
    if (x == std::string::npos) {
      out.push_back(to_int(item, "SLURM_TASKS_PER_NODE"));
      continue;
    }
    if (item.back() != ')') bad_input("SLURM_TASKS_PER_NODE='{}': bad item '{}'", s, item);
    int n = to_int(std::string_view(item).substr(0, x), "SLURM_TASKS_PER_NODE");
    int reps = to_int(std::string_view(item).substr(x + 2, item.size() - x - 3), "SLURM_TASKS_PER_NODE");
    out.insert(out.end(), size_t(reps), n);
  }
  return out;
}

DistEnv parse_env(const EnvMap& env) {
  DistEnv d;
  if (find(env, "RANK") || find(env, "WORLD_SIZE")) {
    d.source = "torchrun";
    d.rank = require_int(env, "RANK", "WORLD_SIZE");
    d.world = require_int(env, "WORLD_SIZE", "RANK");
    d.local_rank = get_int(env, "LOCAL_RANK", d.rank);
    d.local_world = get_int(env, "LOCAL_WORLD_SIZE", d.world);
    d.node_rank = get_int(env, "GROUP_RANK", get_int(env, "NODE_RANK", d.rank / std::max(1, d.local_world)));
    d.nnodes = get_int(env, "NNODES", (d.world + d.local_world - 1) / std::max(1, d.local_world));
    if (auto* a = find(env, "MASTER_ADDR")) d.master_addr = *a;
    else if (d.world > 1) bad_input("environment variable MASTER_ADDR is missing (WORLD_SIZE={})", d.world);
    if (find(env, "MASTER_PORT")) d.master_port = get_int(env, "MASTER_PORT", 0);
    else if (d.world > 1) bad_input("environment variable MASTER_PORT is missing (WORLD_SIZE={})", d.world);
    // Under torchrun its agent already serves torch's own store on MASTER_PORT; rig's store, which
    // speaks another protocol, takes the next port on every rank.
    if (find(env, "TORCHELASTIC_RUN_ID") && d.master_port > 0) d.master_port += 1;
  } else if (find(env, "OMPI_COMM_WORLD_RANK")) {
    d.source = "openmpi";
    d.rank = get_int(env, "OMPI_COMM_WORLD_RANK", 0);
    d.world = require_int(env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK");
    d.local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    d.local_world = get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    d.node_rank = get_int(env, "OMPI_COMM_WORLD_NODE_RANK", d.rank / std::max(1, d.local_world));
    d.nnodes = (d.world + d.local_world - 1) / std::max(1, d.local_world);
    // mpirun does not say where rank 0 lives; users export MASTER_ADDR (or use one node).
    if (auto* a = find(env, "MASTER_ADDR")) d.master_addr = *a;
    else if (d.nnodes > 1) bad_input("Open MPI run over {} nodes needs MASTER_ADDR (the host of rank 0)", d.nnodes);
    d.master_port = get_int(env, "MASTER_PORT", d.master_port);
  } else if (find(env, "SLURM_PROCID")) {
    d.source = "slurm";
    d.rank = get_int(env, "SLURM_PROCID", 0);
    d.world = require_int(env, "SLURM_NTASKS", "SLURM_PROCID");
    d.local_rank = get_int(env, "SLURM_LOCALID", 0);
    d.node_rank = get_int(env, "SLURM_NODEID", 0);
    if (auto* t = find(env, "SLURM_NTASKS_PER_NODE")) {
      d.local_world = to_int(*t, "SLURM_NTASKS_PER_NODE");
    } else if (auto* t2 = find(env, "SLURM_TASKS_PER_NODE")) {
      auto per = expand_tasks_per_node(*t2);
      if (size_t(d.node_rank) < per.size()) d.local_world = per[size_t(d.node_rank)];
    } else {
      d.local_world = d.world;
    }
    d.nnodes = get_int(env, "SLURM_NNODES", get_int(env, "SLURM_JOB_NUM_NODES", 1));
    if (auto* a = find(env, "MASTER_ADDR")) {
      d.master_addr = *a;
    } else {
      const std::string* nl = find(env, "SLURM_JOB_NODELIST");
      if (!nl) nl = find(env, "SLURM_NODELIST");
      if (nl) {
        auto nodes = expand_nodelist(*nl);
        if (nodes.empty()) bad_input("SLURM_JOB_NODELIST='{}' names no node", *nl);
        d.master_addr = nodes.front();
      } else if (d.nnodes > 1) {
        bad_input("Slurm job over {} nodes without SLURM_JOB_NODELIST or MASTER_ADDR", d.nnodes);
      }
    }
    // A port derived from the job id keeps two jobs sharing a node apart.
    int fallback_port = 29500;
    if (auto* j = find(env, "SLURM_JOB_ID")) fallback_port = 20000 + to_int(*j, "SLURM_JOB_ID") % 20000;
    d.master_port = get_int(env, "MASTER_PORT", fallback_port);
  } else {
    if (auto* a = find(env, "MASTER_ADDR")) d.master_addr = *a;
    d.master_port = get_int(env, "MASTER_PORT", d.master_port);
  }
  if (d.world < 1) bad_input("{}: world size {} must be at least 1", d.source, d.world);
  if (d.rank < 0 || d.rank >= d.world)
    bad_input("{}: rank {} is outside the world of {}", d.source, d.rank, d.world);
  if (d.local_world < 1 || d.local_rank < 0 || d.local_rank >= d.local_world)
    bad_input("{}: local rank {} is outside the local world of {}", d.source, d.local_rank, d.local_world);
  if (d.master_port < 0 || d.master_port > 65535)
    bad_input("{}: MASTER_PORT {} is not a TCP port", d.source, d.master_port);
  return d;
}

EnvMap process_env() {
  EnvMap m;
  for (char** e = environ; e && *e; e++) {
    std::string_view kv(*e);
    size_t eq = kv.find('=');
    if (eq != std::string_view::npos) m.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return m;
}

DistEnv env_from_process() { return parse_env(process_env()); }

}  // namespace rig::dist
