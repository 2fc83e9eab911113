// The NCCL backend: CUDA tensors (F32, BF16, F16). The unique id travels through the store;
// the communicator is non-blocking so that init and every wait can poll
// ncclCommGetAsyncError, give up after the timeout with ncclCommAbort, and blame a rank.
#ifdef RIG_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <thread>

#include "rig/core/cuda_check.h"
#include "rig/dist/communicator.h"

namespace rig::dist {

bool nccl_built() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t, const char* op) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    default: bad_input("NCCL {}: dtype {} is not supported (F32, BF16, F16)", op, dtype_name(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
  }
  return ncclSum;
}

// State shared by the communicator and its outstanding works: once aborted, all fail.
struct NcclState {
  std::shared_ptr<Store> store;
  int rank = 0, world = 1, device = 0;
  Millis timeout{60000};
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  std::mutex mu;
  std::string broken;

  // Polls until the non-blocking comm has no call in progress; aborts on error or timeout.
  void settle(const std::string& what, Clock::time_point deadline) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm, &st);
      if (r != ncclSuccess) st = r;
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) abort_with(what, fmt::format("NCCL error: {} ({})", ncclGetErrorString(st),
                                                             ncclGetLastError(comm)));
      if (Clock::now() > deadline) abort_with(what, fmt::format("timed out after {} ms", timeout.count()));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  [[noreturn]] void abort_with(const std::string& what, const std::string& detail) {
    std::lock_guard lk(mu);
    if (broken.empty()) {
      ncclCommAbort(comm);  // frees the stuck kernels so the process can exit
      comm = nullptr;
      std::string cause;
      try {
        cause = blame_failure(*store, rank, world, timeout, what);
      } catch (const std::exception& e) {
        cause = e.what();
      }
      broken = fmt::format("rank {}: NCCL {} failed: {} [{}]", rank, what, cause, detail);
    }
    fail("{}", broken);
  }
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> s, cudaEvent_t ev, std::string what)
      : s_(std::move(s)), ev_(ev), what_(std::move(what)), deadline_(Clock::now() + s_->timeout) {}
  ~NcclWork() override { cudaEventDestroy(ev_); }
  void wait() override {
    for (;;) {
      {
        std::lock_guard lk(s_->mu);
        if (!s_->broken.empty()) fail("{}", s_->broken);
      }
      cudaError_t e = cudaEventQuery(ev_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) RIG_CUDA_CHECK(e);
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(s_->comm, &st);
      if (st != ncclSuccess && st != ncclInProgress)
        s_->abort_with(what_, fmt::format("NCCL error: {}", ncclGetErrorString(st)));
      if (Clock::now() > deadline_)
        s_->abort_with(what_, fmt::format("not finished after {} ms", s_->timeout.count()));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  bool done() override {
    std::lock_guard lk(s_->mu);
    return !s_->broken.empty() || cudaEventQuery(ev_) != cudaErrorNotReady;
  }

 private:
  std::shared_ptr<NcclState> s_;
  cudaEvent_t ev_;
  std::string what_;
  Clock::time_point deadline_;
};

class NcclComm : public Communicator {
 public:
  NcclComm(std::shared_ptr<Store> store, int rank, int world, int device, const CommOptions& opts)
      : s_(std::make_shared<NcclState>()), user_stream_(static_cast<cudaStream_t>(opts.cuda_stream)) {
    s_->store = std::move(store);
    s_->rank = rank;
    s_->world = world;
    s_->device = device;
    s_->timeout = opts.timeout;
    RIG_CUDA_CHECK(cudaSetDevice(device));
    RIG_CUDA_CHECK(cudaStreamCreateWithFlags(&s_->stream, cudaStreamNonBlocking));
    ncclUniqueId id;
    // A fresh key per communicator, agreed on by all ranks through the store's counter order.
    std::string key = "nccl/id/" + std::to_string(s_->store->add("nccl/generation/" + std::to_string(rank), 1));
    if (rank == 0) {
      RIG_NCCL_CHECK(ncclGetUniqueId(&id));
      s_->store->set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
    }
    std::string v;
    try {
      v = s_->store->get(key, opts.timeout);
    } catch (const Error& e) {
      fail("rank {}: NCCL rendezvous failed: {}", rank, e.what());
    }
    if (v.size() != sizeof(id)) fail("rank {}: NCCL unique id has {} bytes, expected {}", rank, v.size(), sizeof(id));
    std::memcpy(&id, v.data(), sizeof(id));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&s_->comm, world, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
      fail("rank {}: ncclCommInitRankConfig on cuda:{} failed: {}", rank, device, ncclGetErrorString(r));
    s_->settle("init", Clock::now() + opts.timeout);
    float zero = 0;
    RIG_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
    RIG_CUDA_CHECK(cudaMemcpy(scratch_, &zero, sizeof(float), cudaMemcpyHostToDevice));
  }

  ~NcclComm() override {
    if (s_->comm) {
      cudaStreamSynchronize(s_->stream);
      ncclCommFinalize(s_->comm);
      try {
        s_->settle("finalize", Clock::now() + s_->timeout);
      } catch (const std::exception&) {
      }
      if (s_->comm) ncclCommDestroy(s_->comm);
    }
    if (scratch_) cudaFree(scratch_);
    if (s_->stream) cudaStreamDestroy(s_->stream);
  }

  int rank() const override { return s_->rank; }
  int world() const override { return s_->world; }
  Backend backend() const override { return Backend::Nccl; }
  Device device() const override { return Device::cuda(s_->device); }

  WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) override {
    check(t, "all_reduce");
    return launch("all_reduce", [&] {
      return ncclAllReduce(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t.dtype(), "all_reduce"), nccl_op(op),
                           s_->comm, s_->stream);
    });
  }
  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    if (in.numel() != out.numel() * s_->world || in.dtype() != out.dtype())
      bad_input("reduce_scatter: input {} {} elements, expected world {} x output {} {}", dtype_name(in.dtype()),
                in.numel(), s_->world, dtype_name(out.dtype()), out.numel());
    return launch("reduce_scatter", [&] {
      return ncclReduceScatter(in.raw(), out.raw(), size_t(out.numel()), nccl_type(in.dtype(), "reduce_scatter"),
                               nccl_op(op), s_->comm, s_->stream);
    });
  }
  WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    if (out.numel() != in.numel() * s_->world || in.dtype() != out.dtype())
      bad_input("all_gather: output {} {} elements, expected world {} x input {} {}", dtype_name(out.dtype()),
                out.numel(), s_->world, dtype_name(in.dtype()), in.numel());
    return launch("all_gather", [&] {
      return ncclAllGather(in.raw(), out.raw(), size_t(in.numel()), nccl_type(in.dtype(), "all_gather"), s_->comm,
                           s_->stream);
    });
  }
  WorkPtr broadcast_async(const Tensor& t, int root) override {
    check(t, "broadcast");
    if (root < 0 || root >= s_->world) bad_input("broadcast: root {} outside a world of {}", root, s_->world);
    return launch("broadcast", [&] {
      return ncclBroadcast(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t.dtype(), "broadcast"), root, s_->comm,
                           s_->stream);
    });
  }
  WorkPtr barrier_async() override {
    return launch("barrier", [&] { return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, s_->comm, s_->stream); });
  }

 private:
  void check(const Tensor& t, const char* op) {
    if (!(t.device() == Device::cuda(s_->device)))
      bad_input("NCCL {}: tensor is on {}, this rank's communicator uses cuda:{} (Gloo takes CPU tensors)", op,
                t.device().str(), s_->device);
    nccl_type(t.dtype(), op);
  }

  template <typename F>
  WorkPtr launch(const char* name, F&& call) {
    {
      std::lock_guard lk(s_->mu);
      if (!s_->broken.empty()) fail("{}", s_->broken);
    }
    std::string what = fmt::format("{} #{}", name, seq_++);
    RIG_CUDA_CHECK(cudaSetDevice(s_->device));
    // Collectives run on our stream, after what the caller already queued on theirs.
    cudaEvent_t ready, done;
    RIG_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    RIG_CUDA_CHECK(cudaEventRecord(ready, user_stream_));
    RIG_CUDA_CHECK(cudaStreamWaitEvent(s_->stream, ready, 0));
    cudaEventDestroy(ready);
    ncclResult_t r = call();
    if (r != ncclSuccess && r != ncclInProgress)
      s_->abort_with(what, fmt::format("NCCL error: {}", ncclGetErrorString(r)));
    s_->settle(what, Clock::now() + s_->timeout);
    RIG_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    RIG_CUDA_CHECK(cudaEventRecord(done, s_->stream));
    return std::make_shared<NcclWork>(s_, done, what);
  }

  std::shared_ptr<NcclState> s_;
  cudaStream_t user_stream_;
  float* scratch_ = nullptr;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl(std::shared_ptr<Store> store, int rank, int world, int device,
                                        const CommOptions& opts) {
  return std::make_unique<NcclComm>(std::move(store), rank, world, device, opts);
}

}  // namespace rig::dist
#endif
