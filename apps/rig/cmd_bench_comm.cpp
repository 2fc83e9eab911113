// rig bench comm: collective bandwidth with nccl-tests' columns, on Gloo (CPU) or NCCL (GPU),
// with a correctness check at every size.
#include <iostream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "flags.h"
#include "launch_flags.h"
#include "rig/core/host_memory.h"
#include "rig/dist/bench.h"
#include "rig/dist/communicator.h"

namespace {

using json = nlohmann::json;

struct Args {
  std::string op = "all_reduce", backend;
  size_t min_bytes = 1 << 10, max_bytes = 64 << 20;
  int iters = 20, warmup = 5, timeout_s = 120;
  bool as_json = false;
  rig::cli::LaunchFlags launch;
};

int run(const Args& a) {
  using namespace rig::dist;
  if (a.launch.wants_launch()) return a.launch.relaunch();
  CommBenchOptions o;
  o.ops = a.op == "all" ? all_comm_ops() : std::vector<std::string>{a.op};
  for (auto& op : o.ops) busbw_factor(op, 1);  // validate before any rendezvous
  o.min_bytes = a.min_bytes;
  o.max_bytes = a.max_bytes;
  o.iters = a.iters;
  o.warmup = a.warmup;
  Backend backend = a.backend.empty() ? default_backend() : parse_backend(a.backend);
  CommOptions co;
  co.timeout = std::chrono::seconds(a.timeout_s);
  const DistEnv env = env_from_process();
  std::unique_ptr<Group> group;
  if ((a.backend.empty() || backend == Backend::Nccl) && rig::cuda_available()) {
    // GPU tensors: NCCL with a GPU per rank, Gloo staged in host memory when ranks share GPUs
    // (an explicit --backend nccl with more ranks than GPUs is one line saying so).
    const Placement where = place_rank(env, rig::cuda_device_count(), a.backend);
    backend = where.backend;
    group = init_group(env, where, co);
    if (env.rank == 0 && where.ranks_per_gpu > 1)
      fmt::print(stderr, "rig: {} (data through {})\n", where.describe(env.local_world),
                 group->comm->transport());
  } else {
    group = init_group(env, backend, co);
  }
  auto& comm = *group->comm;
  auto rows = bench_comm(comm, o);
  int64_t wrong = 0;
  for (auto& r : rows) wrong += r.wrong;
  if (comm.rank() == 0) {
    if (a.as_json) {
      json out;
      out["backend"] = backend_name(backend);
      out["world"] = comm.world();
      out["device"] = comm.device().str();
      out["iters"] = o.iters;
      json js = json::array();
      for (auto& r : rows)
        js.push_back({{"op", r.op}, {"size", r.bytes}, {"count", r.count}, {"type", r.type},
                      {"time_us", r.time_us}, {"algbw_gbps", r.algbw}, {"busbw_gbps", r.busbw},
                      {"wrong", r.wrong}});
      out["rows"] = js;
      out["ok"] = wrong == 0;
      std::cout << out.dump(1) << "\n";
    } else {
      fmt::print("# rig bench comm: {} rank(s), {} on {}, {} iterations (+{} warm-up)\n", comm.world(),
                 backend_name(backend), comm.device().str(), o.iters, o.warmup);
      std::string last;
      for (auto& r : rows) {
        if (r.op != last) {
          fmt::print("#\n# {}\n# {:>12} {:>12} {:>6} {:>10} {:>8} {:>8} {:>7}\n", r.op, "size(B)", "count",
                     "type", "time(us)", "algbw", "busbw", "#wrong");
          last = r.op;
        }
        fmt::print("  {:>12} {:>12} {:>6} {:>10.1f} {:>8.2f} {:>8.2f} {:>7}\n", r.bytes, r.count, r.type,
                   r.time_us, r.algbw, r.busbw, r.wrong);
      }
      fmt::print("# algbw and busbw in GB/s; busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n "
                 "(reduce_scatter, all_gather), 1 (broadcast)\n");
      fmt::print("# {}\n", wrong == 0 ? "all results correct" : fmt::format("{} WRONG elements", wrong));
    }
  }
  return wrong == 0 ? 0 : 1;
}

rig::cli::Registrar reg("bench comm", "Measure collective bandwidth (nccl-tests columns) and check results",
                        [](CLI::App& app) {
                          auto a = std::make_shared<Args>();
                          app.add_option("--op", a->op, "all_reduce, reduce_scatter, all_gather, broadcast or all")
                              ->check(CLI::IsMember({"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all"}));
                          using namespace rig::cli;
                          // K, M, G count 1024s, as nccl-tests' -b/-e do.
                          const SizeRule size{.min = 4, .max = 0x1p34, .binary = true};
                          add_size(app, "--min-bytes", a->min_bytes, "smallest size (1K, 4M, ...)",
                                   size)
                              ->default_str("1K");
                          add_size(app, "--max-bytes", a->max_bytes, "largest size", size)
                              ->default_str("64M");
                          add_number(app, "--iters", a->iters, "timed iterations per size",
                                     in_range(1, 1000000));
                          add_number(app, "--warmup", a->warmup, "untimed iterations per size",
                                     in_range(0, 1000000));
                          app.add_option("--backend", a->backend, "gloo or nccl (default: nccl with a GPU)")
                              ->check(CLI::IsMember({"gloo", "nccl"}));
                          add_number(app, "--timeout", a->timeout_s,
                                     "seconds before a missing peer is an error",
                                     in_range(1, 86400));
                          app.add_flag("--json", a->as_json, "print one JSON object");
                          a->launch.add(app);
                          return [a] { return run(*a); };
                        });

}  // namespace
