// Distributed layer on CPU: environment parsing, the rendezvous store, Gloo collectives over
// 127.0.0.1 on 1..4 ranks (threads), bucketing and sharding helpers, and the launcher with real
// processes (including a killed worker).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

#include <nlohmann/json.hpp>

#include "rig/dist/bench.h"
#include "rig/dist/bucket.h"
#include "rig/dist/communicator.h"
#include "rig/dist/launcher.h"
#include "rig/dist/env.h"
#include "rig/dist/store.h"
#include "test_util.h"

using namespace rig;
using namespace rig::dist;
using namespace std::chrono_literals;

namespace {

// Runs fn(rank, comm) on `world` threads, each with its own store client and Gloo communicator.
void run_ranks(int world, const std::function<void(int, Communicator&)>& fn, Millis timeout = 20s) {
  StoreServer server(0);
  std::vector<std::thread> ts;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; r++) {
    ts.emplace_back([&, r] {
      try {
        auto store = std::make_shared<Store>("127.0.0.1", server.port(), r, timeout);
        CommOptions o;
        o.timeout = timeout;
        auto comm = make_gloo(store, r, world, o);
        fn(r, *comm);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; r++) EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
}

std::vector<float> values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

}  // namespace

// ---- environment --------------------------------------------------------------------------

TEST(DistEnv, DefaultIsAWorldOfOne) {
  auto d = parse_env({});
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world, 1);
  EXPECT_EQ(d.source, "default");
}

TEST(DistEnv, UnderTorchrunsAgentTheStoreTakesTheNextPort) {
  auto d = parse_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"},
                      {"TORCHELASTIC_RUN_ID", "none"}});
  EXPECT_EQ(d.master_port, 29501);
}

