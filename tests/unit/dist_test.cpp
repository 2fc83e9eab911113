// Distributed setup: environment parsing (torchrun, Slurm, Open MPI) and the rendezvous store.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rig/dist/communicator.h"
#include "rig/dist/env.h"
#include "rig/dist/store.h"

using namespace rig;
using namespace rig::dist;
using namespace std::chrono_literals;

// ---- environment --------------------------------------------------------------------------

TEST(DistEnv, DefaultIsAWorldOfOne) {
  auto d = parse_env({});
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world, 1);
  EXPECT_EQ(d.source, "default");
}

TEST(DistEnv, UnderTorchrunsAgentTheStoreTakesTheNextPort) {
  auto d = parse_env({{"RANK", "0"},
                      {"WORLD_SIZE", "2"},
                      {"MASTER_ADDR", "127.0.0.1"},
                      {"MASTER_PORT", "29500"},
                      {"TORCHELASTIC_RUN_ID", "none"}});
  EXPECT_EQ(d.master_port, 29501);
}

TEST(DistEnv, Torchrun) {
  auto d = parse_env({{"RANK", "5"},
                      {"LOCAL_RANK", "1"},
                      {"WORLD_SIZE", "8"},
                      {"LOCAL_WORLD_SIZE", "4"},
                      {"MASTER_ADDR", "10.0.0.1"},
                      {"MASTER_PORT", "29400"},
                      {"GROUP_RANK", "1"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.world, 8);
  EXPECT_EQ(d.local_world, 4);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.nnodes, 2);
  EXPECT_EQ(d.master_addr, "10.0.0.1");
  EXPECT_EQ(d.master_port, 29400);
}

TEST(DistEnv, TorchrunErrorsNameTheVariable) {
  try {
    parse_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
  }
  try {
    parse_env({{"RANK", "x1"}, {"WORLD_SIZE", "2"}});
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='x1'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(
      parse_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}),
      InputError);
}

TEST(DistEnv, Slurm) {
  auto d = parse_env({{"SLURM_PROCID", "6"},
                      {"SLURM_LOCALID", "2"},
                      {"SLURM_NTASKS", "8"},
                      {"SLURM_NTASKS_PER_NODE", "4"},
                      {"SLURM_NODEID", "1"},
                      {"SLURM_NNODES", "2"},
                      {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                      {"SLURM_JOB_ID", "12345"}});
  EXPECT_EQ(d.source, "slurm");
  EXPECT_EQ(d.rank, 6);
  EXPECT_EQ(d.local_rank, 2);
  EXPECT_EQ(d.world, 8);
  EXPECT_EQ(d.local_world, 4);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.nnodes, 2);
  EXPECT_EQ(d.master_addr, "gpu07");
  EXPECT_EQ(d.master_port, 20000 + 12345 % 20000);
}

