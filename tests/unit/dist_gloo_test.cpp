// Gloo collectives over 127.0.0.1 on 1..4 ranks (threads), buckets, flat shards and the bench.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "rig/dist/bench.h"
#include "rig/dist/bucket.h"
#include "rig/dist/communicator.h"
#include "rig/dist/store.h"
#include "test_util.h"

using namespace rig;
using namespace rig::dist;
using namespace std::chrono_literals;

namespace {

// Runs fn(rank, comm) on `world` threads, each with its own store client and Gloo communicator.
// With `shm`, the collectives move through a shared-memory segment (make_staged with the store).
void run_ranks(int world, const std::function<void(int, Communicator&)>& fn, Millis timeout = 20s,
               bool shm = false) {
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
        if (shm) comm = make_staged(std::move(comm), Device::cpu(), store);
        fn(r, *comm);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; r++) EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
}

std::vector<float> values(const Tensor& t) {
  return {t.f32(), t.f32() + t.numel()};
}

}  // namespace

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
      for (int64_t i = 0; i < n; i++)
        ASSERT_EQ(t.f32()[i], ranks_sum * float(i % 13)) << n << " " << i;
      for (int64_t i = 0; i < n; i++) t.f32()[i] = float(r + 1) * float(i % 13);
      c.all_reduce(t, ReduceOp::Avg);
      for (int64_t i = 0; i < n; i++)
        ASSERT_FLOAT_EQ(t.f32()[i], ranks_sum / float(world) * float(i % 13));
      for (int64_t i = 0; i < n; i++)
        t.f32()[i] = (i + r) % world == 0 ? 100.0f + float(r) : -float(r);
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
        ASSERT_EQ(out.f32()[j], float(world) * float(r * block + j) + rank_sum)
            << block << " " << j;
      c.reduce_scatter(in, out, ReduceOp::Max);
      for (int64_t j = 0; j < block; j++)
        ASSERT_EQ(out.f32()[j], float(r * block + j) + 1000.0f * float(world - 1));
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
        for (int64_t i = 0; i < block; i++)
          ASSERT_EQ(out.f32()[q * block + i], float(q * 100000 + i));
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
      EXPECT_EQ(values(ts[size_t(k)]),
                std::vector<float>(1000, float(world * k + world * (world - 1) / 2)));
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
  // Rank 2 of 3 leaves (unwinding, as a crash would) while the others all-reduce. "Quickly": the
  // others learn it from the store (the message below), not from their timeout, which is set far
  // away (10 minutes) so that no clock needs reading here.
  StoreServer server(0);
  std::vector<std::string> errs(3);
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; r++)
    ts.emplace_back([&, r] {
      try {
        auto store = std::make_shared<Store>("127.0.0.1", server.port(), r, 600s);
        CommOptions o;
        o.timeout = 600s;
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
        for (int64_t i = 0; i < ts[k].numel(); i++)
          ts[k].f32()[i] = float(r + 1) * float(k + 1) + float(i % 3);
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
          ASSERT_FLOAT_EQ(ts[k].f32()[i], float(world + 1) / 2.0f * float(k + 1) + float(i % 3))
              << k << " " << i;
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
      if (r.op == "reduce_scatter" || r.op == "all_gather")
        EXPECT_EQ(int64_t(r.bytes), r.count * 4 * 3);
      else
        EXPECT_EQ(int64_t(r.bytes), r.count * 4);
    }
  });
}

TEST(DistBench, CliSweepWithLauncher) {
  auto r = test::run_rig(
      "bench comm --nproc-per-node 2 --op all --min-bytes 1K --max-bytes 64K --iters 2 "
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

// ---- ranks on one host: collectives through shared memory ----------------------------------

TEST(DistShm, EveryCollectiveMatchesTheClosedFormAtEverySize) {
  for (int world : {2, 4})
    run_ranks(
        world,
        [world](int r, Communicator& c) {
          CommBenchOptions o;
          o.ops = all_comm_ops();
          o.min_bytes = 4;
          o.max_bytes = 4 << 20;
          o.factor = 16;
          o.iters = 2;
          o.warmup = 1;
          for (auto& row : bench_comm(c, o)) EXPECT_EQ(row.wrong, 0) << row.op << " " << row.bytes;
          // Avg and Max, and a reduce-scatter of rank-dependent blocks.
          Tensor t = Tensor::from_f32({float(r), float(-r), 1.0f}, {3});
          c.all_reduce(t, ReduceOp::Max);
          EXPECT_EQ(values(t), (std::vector<float>{float(world - 1), 0.0f, 1.0f}));
          Tensor a = Tensor::from_f32({float(r) * 2}, {1});
          c.all_reduce(a, ReduceOp::Avg);
          EXPECT_FLOAT_EQ(a.f32()[0], float(world - 1));
          std::vector<float> in;
          for (int q = 0; q < world; ++q) in.insert(in.end(), {float(q), float(r)});
          Tensor out = Tensor::empty({2}, DType::F32);
          c.reduce_scatter(Tensor::from_f32(in, {2 * world}), out, ReduceOp::Sum);
          EXPECT_EQ(values(out),
                    (std::vector<float>{float(r * world), float(world * (world - 1) / 2)}));
          c.barrier();
        },
        20s, true);
}
