// NCCL backend on real GPUs: a world of 1 on one device (and 2 threads when there are two
// GPUs). Skips with the reason on machines without a GPU or builds without NCCL.
#include <gtest/gtest.h>
#ifdef RIG_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <thread>

#include "rig/dist/bench.h"
#include "rig/dist/bucket.h"
#include "rig/dist/communicator.h"

using namespace rig;
using namespace rig::dist;
using namespace std::chrono_literals;

namespace {

#define SKIP_WITHOUT_NCCL()                                                             \
  do {                                                                                  \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device: NCCL tests need a GPU";     \
    if (!nccl_built()) GTEST_SKIP() << "this build has no NCCL (configure with NCCL)"; \
  } while (0)

std::vector<float> host(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  return {h.f32(), h.f32() + h.numel()};
}

Tensor gpu(const std::vector<float>& v, int dev = 0) { return Tensor::from_f32(v, {int64_t(v.size())}).to(Device::cuda(dev)); }

}  // namespace

TEST(Nccl, WorldOfOneAllReduce) {
  SKIP_WITHOUT_NCCL();
  StoreServer server(0);
  auto store = std::make_shared<Store>("127.0.0.1", server.port(), 0, 30s);
  auto comm = make_nccl(store, 0, 1, 0);
  EXPECT_EQ(comm->world(), 1);
  EXPECT_EQ(comm->device(), Device::cuda(0));
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); i++) v[i] = float(i % 17) - 3.0f;
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
    Tensor t = gpu(v);
    auto w = comm->all_reduce_async(t, op);
    w->wait();
    EXPECT_TRUE(w->done());
    EXPECT_EQ(host(t), v) << reduce_op_name(op);
  }
  Tensor in = gpu(v), out = gpu(std::vector<float>(1000, 0.0f));
  comm->reduce_scatter(in, out);
  EXPECT_EQ(host(out), v);
  Tensor g = gpu(std::vector<float>(1000, 0.0f));
  comm->all_gather(in, g);
  EXPECT_EQ(host(g), v);
  comm->broadcast(in, 0);
  EXPECT_EQ(host(in), v);
  comm->barrier();
  EXPECT_THROW(comm->all_reduce(Tensor::from_f32(v, {1000})), InputError);  // a CPU tensor
}

TEST(Nccl, WorldOfOneBenchAndBuckets) {
  SKIP_WITHOUT_NCCL();
  StoreServer server(0);
  auto store = std::make_shared<Store>("127.0.0.1", server.port(), 0, 30s);
  auto comm = make_nccl(store, 0, 1, 0);
  CommBenchOptions o;
  o.ops = all_comm_ops();
  o.min_bytes = 1024;
  o.max_bytes = 1 << 20;
  o.iters = 3;
  for (auto& r : bench_comm(*comm, o)) EXPECT_EQ(r.wrong, 0) << r.op << " " << r.bytes;
  std::vector<Tensor> ts{gpu(std::vector<float>(100, 2.0f)), gpu(std::vector<float>(5000, 3.0f))};
  BucketedAllReduce b(*comm, ts, 1024, ReduceOp::Avg);
  b.all_reduce();
  EXPECT_EQ(host(ts[1]), std::vector<float>(5000, 3.0f));
}

TEST(Nccl, TwoGpusAllReduce) {
  SKIP_WITHOUT_NCCL();
  int n = 0;
#ifdef RIG_WITH_CUDA
  cudaGetDeviceCount(&n);
#endif
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, found " << n;
  StoreServer server(0);
  std::vector<std::string> errs(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; r++)
    ts.emplace_back([&, r] {
      try {
        auto store = std::make_shared<Store>("127.0.0.1", server.port(), r, 60s);
        auto comm = make_nccl(store, r, 2, r);
        Tensor t = gpu(std::vector<float>(4097, float(r + 1)), r);
        comm->all_reduce(t);
        if (host(t) != std::vector<float>(4097, 3.0f)) errs[size_t(r)] = "wrong sum";
      } catch (const std::exception& e) {
        errs[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(errs[0], "");
  EXPECT_EQ(errs[1], "");
}