TEST(DistEnv, SlurmTasksPerNodeForm) {
  auto d = parse_env({{"SLURM_PROCID", "4"},
                      {"SLURM_LOCALID", "0"},
                      {"SLURM_NTASKS", "5"},
                      {"SLURM_TASKS_PER_NODE", "2(x2),1"},
                      {"SLURM_NODEID", "2"},
                      {"SLURM_NODELIST", "a,b,c"},
                      {"MASTER_PORT", "1234"}});
  EXPECT_EQ(d.local_world, 1);
  EXPECT_EQ(d.master_addr, "a");
  EXPECT_EQ(d.master_port, 1234);
  EXPECT_EQ(expand_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
}

TEST(DistEnv, TorchrunWinsOverSlurm) {
  auto d = parse_env({{"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "1"},
                      {"RANK", "3"},
                      {"WORLD_SIZE", "4"},
                      {"MASTER_ADDR", "h"},
                      {"MASTER_PORT", "5"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 3);
}

TEST(DistEnv, OpenMpi) {
  auto d = parse_env({{"OMPI_COMM_WORLD_RANK", "3"},
                      {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(d.source, "openmpi");
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world, 4);
  EXPECT_EQ(d.local_rank, 3);
  EXPECT_EQ(d.local_world, 4);
  EXPECT_EQ(d.nnodes, 1);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  // Several nodes: rank 0's host must be given.
  EXPECT_THROW(parse_env({{"OMPI_COMM_WORLD_RANK", "3"},
                          {"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
               InputError);
}

TEST(DistEnv, ExpandNodelist) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_nodelist("node[01-04,07]"),
            (V{"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_nodelist("a,b[8-10],c"), (V{"a", "b8", "b9", "b10", "c"}));
  EXPECT_EQ(expand_nodelist("gpu-a"), (V{"gpu-a"}));
  EXPECT_EQ(expand_nodelist("r[1-2]-n[1-2]"), (V{"r1-n1", "r1-n2", "r2-n1", "r2-n2"}));
  EXPECT_EQ(expand_nodelist("x[098-101]"), (V{"x098", "x099", "x100", "x101"}));
  EXPECT_THROW(expand_nodelist("node[01-04"), InputError);
  EXPECT_THROW(expand_nodelist("node[4-1]"), InputError);
  EXPECT_THROW(expand_nodelist("node[a-b]"), InputError);
}

// ---- store --------------------------------------------------------------------------------

TEST(DistStore, SetGetAddCheck) {
  StoreServer server(0);
  Store a("127.0.0.1", server.port(), -1, 5s), b("127.0.0.1", server.port(), -1, 5s);
  a.set("k", std::string("v\0x", 3));
  EXPECT_EQ(b.get("k"), std::string("v\0x", 3));
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 3), 5);
  EXPECT_TRUE(a.check({"k", "n"}));
  EXPECT_FALSE(a.check({"k", "missing"}));
}

TEST(DistStore, GetWaitsForALaterSet) {
  StoreServer server(0);
  Store a("127.0.0.1", server.port(), -1, 60s);
  ASSERT_FALSE(a.check({"late"}));
  // The other client sets the key once this one is about to ask for it (a promise, not a sleep):
  // whether the set lands before the get or while it waits, the get returns the value.
  std::promise<void> getting;
  std::thread t([&, go = getting.get_future()]() mutable {
    Store b("127.0.0.1", server.port(), -1, 60s);
    go.wait();
    b.set("late", "yes");
  });
  getting.set_value();
  EXPECT_EQ(a.get("late"), "yes");
  t.join();
}

TEST(DistStore, WaitTimesOutNamingTheMissingKeys) {
  StoreServer server(0);
  Store a("127.0.0.1", server.port(), -1, 5s);
  a.set("here", "1");
  // The wait's own 200 ms end it, not the store's default: that is an hour here, so the bound
  // below is generous (a loaded machine under the sanitizers) and still tells the two apart.
  a.set_timeout(std::chrono::hours(1));
  auto t0 = std::chrono::steady_clock::now();
  try {
    a.wait({"here", "never"}, 200ms);
    FAIL();
  } catch (const StoreTimeout& e) {
    EXPECT_EQ(e.missing, std::vector<std::string>{"never"});
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 120s);
}

TEST(DistStore, NoServerFailsWithinTheTimeout) {
  int port;
  {
    StoreServer s(0);
    port = s.port();
  }
  // Connecting retries for 300 ms, then gives up: the bound only tells that apart from retrying
  // for ever, generously (a loaded machine under the sanitizers).
  auto t0 = std::chrono::steady_clock::now();
  try {
    Store a("127.0.0.1", port, 1, 300ms);
    FAIL();
  } catch (const PeerGone& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 120s);
}

TEST(DistStore, JoinNamesTheRanksThatNeverCame) {
  StoreServer server(0);
  Store r0("127.0.0.1", server.port(), 0, 5s), r2("127.0.0.1", server.port(), 2, 5s);
  try {
    r0.join(4, 200ms);
    FAIL();
  } catch (const StoreTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 1, 3 did not connect"), std::string::npos)
        << e.what();
  }
}

TEST(DistStore, ADeadRankEndsWaitsWithItsName) {
  StoreServer server(0);
  Store r0("127.0.0.1", server.port(), 0, 10s);
  // Rank 2 connects, then dies once rank 0 is about to wait (a promise, not a sleep). Its death
  // ends the wait with PeerGone whether it comes before or during the wait; the wait's own
  // deadline (10 minutes) would end it with StoreTimeout instead, so no clock is read here.
  std::promise<void> waiting;
  std::thread t([&, go = waiting.get_future()]() mutable {
    try {
      Store r2("127.0.0.1", server.port(), 2, 10s);
      go.wait();
      throw std::runtime_error("die");  // unwinding: no goodbye, so rank 2 counts as gone
    } catch (const std::runtime_error&) {
    }
  });
  waiting.set_value();
  try {
    r0.wait({"never"}, 600s);
    FAIL();
  } catch (const PeerGone& e) {
    EXPECT_EQ(e.ranks, (std::vector<int>{2}));
    EXPECT_NE(std::string(e.what()).find("rank 2 exited"), std::string::npos) << e.what();
  }
  t.join();
  // A rank that fails because of another (mark_failed) is not a cause, and its leaving ends no
  // wait.
  StoreServer s2(0);
  std::optional<Store> q0;
  q0.emplace("127.0.0.1", s2.port(), 0, 10s);
  {
    Store q1("127.0.0.1", s2.port(), 1, 10s);
    q1.mark_failed();
  }
  EXPECT_THROW(q0->wait({"never"}, 200ms), StoreTimeout);  // a failed rank leaving ends no wait
  EXPECT_EQ(q0->dead_ranks(0ms), (std::vector<int>{}));    // and is not a cause
  try {
    Store q3("127.0.0.1", s2.port(), 3, 10s);
    throw std::runtime_error("die");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(q0->dead_ranks(120s), (std::vector<int>{3}));  // returns as soon as rank 3 is seen
  try {
    q0->wait({"never"}, 120s);
    FAIL();
  } catch (const PeerGone& e) {
    EXPECT_EQ(e.ranks, (std::vector<int>{3}));
  }
  // A clean goodbye is not a death: once every rank's connection has closed (q4's and q0's, both
  // saying goodbye; wait_idle returns when the server has seen the last one go), only rank 3 is.
  { Store q4("127.0.0.1", s2.port(), 4, 10s); }
  q0.reset();
  EXPECT_EQ(s2.wait_idle(120s), 0);
  Store anon("127.0.0.1", s2.port(), -1, 10s);
  EXPECT_EQ(anon.dead_ranks(0ms), (std::vector<int>{3}));
}

TEST(DistStore, BarrierAcrossThreads) {
  StoreServer server(0);
  std::atomic<int> before{0};
  std::vector<std::thread> ts;
  std::atomic<bool> ok{true};
  for (int r = 0; r < 4; r++)
    ts.emplace_back([&, r] {
      Store s("127.0.0.1", server.port(), r, 5s);
      for (int round = 0; round < 3; round++) {
        before++;
        s.barrier(4);
        if (before.load() < 4 * (round + 1)) ok = false;
        s.barrier(4);
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_TRUE(ok);
}

// Ranks and GPUs: one GPU each takes NCCL; more ranks than GPUs share them through Gloo staged in
// host memory; NCCL asked for on shared GPUs is a clear error.
TEST(Placement, RanksShareGpusWhenTheNodeHasMoreRanksThanGpus) {
  using rig::dist::Backend;
  rig::dist::DistEnv e;
  e.world = e.local_world = 4;
  e.local_rank = 3;
  auto cpu = rig::dist::place_rank(e, 0);
  EXPECT_TRUE(cpu.device.is_cpu());
  EXPECT_EQ(cpu.backend, Backend::Gloo);
  EXPECT_FALSE(cpu.staged());
  auto four = rig::dist::place_rank(e, 4);
  EXPECT_EQ(four.device, rig::Device::cuda(3));
  EXPECT_EQ(four.ranks_per_gpu, 1);
  EXPECT_EQ(four.backend, rig::dist::nccl_built() ? Backend::Nccl : Backend::Gloo);
  auto one = rig::dist::place_rank(e, 1);
  EXPECT_EQ(one.device, rig::Device::cuda(0));
  EXPECT_EQ(one.ranks_per_gpu, 4);
  EXPECT_TRUE(one.staged());
  EXPECT_NE(one.describe(4).find("4 ranks share 1 GPU(s)"), std::string::npos) << one.describe(4);
  auto two = rig::dist::place_rank(e, 2);
  EXPECT_EQ(two.device, rig::Device::cuda(1));
  EXPECT_EQ(two.ranks_per_gpu, 2);
  EXPECT_TRUE(two.staged());
  auto gloo = rig::dist::place_rank(e, 4, "gloo");
  EXPECT_TRUE(gloo.staged());
  try {
    rig::dist::place_rank(e, 2, "nccl");
    FAIL() << "NCCL on shared GPUs was accepted";
  } catch (const rig::InputError& err) {
    EXPECT_NE(std::string(err.what()).find("NCCL takes one rank per GPU"), std::string::npos)
        << err.what();
  }
  EXPECT_THROW(rig::dist::place_rank(e, 0, "nccl"), rig::InputError);
}
