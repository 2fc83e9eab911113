// Collectives for tensors on a GPU that several ranks share: NCCL refuses two ranks on one device,
// so each collective copies its operands into page-locked host memory, runs on the host
// communicator (Gloo), and copies the results back when it is waited for, as PyTorch's Gloo
// backend does with CUDA tensors. The copy in is synchronous on the legacy default stream (the
// one the ops run on), so it sees every kernel queued before the call.
#include <map>
#include <mutex>

#include "rig/core/host_memory.h"
#include "rig/dist/communicator.h"

namespace rig::dist {

namespace {

// Page-locked buffers reused by size: a sharded step asks for the same few sizes every layer,
// and cudaHostAlloc costs milliseconds.
class StagingPool : public std::enable_shared_from_this<StagingPool> {
 public:
  Tensor take(int64_t numel) {
    const size_t bytes = size_t(numel) * 4;
    std::shared_ptr<void> block;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        block = std::move(it->second);
        free_.erase(it);
      }
    }
    if (!block) block = pinned_host_block(bytes);
    // The tensor's owner hands the block back to the pool when the last view goes.
    void* p = block.get();
    std::weak_ptr<StagingPool> pool = weak_from_this();
    std::shared_ptr<void> owner(p, [pool, block, bytes](void*) mutable {
      if (auto s = pool.lock()) {
        std::lock_guard<std::mutex> g(s->mu_);
        s->free_.emplace(bytes, std::move(block));
      }
    });
    return Tensor::view(p, {numel}, DType::F32, Device::cpu(), std::move(owner));
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, std::shared_ptr<void>> free_;
};

// Copies the staged results back to the device once the host collective has finished.
class StagedWork : public Work {
 public:
  StagedWork(WorkPtr inner, std::vector<std::pair<Tensor, Tensor>> back)
      : inner_(std::move(inner)), back_(std::move(back)) {}
  ~StagedWork() override {
    // The host buffers go back to the pool only after the collective stops touching them.
    if (!back_.empty()) try {
        inner_->wait();
      } catch (const std::exception&) {
      }
  }
  void wait() override {
    inner_->wait();
    for (auto& [dev, host] : back_) dev.copy_from(host);
    back_.clear();
  }
  bool done() override { return inner_->done(); }

 private:
  WorkPtr inner_;
  std::vector<std::pair<Tensor, Tensor>> back_;  // device tensor, its host copy
};

class StagedComm : public Communicator {
 public:
  StagedComm(std::unique_ptr<Communicator> host, Device dev) : host_(std::move(host)), dev_(dev) {
    if (!host_->device().is_cpu())
      fail("staged collectives need a host communicator, got one on {}", host_->device().str());
  }
  int rank() const override { return host_->rank(); }
  int world() const override { return host_->world(); }
  Backend backend() const override { return host_->backend(); }
  Device device() const override { return dev_; }

  WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) override {
    Tensor h = stage_in(t, "all_reduce", "the tensor");
    return std::make_shared<StagedWork>(host_->all_reduce_async(h, op), back(t, h));
  }
  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) override {
    Tensor hi = stage_in(in, "reduce_scatter", "the input");
    Tensor ho = stage_out(out, "reduce_scatter", "the output");
    return std::make_shared<StagedWork>(host_->reduce_scatter_async(hi, ho, op), back(out, ho));
  }
  WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override {
    Tensor hi = stage_in(in, "all_gather", "the input");
    Tensor ho = stage_out(out, "all_gather", "the output");
    return std::make_shared<StagedWork>(host_->all_gather_async(hi, ho), back(out, ho));
  }
  WorkPtr broadcast_async(const Tensor& t, int root) override {
    Tensor h = stage_in(t, "broadcast", "the tensor");
    return std::make_shared<StagedWork>(host_->broadcast_async(h, root), back(t, h));
  }
  WorkPtr barrier_async() override { return host_->barrier_async(); }

 private:
  void check(const Tensor& t, const char* op, const char* which) const {
    if (!(t.device() == dev_) || t.dtype() != DType::F32)
      bad_input("staged {} on {}: {} must be an F32 tensor there, got a {} {} tensor", op,
                dev_.str(), which, t.device().str(), dtype_name(t.dtype()));
  }
  Tensor stage_in(const Tensor& t, const char* op, const char* which) {
    check(t, op, which);
    Tensor h = pool_->take(t.numel()).reshape(t.shape());
    h.copy_from(t);
    return h;
  }
  Tensor stage_out(const Tensor& t, const char* op, const char* which) {
    check(t, op, which);
    return pool_->take(t.numel()).reshape(t.shape());
  }
  static std::vector<std::pair<Tensor, Tensor>> back(const Tensor& dev, const Tensor& host) {
    return {{dev, host}};
  }

  std::unique_ptr<Communicator> host_;
  Device dev_;
  std::shared_ptr<StagingPool> pool_ = std::make_shared<StagingPool>();
};

}  // namespace

std::unique_ptr<Communicator> make_staged(std::unique_ptr<Communicator> host, Device dev) {
  if (dev.is_cpu()) return host;
  return std::make_unique<StagedComm>(std::move(host), dev);
}

}  // namespace rig::dist
