#include "rig/dist/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <exception>

namespace rig::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

const char* backend_name(Backend b) { return b == Backend::Gloo ? "gloo" : "nccl"; }

Backend parse_backend(std::string_view s) {
  if (s == "gloo") return Backend::Gloo;
  if (s == "nccl") return Backend::Nccl;
  bad_input("unknown communication backend '{}' (expected gloo or nccl)", s);
}

double busbw_factor(std::string_view op, int world) {
  double n = world;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "reduce_scatter" || op == "all_gather") return (n - 1) / n;
  if (op == "broadcast") return 1.0;
  bad_input("unknown collective '{}'", op);
}

std::string blame_failure(Store& store, int rank, int world, Millis timeout, const std::string& what) {
  // The store notices a dead peer's closed connection; give it a moment to catch up.
  auto dead = store.dead_ranks(Millis(2000));
  if (!dead.empty()) {
    store.mark_failed();
    return fmt::format("{} exited or lost its connection", ranks_str(dead));
  }
  store.set(fmt::format("rig/stuck/{}", rank), what);
  std::vector<std::string> keys;
  for (int r = 0; r < world; r++)
    if (r != rank) keys.push_back(fmt::format("rig/stuck/{}", r));
  std::vector<int> silent;
  try {
    store.wait(keys, std::min(timeout, Millis(5000)));
  } catch (const StoreTimeout& e) {
    for (auto& k : e.missing) silent.push_back(std::atoi(k.c_str() + 10));
  }
  store.mark_failed();
  if (!silent.empty())
    return fmt::format("{} did not take part within {} ms and did not fail (alive but hung, or not "
                       "issuing this collective)",
                       ranks_str(silent), timeout.count());
  std::string differ;
  for (int r = 0; r < world; r++) {
    if (r == rank) continue;
    std::string v = store.get(fmt::format("rig/stuck/{}", r), Millis(0));
    if (v != what) differ += fmt::format("{}rank {} is in {}", differ.empty() ? "" : ", ", r, v);
  }
  if (!differ.empty()) return fmt::format("ranks issued different collectives: {}", differ);
  return fmt::format("every rank timed out in {} after {} ms (network too slow or down?)", what, timeout.count());
}

#ifndef RIG_WITH_NCCL
bool nccl_built() { return false; }
std::unique_ptr<Communicator> make_nccl(std::shared_ptr<Store>, int, int, int, const CommOptions&) {
  fail("this rig was built without NCCL (configure with CUDA and NCCL present); use --backend gloo");
}
#endif

Backend default_backend() { return nccl_built() && cuda_available() ? Backend::Nccl : Backend::Gloo; }

Placement place_rank(const DistEnv& env, int gpus, std::string_view backend) {
  Placement p;
  if (gpus <= 0) {
    if (backend == "nccl") bad_input("the NCCL backend needs a GPU, and none is visible");
    p.device = Device::cpu();
    return p;
  }
  p.device = Device::cuda(env.local_rank % gpus);
  p.ranks_per_gpu = (env.local_world + gpus - 1) / gpus;
  if (backend.empty())
    p.backend = p.ranks_per_gpu == 1 && nccl_built() ? Backend::Nccl : Backend::Gloo;
  else
    p.backend = parse_backend(backend);
  if (p.backend == Backend::Nccl && p.ranks_per_gpu > 1)
    bad_input(
        "{} ranks on this node but {} GPU(s): NCCL takes one rank per GPU; leave the backend to "
        "rig (Gloo through host memory) or launch at most {} ranks",
        env.local_world, gpus, gpus);
  return p;
}

std::string Placement::describe(int local_world) const {
  if (device.is_cpu()) return fmt::format("{} rank(s) on the CPU, collectives through Gloo", local_world);
  if (ranks_per_gpu > 1)
    return fmt::format(
        "{} ranks share {} GPU(s) (up to {} per GPU): collectives go through Gloo, staged "
        "outside NCCL",
        local_world, (local_world + ranks_per_gpu - 1) / ranks_per_gpu, ranks_per_gpu);
  return fmt::format("{} rank(s), one GPU each, collectives through {}", local_world,
                     staged() ? "Gloo staged in host memory" : "NCCL");
}

Group::~Group() {
  comm.reset();
  store.reset();  // goodbye, or (when unwinding) the mark that this rank is gone
  // Rank 0 hosts the store: keep it up until the others have left, so they can still learn
  // which rank failed. Briefly when failing: its own error is printed only after this.
  if (server) server->wait_idle(std::uncaught_exceptions() > 0 ? Millis(5000) : Millis(30000));
}

std::unique_ptr<Group> init_group(const DistEnv& env, Backend backend, const CommOptions& opts) {
  set_current_rank(env.rank);
  auto g = std::make_unique<Group>();
  g->env = env;
  if (env.rank == 0) g->server = std::make_shared<StoreServer>(env.master_port);
  int port = g->server ? g->server->port() : env.master_port;
  g->store = std::make_shared<Store>(env.master_addr, port, env.rank, opts.timeout);
  try {
    g->store->join(env.world, opts.timeout);
  } catch (const Error& e) {
    fail("rank {}: rendezvous at {} failed: {}", env.rank, g->store->address(), e.what());
  }
  if (backend == Backend::Nccl)
    g->comm = make_nccl(g->store, env.rank, env.world, env.local_rank, opts);
  else
    g->comm = make_gloo(g->store, env.rank, env.world, opts);
  return g;
}

std::unique_ptr<Group> init_group(const DistEnv& env, const Placement& where,
                                  const CommOptions& opts) {
  if (where.backend == Backend::Nccl) {
    DistEnv e = env;
    e.local_rank = where.device.index;  // make_nccl takes the device from local_rank
    auto g = init_group(e, Backend::Nccl, opts);
    g->env = env;
    return g;
  }
  auto g = init_group(env, Backend::Gloo, opts);
  if (where.device.is_cuda())
    g->comm = make_staged(std::move(g->comm), where.device,
                          env.local_world == env.world ? g->store : nullptr);
  return g;
}

}  // namespace rig::dist