TEST(DistEnv, Torchrun) {
  auto d = parse_env({{"RANK", "5"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"},
                      {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"}, {"GROUP_RANK", "1"}});
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
  EXPECT_THROW(parse_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}),
               InputError);
}

TEST(DistEnv, Slurm) {
  auto d = parse_env({{"SLURM_PROCID", "6"}, {"SLURM_LOCALID", "2"}, {"SLURM_NTASKS", "8"},
                      {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"},
                      {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "12345"}});
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
  auto d = parse_env({{"SLURM_PROCID", "4"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS", "5"},
                      {"SLURM_TASKS_PER_NODE", "2(x2),1"}, {"SLURM_NODEID", "2"},
                      {"SLURM_NODELIST", "a,b,c"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(d.local_world, 1);
  EXPECT_EQ(d.master_addr, "a");
  EXPECT_EQ(d.master_port, 1234);
  EXPECT_EQ(expand_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
}

TEST(DistEnv, TorchrunWinsOverSlurm) {
  auto d = parse_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"RANK", "3"}, {"WORLD_SIZE", "4"},
                      {"MASTER_ADDR", "h"}, {"MASTER_PORT", "5"}});
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 3);
}

TEST(DistEnv, OpenMpi) {
  auto d = parse_env({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(d.source, "openmpi");
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world, 4);
  EXPECT_EQ(d.local_rank, 3);
  EXPECT_EQ(d.local_world, 4);
  EXPECT_EQ(d.nnodes, 1);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
  // Several nodes: rank 0's host must be given.
  EXPECT_THROW(parse_env({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
               InputError);
}

TEST(DistEnv, ExpandNodelist) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_nodelist("node[01-04,07]"), (V{"node01", "node02", "node03", "node04", "node07"}));
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
  Store a("127.0.0.1", server.port(), -1, 5s);
  std::thread t([&] {
    Store b("127.0.0.1", server.port(), -1, 5s);
    std::this_thread::sleep_for(100ms);
    b.set("late", "yes");
  });
  EXPECT_EQ(a.get("late"), "yes");
  t.join();
}

TEST(DistStore, WaitTimesOutNamingTheMissingKeys) {
  StoreServer server(0);
  Store a("127.0.0.1", server.port(), -1, 5s);
  a.set("here", "1");
  auto t0 = std::chrono::steady_clock::now();
  try {
    a.wait({"here", "never"}, 200ms);
    FAIL();
  } catch (const StoreTimeout& e) {
    EXPECT_EQ(e.missing, std::vector<std::string>{"never"});
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}

TEST(DistStore, NoServerFailsWithinTheTimeout) {
  int port;
  {
    StoreServer s(0);
    port = s.port();
  }
  auto t0 = std::chrono::steady_clock::now();
  try {
    Store a("127.0.0.1", port, 1, 300ms);
    FAIL();
  } catch (const PeerGone& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}

TEST(DistStore, JoinNamesTheRanksThatNeverCame) {
  StoreServer server(0);
  Store r0("127.0.0.1", server.port(), 0, 5s), r2("127.0.0.1", server.port(), 2, 5s);
  try {
    r0.join(4, 200ms);
    FAIL();
  } catch (const StoreTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 1, 3 did not connect"), std::string::npos) << e.what();
  }
}

TEST(DistStore, ADeadRankEndsWaitsWithItsName) {
  StoreServer server(0);
  Store r0("127.0.0.1", server.port(), 0, 10s);
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    try {
      Store r2("127.0.0.1", server.port(), 2, 10s);
      throw std::runtime_error("die");  // unwinding: no goodbye, so rank 2 counts as gone
    } catch (const std::runtime_error&) {
    }
  });
  auto t0 = std::chrono::steady_clock::now();
  try {
    r0.wait({"never"}, 10s);
    FAIL();
  } catch (const PeerGone& e) {
    EXPECT_EQ(e.ranks, (std::vector<int>{2}));
    EXPECT_NE(std::string(e.what()).find("rank 2 exited"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  t.join();
  // A rank that fails because of another (mark_failed) is not a cause, and its leaving ends no wait.
  StoreServer s2(0);
  Store q0("127.0.0.1", s2.port(), 0, 10s);
  {
    Store q1("127.0.0.1", s2.port(), 1, 10s);
    q1.mark_failed();
  }
  EXPECT_THROW(q0.wait({"never"}, 200ms), StoreTimeout);  // a failed rank leaving ends no wait
  EXPECT_EQ(q0.dead_ranks(0ms), (std::vector<int>{}));     // and is not a cause
  try {
    Store q3("127.0.0.1", s2.port(), 3, 10s);
    throw std::runtime_error("die");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(q0.dead_ranks(5s), (std::vector<int>{3}));
  try {
    q0.wait({"never"}, 5s);
    FAIL();
  } catch (const PeerGone& e) {
    EXPECT_EQ(e.ranks, (std::vector<int>{3}));
  }
  // A clean goodbye is not a death.
  { Store q4("127.0.0.1", s2.port(), 4, 10s); }
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(q0.dead_ranks(0ms), (std::vector<int>{3}));
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

// ---- Gloo collectives ---------------------------------------------------------------------

class GlooWorld : public ::testing::TestWithParam<int> {};

TEST_P(GlooWorld, AllReduceSumAvgMax) {
  int world = GetParam();
  run_ranks(world, [world](int r, Communicator& c) {
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.world(), world);
    for (int64_t n : {1, 7, 989, 300001}) {
      auto t = Tensor::empty({n}, DType::F32);
      for (int64_t i = 0; i < n; i++) t.f32()[i] = float(r + 1) * float(i % 13);
      c.all_reduce(t, ReduceOp::Sum);
      float ranks_sum = float(world * (world + 1) / 2);
      for (int64_t i = 0; i < n; i++) ASSERT_EQ(t.f32()[i], ranks_sum * float(i % 13)) << n << " " << i;
      for (int64_t i = 0; i < n; i++) t.f32()[i] = float(r + 1) * float(i % 13);
      c.all_reduce(t, ReduceOp::Avg);
      for (int64_t i = 0; i < n; i++) ASSERT_FLOAT_EQ(t.f32()[i], ranks_sum / float(world) * float(i % 13));
      for (int64_t i = 0; i < n; i++) t.f32()[i] = (i + r) % world == 0 ? 100.0f + float(r) : -float(r);
      c.all_reduce(t, ReduceOp::Max);
      for (int64_t i = 0; i < n; i++) {
        int hot = int((world - i % world) % world);  // the rank r with (i + r) % world == 0
        ASSERT_EQ(t.f32()[i], 100.0f + float(hot)) << i;
      }
    }
  });
}

TEST_P(GlooWorld, ReduceScatter) {
  int world = GetParam();
  run_ranks(world, [world](int r, Communicator& c) {
    for (int64_t block : {1, 5, 111, 70000}) {
      auto in = Tensor::empty({block * world}, DType::F32);
      for (int64_t i = 0; i < in.numel(); i++) in.f32()[i] = float(i) + 1000.0f * float(r);
      auto out = Tensor::empty({block}, DType::F32);
      c.reduce_scatter(in, out, ReduceOp::Sum);
      float rank_sum = 1000.0f * float(world * (world - 1) / 2);
      for (int64_t j = 0; j < block; j++)
        ASSERT_EQ(out.f32()[j], float(world) * float(r * block + j) + rank_sum) << block << " " << j;
      c.reduce_scatter(in, out, ReduceOp::Max);
      for (int64_t j = 0; j < block; j++) ASSERT_EQ(out.f32()[j], float(r * block + j) + 1000.0f * float(world - 1));
    }
  });
}

TEST_P(GlooWorld, AllGatherAndBroadcast) {
  int world = GetParam();
  run_ranks(world, [world](int r, Communicator& c) {
    for (int64_t block : {1, 3, 4099}) {
      auto in = Tensor::empty({block}, DType::F32);
      for (int64_t i = 0; i < block; i++) in.f32()[i] = float(r * 100000 + i);
      auto out = Tensor::zeros({block * world}, DType::F32);
      c.all_gather(in, out);
      for (int q = 0; q < world; q++)
        for (int64_t i = 0; i < block; i++) ASSERT_EQ(out.f32()[q * block + i], float(q * 100000 + i));
      for (int root = 0; root < world; root++) {
        auto t = Tensor::empty({block}, DType::F32);
        for (int64_t i = 0; i < block; i++) t.f32()[i] = float(r * 7 + i);
        c.broadcast(t, root);
        for (int64_t i = 0; i < block; i++) ASSERT_EQ(t.f32()[i], float(root * 7 + i));
      }
    }
    c.barrier();
  });
}

TEST_P(GlooWorld, AsyncWorkCompletesInIssueOrder) {
  int world = GetParam();
  run_ranks(world, [world](int r, Communicator& c) {
    std::vector<Tensor> ts;
    std::vector<WorkPtr> ws;
    for (int k = 0; k < 8; k++) {
      ts.push_back(Tensor::from_f32(std::vector<float>(1000, float(k + r)), {1000}));
      ws.push_back(c.all_reduce_async(ts.back()));
    }
    for (int k = 0; k < 8; k++) {
      ws[size_t(k)]->wait();
      EXPECT_TRUE(ws[size_t(k)]->done());
      EXPECT_EQ(values(ts[size_t(k)]), std::vector<float>(1000, float(world * k + world * (world - 1) / 2)));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooWorld, ::testing::Values(1, 2, 3, 4));

TEST(DistGloo, RejectsWrongShapesAndGpuTensors) {
  run_ranks(2, [](int, Communicator& c) {
    auto in = Tensor::zeros({5}, DType::F32), out = Tensor::zeros({3}, DType::F32);
    EXPECT_THROW(c.reduce_scatter(in, out), InputError);
    EXPECT_THROW(c.all_gather(in, out), InputError);
    EXPECT_THROW(c.all_reduce(Tensor::zeros({4}, DType::BF16)), InputError);
    // Still usable after a rejected call: nothing was sent.
    auto t = Tensor::from_f32({1, 2}, {2});
    c.all_reduce(t);
    EXPECT_EQ(values(t), (std::vector<float>{2, 4}));
  });
}

TEST(DistGloo, DeadPeerIsNamedQuickly) {
  // Rank 2 of 3 leaves (unwinding, as a crash would) while the others all-reduce.
  StoreServer server(0);
  std::vector<std::string> errs(3);
  std::vector<std::thread> ts;
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 3; r++)
    ts.emplace_back([&, r] {
      try {
        auto store = std::make_shared<Store>("127.0.0.1", server.port(), r, 20s);
        CommOptions o;
        o.timeout = 20s;
        auto comm = make_gloo(store, r, 3, o);
        auto t = Tensor::from_f32(std::vector<float>(100000, 1.0f), {100000});
        comm->all_reduce(t);
        if (r == 2) throw std::runtime_error("rank 2 crashes");
        comm->all_reduce(t);
      } catch (const std::exception& e) {
        errs[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_EQ(errs[2], "rank 2 crashes");
  for (int r = 0; r < 2; r++) {
    EXPECT_NE(errs[size_t(r)].find("rank 2 exited or lost its connection"), std::string::npos)
        << "rank " << r << ": " << errs[size_t(r)];
  }
}

// ---- bucketing and flat sharding ----------------------------------------------------------

TEST_P(GlooWorld, BucketedAllReduceMatchesPerTensor) {
  int world = GetParam();
  run_ranks(world, [world](int r, Communicator& c) {
    std::vector<int64_t> sizes{3, 1000, 17, 50000, 1, 989, 4096};
    std::vector<Tensor> ts;
    auto fill = [&] {
      for (size_t k = 0; k < ts.size(); k++)
        for (int64_t i = 0; i < ts[k].numel(); i++) ts[k].f32()[i] = float(r + 1) * float(k + 1) + float(i % 3);
    };
    for (auto n : sizes) ts.push_back(Tensor::empty({n}, DType::F32));
    BucketedAllReduce b(c, ts, 8 * 1024, ReduceOp::Avg);  // small buckets: several, one oversized
    EXPECT_GE(b.num_buckets(), 3u);
    for (int step = 0; step < 2; step++) {
      fill();
      // Gradients become final in reverse order; buckets launch as they fill up.
      for (size_t k = ts.size(); k-- > 0;) b.mark_ready(k);
      b.finish();
      for (size_t k = 0; k < ts.size(); k++)
        for (int64_t i = 0; i < ts[k].numel(); i++)
          ASSERT_FLOAT_EQ(ts[k].f32()[i], float(world + 1) / 2.0f * float(k + 1) + float(i % 3)) << k << " " << i;
    }
    fill();
    b.all_reduce();  // nothing marked: finish() launches all
    EXPECT_FLOAT_EQ(ts[3].f32()[4], float(world + 1) / 2.0f * 4.0f + 1.0f);
  });
}

TEST_P(GlooWorld, FlatShardRoundTrip) {
  int world = GetParam();
  run_ranks(world, [world](int r, Communicator& c) {
    for (int64_t n : {1, 10, 111, 4097}) {
      auto fs = FlatShard::of(n, world);
      EXPECT_EQ(fs.padded % world, 0);
      EXPECT_GE(fs.padded, n);
      EXPECT_LT(fs.padded - n, world);
      int64_t covered = 0;
      for (int q = 0; q < world; q++) covered += fs.valid(q);
      EXPECT_EQ(covered, n);
      auto full = Tensor::empty({n}, DType::F32);  // unpadded: goes through a padded copy
      for (int64_t i = 0; i < n; i++) full.f32()[i] = float(i) * float(r + 1);
      auto shard = Tensor::empty({fs.shard}, DType::F32);
      reduce_scatter_flat(c, fs, full, shard, ReduceOp::Sum)->wait();
      for (int64_t j = 0; j < fs.valid(r); j++)
        ASSERT_EQ(shard.f32()[j], float(fs.begin(r) + j) * float(world * (world + 1) / 2));
      for (int64_t j = fs.valid(r); j < fs.shard; j++) ASSERT_EQ(shard.f32()[j], 0.0f);  // padding
      // Each rank updates its shard; all-gather puts the whole buffer back everywhere.
      for (int64_t j = 0; j < fs.shard; j++) shard.f32()[j] = float(fs.begin(r) + j) + 0.5f;
      auto back = Tensor::zeros({n}, DType::F32);
      all_gather_flat(c, fs, shard, back)->wait();
      for (int64_t i = 0; i < n; i++) ASSERT_EQ(back.f32()[i], float(i) + 0.5f);
    }
  });
}

// ---- bench --------------------------------------------------------------------------------

TEST(DistBench, BusBandwidthFactors) {
  EXPECT_DOUBLE_EQ(busbw_factor("all_reduce", 4), 1.5);
  EXPECT_DOUBLE_EQ(busbw_factor("reduce_scatter", 4), 0.75);
  EXPECT_DOUBLE_EQ(busbw_factor("all_gather", 2), 0.5);
  EXPECT_DOUBLE_EQ(busbw_factor("broadcast", 8), 1.0);
  EXPECT_DOUBLE_EQ(busbw_factor("all_reduce", 1), 0.0);
  EXPECT_THROW(busbw_factor("alltoall", 2), InputError);
}

TEST(DistBench, SweepIsCorrectOnThreeRanks) {
  run_ranks(3, [](int, Communicator& c) {
    CommBenchOptions o;
    o.ops = all_comm_ops();
    o.min_bytes = 4;
    o.max_bytes = 40000;
    o.factor = 10;
    o.iters = 2;
    o.warmup = 1;
    auto rows = bench_comm(c, o);
    ASSERT_EQ(rows.size(), 4u * 5u);
    for (auto& r : rows) {
      EXPECT_EQ(r.wrong, 0) << r.op << " " << r.bytes;
      EXPECT_GT(r.time_us, 0);
      EXPECT_NEAR(r.busbw, r.algbw * busbw_factor(r.op, 3), 1e-9);
      if (r.op == "reduce_scatter" || r.op == "all_gather") EXPECT_EQ(int64_t(r.bytes), r.count * 4 * 3);
      else EXPECT_EQ(int64_t(r.bytes), r.count * 4);
    }
  });
}

TEST(DistBench, CliSweepWithLauncher) {
  auto r = test::run_rig("bench comm --nproc-per-node 2 --op all --min-bytes 1K --max-bytes 64K --iters 2 "
                         "--backend gloo --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["world"], 2);
  EXPECT_EQ(j["backend"], "gloo");
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_EQ(j["rows"].size(), 4u * 7u);
  auto t = test::run_rig("bench comm --max-bytes 8K --iters 1");
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_NE(t.out.find("busbw"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("all results correct"), std::string::npos) << t.out;
}

// ---- launcher -----------------------------------------------------------------------------

TEST(DistLaunch, FlagsAreStrippedForWorkers) {
  std::vector<std::string> in{"rig", "train", "c.yaml", "--nproc-per-node", "4", "--nnodes=2", "--node-rank",
                              "1", "--master", "h:1", "--lr", "3"};
  EXPECT_EQ(strip_launch_flags(in), (std::vector<std::string>{"rig", "train", "c.yaml", "--lr", "3"}));
  LaunchOptions o;
  parse_master("node01:29400", o);
  EXPECT_EQ(o.master_addr, "node01");
  EXPECT_EQ(o.master_port, 29400);
  EXPECT_THROW(parse_master("node01", o), InputError);
  EXPECT_THROW(parse_master("node01:x", o), InputError);
  LaunchOptions none;
  none.nproc_per_node = 0;
  EXPECT_THROW(launch_local(none, {"true"}), InputError);
}

TEST(DistLaunch, FourWorkersAllReduce) {
  auto r = test::run_rig("debug allreduce-check --nproc-per-node 4 --numel 10000");
  EXPECT_EQ(r.code, 0) << r.out;
  for (int k = 0; k < 4; k++)
    EXPECT_NE(r.out.find(fmt::format("rank {} of 4: all-reduce check passed", k)), std::string::npos) << r.out;
}

TEST(DistLaunch, KilledWorkerIsNamedByTheOthers) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = test::run_rig("debug allreduce-check --nproc-per-node 3 --numel 10000 --fail-rank 1 --fail-mode kill --timeout-ms 20000");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);  // well within the 20 s timeout
  EXPECT_EQ(r.code, 128 + 9) << r.out;
  EXPECT_NE(r.out.find("rig launch: rank 1 (pid"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("was killed by signal 9"), std::string::npos) << r.out;
  for (int k : {0, 2})
    EXPECT_NE(r.out.find(fmt::format("rank {}: Gloo all_reduce #1 (10000 floats) failed: rank 1 exited", k)),
              std::string::npos)
        << r.out;
}

TEST(DistLaunch, WorkerThatFailsEarlyIsNamed) {
  auto r = test::run_rig("debug allreduce-check --nproc-per-node 4 --fail-rank 2 --fail-mode exit --timeout-ms 20000");
  EXPECT_EQ(r.code, 1) << r.out;
  // (Which exit the launcher sees first is a race; the summary lists every failed rank.)
  EXPECT_NE(r.out.find("rig launch:   rank 2 exited with code 1"), std::string::npos) << r.out;
  for (int k : {0, 1, 3})
    EXPECT_NE(r.out.find(fmt::format("rank {}: Gloo all_reduce #1", k)), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("rank 3 exited or lost"), std::string::npos) << r.out;  // only the cause is blamed
  EXPECT_NE(r.out.find("rank 2 exited or lost its connection"), std::string::npos) << r.out;
}

TEST(DistLaunch, HungWorkerIsNamedAfterTheTimeout) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = test::run_rig("debug allreduce-check --nproc-per-node 3 --numel 10000 --fail-rank 1 --fail-mode hang --timeout-ms 1500 "
                         "--launch-grace-ms 6000");  // rank 0 keeps the store up to 5 s for the others
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  EXPECT_NE(r.code, 0) << r.out;
  for (int k : {0, 2})
    EXPECT_NE(r.out.find(fmt::format("rank {}: Gloo all_reduce #1 (10000 floats) failed: rank 1 did not take part", k)),
              std::string::npos)
        << r.out;
  EXPECT_NE(r.out.find("sending SIGTERM"), std::string::npos) << r.out;  // the hung one is stopped
}

TEST(DistLaunch, SigtermIsForwardedToWorkers) {
  std::string dir = test::temp_dir("dist-sigterm");
  std::string cmd = fmt::format("timeout --preserve-status -s TERM 2 {} debug allreduce-check --nproc-per-node 2 "
                                "--fail-rank 0 --fail-mode hang --timeout-ms 60000 > {}/out 2>&1; echo $? > {}/rc",
                                RIG_BINARY, dir, dir);
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  std::ifstream rc(dir + "/rc"), out(dir + "/out");
  int code = -1;
  rc >> code;
  std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_EQ(code, 128 + 15) << text;
  EXPECT_NE(text.find("passing it to 2 workers"), std::string::npos) << text;
}

TEST(DistLaunch, MissingRankIsNamedAtRendezvous) {
  // World of 2 but only rank 0 starts: the rendezvous names rank 1 within the timeout.
  auto r = test::run_rig("debug allreduce-check --timeout-ms 500");  // world of 1 works alone
  EXPECT_EQ(r.code, 0) << r.out;
  int port = free_port();
  std::string cmd = fmt::format("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} {} debug allreduce-check "
                                "--timeout-ms 500 2>&1",
                                port, RIG_BINARY);
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_TRUE(p);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) text.append(buf, n);
  int st = pclose(p);
  EXPECT_NE(WEXITSTATUS(st), 0) << text;
  EXPECT_NE(text.find("rank 1 did not connect to the rendezvous store"), std::string::npos) << text;
}
