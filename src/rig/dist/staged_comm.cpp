// Collectives for tensors on a GPU that several ranks share: NCCL refuses two ranks on one device,
// so each collective copies its operands into page-locked host memory, runs on the host
// communicator (Gloo), and copies the results back when it is waited for, as PyTorch's Gloo
// backend does with CUDA tensors. The copy in is synchronous on the legacy default stream (the
// one the ops run on), so it sees every kernel queued before the call.
//
// When every rank is on this host (the usual case of ranks sharing GPUs), the data moves through
// one shared-memory segment instead of Gloo's sockets: each rank copies its part in, Gloo's
// barrier, each copies what it needs out (reductions summed on the host in rank order), barrier
// again so the segment can be reused. Several times Gloo's loopback bandwidth; each collective
// then runs when it is issued (no overlap), which ranks sharing a GPU do not miss.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
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

// A shared-memory segment every rank of the host maps, grown (on every rank at the same
// collective, since all issue the same ones) when a collective needs more.
class ShmArena {
 public:
  ShmArena(Communicator& host, const std::shared_ptr<Store>& store, Device dev)
      : host_(host), dev_(dev) {
    static std::atomic<int> made{0};
    if (host.rank() == 0) {
      prefix_ = fmt::format("/rig-{}-{}", ::getpid(), made++);
      store->set("rig/staged-shm", prefix_);
    } else {
      prefix_ = store->get("rig/staged-shm");
    }
    host_.barrier();  // everyone has read the name before it is reused
  }
  ~ShmArena() { unmap(); }

  char* get(size_t bytes) {
    if (bytes <= size_) return base_;
    unmap();
    const size_t n = std::max(bytes, size_ * 2 + (size_t(2) << 20)) / (size_t(2) << 20) *
                         (size_t(2) << 20) + (size_t(2) << 20);
    const std::string name = fmt::format("{}-{}", prefix_, gen_++);
    int fd = -1;
    if (host_.rank() == 0) {
      ::shm_unlink(name.c_str());
      fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 || ::ftruncate(fd, off_t(n)) != 0)
        fail("cannot make a shared-memory segment of {} bytes for the ranks on this host ({}); "
             "set RIG_STAGED_SHM=0 to use Gloo's sockets",
             n, std::strerror(errno));
    }
    host_.barrier();
    if (fd < 0) fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) fail("cannot open the shared-memory segment {}: {}", name, std::strerror(errno));
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) fail("cannot map {} bytes of shared memory: {}", n, std::strerror(errno));
    base_ = static_cast<char*>(p);
    size_ = n;
    registered_ = dev_.is_cuda() && pin_host_range(base_, size_);
    host_.barrier();
    if (host_.rank() == 0) ::shm_unlink(name.c_str());
    return base_;
  }

 private:
  void unmap() {
    if (!base_) return;
    if (registered_) unpin_host_range(base_);
    ::munmap(base_, size_);
    base_ = nullptr;
    size_ = 0;
  }
  Communicator& host_;
  Device dev_;
  std::string prefix_;
  int gen_ = 0;
  char* base_ = nullptr;
  size_t size_ = 0;
  bool registered_ = false;
};

// A Work already done (shared-memory collectives complete when issued).
class DoneWork : public Work {
 public:
  void wait() override {}
  bool done() override { return true; }
};

class StagedComm : public Communicator {
 public:
  StagedComm(std::unique_ptr<Communicator> host, Device dev, const std::shared_ptr<Store>& store)
      : host_(std::move(host)), dev_(dev) {
    if (!host_->device().is_cpu())
      fail("staged collectives need a host communicator, got one on {}", host_->device().str());
    if (store && host_->world() > 1) shm_ = std::make_unique<ShmArena>(*host_, store, dev_);
  }
  int rank() const override { return host_->rank(); }
  int world() const override { return host_->world(); }
  Backend backend() const override { return host_->backend(); }
  Device device() const override { return dev_; }

  WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) override {
    if (shm_ && t.numel() > 0) {
      check(t, "all_reduce", "the tensor");
      const int64_t n = t.numel();
      char* a = shm_->get(size_t(world() * n) * 4);
      put(a + size_t(rank() * n) * 4, t);
      host_->barrier();
      reduce(a, n, n, 0, op, t);
      host_->barrier();
      return done();
    }
    Tensor h = stage_in(t, "all_reduce", "the tensor");
    return std::make_shared<StagedWork>(host_->all_reduce_async(h, op), back(t, h));
  }
  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) override {
    if (shm_ && out.numel() > 0) {
      check(in, "reduce_scatter", "the input");
      check(out, "reduce_scatter", "the output");
      if (in.numel() != out.numel() * world())
        bad_input("reduce_scatter: input has {} elements, expected world {} x output {}",
                  in.numel(), world(), out.numel());
      const int64_t n = in.numel();
      char* a = shm_->get(size_t(world() * n) * 4);
      put(a + size_t(rank() * n) * 4, in);
      host_->barrier();
      reduce(a, out.numel(), n, rank() * out.numel(), op, out);
      host_->barrier();
      return done();
    }
    Tensor hi = stage_in(in, "reduce_scatter", "the input");
    Tensor ho = stage_out(out, "reduce_scatter", "the output");
    return std::make_shared<StagedWork>(host_->reduce_scatter_async(hi, ho, op), back(out, ho));
  }
  WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override {
    if (shm_ && in.numel() > 0) {
      check(in, "all_gather", "the input");
      check(out, "all_gather", "the output");
      if (out.numel() != in.numel() * world())
        bad_input("all_gather: output has {} elements, expected world {} x input {}", out.numel(),
                  world(), in.numel());
      char* a = shm_->get(out.nbytes());
      put(a + size_t(rank()) * in.nbytes(), in);
      host_->barrier();
      copy_bytes(out.raw(), out.device(), a, Device::cpu(), out.nbytes());
      host_->barrier();
      return done();
    }
    Tensor hi = stage_in(in, "all_gather", "the input");
    Tensor ho = stage_out(out, "all_gather", "the output");
    return std::make_shared<StagedWork>(host_->all_gather_async(hi, ho), back(out, ho));
  }
  WorkPtr broadcast_async(const Tensor& t, int root) override {
    if (shm_ && t.numel() > 0) {
      check(t, "broadcast", "the tensor");
      if (root < 0 || root >= world()) bad_input("broadcast: root {} outside a world of {}", root, world());
      char* a = shm_->get(t.nbytes());
      if (rank() == root) put(a, t);
      host_->barrier();
      if (rank() != root) copy_bytes(t.raw(), t.device(), a, Device::cpu(), t.nbytes());
      host_->barrier();
      return done();
    }
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
  static WorkPtr done() { return std::make_shared<DoneWork>(); }
  static void put(char* dst, const Tensor& t) {
    copy_bytes(dst, Device::cpu(), t.raw(), t.device(), t.nbytes());
  }
  // out = op over ranks q of the n floats at [q * stride + offset] of the segment, summed in rank
  // order (the same order on every rank).
  void reduce(const char* a, int64_t n, int64_t stride, int64_t offset, ReduceOp op,
              const Tensor& out) {
    std::vector<float> acc(static_cast<size_t>(n));
    const auto* f = reinterpret_cast<const float*>(a);
    std::memcpy(acc.data(), f + offset, size_t(n) * 4);
    for (int q = 1; q < world(); ++q) {
      const float* src = f + q * stride + offset;
      if (op == ReduceOp::Max)
        for (int64_t i = 0; i < n; ++i) acc[size_t(i)] = std::max(acc[size_t(i)], src[i]);
      else
        for (int64_t i = 0; i < n; ++i) acc[size_t(i)] += src[i];
    }
    if (op == ReduceOp::Avg)
      for (float& x : acc) x /= float(world());
    copy_bytes(out.raw(), out.device(), acc.data(), Device::cpu(), size_t(n) * 4);
  }

  std::unique_ptr<Communicator> host_;
  Device dev_;
  std::shared_ptr<StagingPool> pool_ = std::make_shared<StagingPool>();
  std::unique_ptr<ShmArena> shm_;  // every rank on this host
};

}  // namespace

std::unique_ptr<Communicator> make_staged(std::unique_ptr<Communicator> host, Device dev,
                                          std::shared_ptr<Store> node_store) {
  const char* env = std::getenv("RIG_STAGED_SHM");
  if (env && std::string(env) == "0") node_store.reset();
  if (dev.is_cpu() && !node_store) return host;
  return std::make_unique<StagedComm>(std::move(host), dev, node_store);
}

}  // namespace rig::dist
