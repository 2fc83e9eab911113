// rig debug allreduce-check: each worker all-reduces a known tensor and checks the closed
// form. Tests use it to exercise launcher + rendezvous + collectives across real processes, and
// to make one rank fail on purpose (exit early, die by SIGKILL, or hang).
#include <signal.h>
#include <unistd.h>

#include <thread>

#include "command.h"
#include "flags.h"
#include "launch_flags.h"
#include "rig/core/host_memory.h"
#include "rig/dist/communicator.h"

namespace {

struct Args {
  int64_t numel = 4096;
  int iters = 3;
  int fail_rank = -1;
  std::string fail_mode = "exit";
  int timeout_ms = 30000;
  std::string backend = "gloo";
  rig::cli::LaunchFlags launch;
};

int run(const Args& a) {
  using namespace rig::dist;
  if (a.launch.wants_launch()) return a.launch.relaunch();
  DistEnv env = env_from_process();
  CommOptions co;
  co.timeout = Millis(a.timeout_ms);
  // NCCL takes a GPU per rank: place_rank says so in one line when there are more ranks.
  auto group = parse_backend(a.backend) == Backend::Nccl
                   ? init_group(env, place_rank(env, rig::cuda_device_count(), a.backend), co)
                   : init_group(env, Backend::Gloo, co);
  auto& c = *group->comm;
  int w = c.world(), r = c.rank();
  for (int k = 0; k < a.iters; k++) {
    if (r == a.fail_rank && k == 1) {
      fmt::print(stderr, "rank {}: failing on purpose ({})\n", r, a.fail_mode);
      if (a.fail_mode == "kill") raise(SIGKILL);
      if (a.fail_mode == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
      rig::fail("rank {} fails on purpose", r);  // "exit": an error unwinds the group
    }
    auto t = rig::Tensor::empty({a.numel}, rig::DType::F32);
    for (int64_t i = 0; i < a.numel; i++) t.f32()[i] = float(r + 1) * float(i % 5 + 1) + float(k);
    rig::Tensor dt = c.device().is_cpu() ? t : t.to(c.device());
    c.all_reduce(dt, rig::dist::ReduceOp::Sum);
    rig::Tensor back = dt.device().is_cpu() ? dt : dt.to(rig::Device::cpu());
    for (int64_t i = 0; i < a.numel; i++) {
      float want = float(w * (w + 1) / 2) * float(i % 5 + 1) + float(w * k);
      if (back.f32()[i] != want)
        rig::fail("rank {}: iteration {}: element {} is {}, expected {}", r, k, i, back.f32()[i], want);
    }
  }
  c.barrier();
  fmt::print("rank {} of {}: all-reduce check passed ({} iterations of {} floats, {})\n", r, w, a.iters,
             a.numel, backend_name(c.backend()));
  return 0;
}

rig::cli::Registrar reg("debug allreduce-check", "Check an all-reduce across launched workers (for tests)",
                        [](CLI::App& app) {
                          app.group("");  // hidden from --help
                          auto a = std::make_shared<Args>();
                          using namespace rig::cli;
                          add_number(app, "--numel", a->numel, "elements per all-reduce",
                                     in_range(1, 1 << 30));
                          add_number(app, "--iters", a->iters, "all-reduces to check",
                                     in_range(0, 1000000));
                          add_number(app, "--fail-rank", a->fail_rank,
                                     "this rank fails at iteration 1", at_least(-1));
                          app.add_option("--fail-mode", a->fail_mode, "exit, kill or hang")
                              ->check(CLI::IsMember({"exit", "kill", "hang"}));
                          add_number(app, "--timeout-ms", a->timeout_ms,
                                     "collective and rendezvous timeout", in_range(1, 86400000));
                          app.add_option("--backend", a->backend, "gloo or nccl")->check(CLI::IsMember({"gloo", "nccl"}));
                          a->launch.add(app);
                          return [a] { return run(*a); };
                        });

}  // namespace
