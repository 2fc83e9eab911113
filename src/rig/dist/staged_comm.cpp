// Collectives for tensors on a GPU that several ranks share: NCCL refuses two ranks on one device,
// so each collective copies its operands into page-locked host memory, runs on the host
// communicator (Gloo), and copies the results back when it is waited for, as PyTorch's Gloo
// backend does with CUDA tensors. The copy in is synchronous on the legacy default stream (the
// one the ops run on), so it sees every kernel queued before the call.
//
// When every rank is on this host (the usual case of ranks sharing GPUs), the data moves through
// one shared-memory segment instead of Gloo's sockets: each rank copies its part in, Gloo's
// barrier, each copies what it needs out (reductions: each rank sums its slice in rank order into
// a result area of the segment), barrier again so the segment can be reused. Several times Gloo's
// loopback bandwidth; each collective then runs when it is issued (no overlap), which ranks sharing
// a GPU do not miss. On a GPU, device buffers mapped through CUDA IPC replace the segment.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "rig/core/host_memory.h"
#include "rig/dist/communicator.h"
#include "rig/ops/ops.h"

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
  const std::string& name() const { return prefix_; }

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

// Device buffers that every rank on the GPU maps (CUDA IPC), one of kChunk bytes per rank:
// collectives move through them device to device, a chunk at a time, instead of through host
// memory. Ranks that are threads of one process (the tests) use each other's pointers directly.
class IpcArena {
 public:
  static constexpr size_t kChunk = size_t(32) << 20;

  // Collective. nullptr unless every rank allocated its buffer and mapped every other's.
  static std::unique_ptr<IpcArena> make(Communicator& host, Store& store, Device dev,
                                        const std::string& prefix) {
    const int W = host.world(), r = host.rank();
    std::unique_ptr<IpcArena> a(new IpcArena(dev, W));
    char h[64] = {};
    bool ok = ipc_alloc(dev.index, kChunk, &a->mine_, h);
    if (!ok) a->mine_ = nullptr;
    // "pid pointer handle-in-hex", or empty when this rank has no buffer.
    std::string me;
    if (ok) {
      me = fmt::format("{} {} ", ::getpid(), reinterpret_cast<uintptr_t>(a->mine_));
      for (unsigned char c : h) me += fmt::format("{:02x}", c);
    }
    store.set(fmt::format("{}/ipc/{}", prefix, r), me.empty() ? "-" : me);
    for (int q = 0; q < W && ok; ++q) {
      if (q == r) {
        a->peers_[size_t(q)] = a->mine_;
        continue;
      }
      const std::string v = store.get(fmt::format("{}/ipc/{}", prefix, q));
      long pid = 0;
      unsigned long long ptr = 0;
      char hex[129] = {};
      if (v == "-" || std::sscanf(v.c_str(), "%ld %llu %128s", &pid, &ptr, hex) != 3 ||
          std::strlen(hex) != 128) {
        ok = false;
        break;
      }
      if (pid == long(::getpid())) {
        a->peers_[size_t(q)] = reinterpret_cast<void*>(uintptr_t(ptr));
        continue;
      }
      char ph[64];
      for (int i = 0; i < 64; ++i) {
        unsigned b = 0;
        std::sscanf(hex + 2 * i, "%2x", &b);
        ph[i] = char(b);
      }
      a->peers_[size_t(q)] = ipc_open(dev.index, ph);
      a->opened_[size_t(q)] = a->peers_[size_t(q)] != nullptr;
      ok = a->opened_[size_t(q)];
    }
    Tensor all = Tensor::from_f32({ok ? 1.0f : 0.0f}, {1});
    host.all_reduce(all, ReduceOp::Sum);
    if (all.f32()[0] < float(W)) return nullptr;  // the destructor unmaps and frees
    return a;
  }
  ~IpcArena() {
    for (size_t q = 0; q < peers_.size(); ++q)
      if (opened_[q]) ipc_close(dev_.index, peers_[q]);
    if (mine_) ipc_free(dev_.index, mine_);
  }
  char* mine() const { return static_cast<char*>(mine_); }
  char* peer(int q) const { return static_cast<char*>(peers_[size_t(q)]); }

 private:
  IpcArena(Device dev, int world) : dev_(dev), peers_(size_t(world)), opened_(size_t(world)) {}
  Device dev_;
  void* mine_ = nullptr;
  std::vector<void*> peers_;
  std::vector<bool> opened_;
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
    if (store && host_->world() > 1) {
      shm_ = std::make_unique<ShmArena>(*host_, store, dev_);
      const char* env = std::getenv("RIG_STAGED_IPC");
      if (dev_.is_cuda() && !(env && std::string(env) == "0"))
        ipc_ = IpcArena::make(*host_, *store, dev_, shm_->name());
    }
  }
  std::string transport() const override {
    return ipc_ ? "CUDA IPC device buffers" : shm_ ? "shared host memory" : "Gloo sockets";
  }
  size_t device_bytes() const override { return ipc_ ? IpcArena::kChunk : 0; }
  int rank() const override { return host_->rank(); }
  int world() const override { return host_->world(); }
  Backend backend() const override { return host_->backend(); }
  Device device() const override { return dev_; }

  WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) override {
    if (ipc_ && t.numel() > 0 && op != ReduceOp::Max) {
      check(t, "all_reduce", "the tensor");
      const int64_t n = t.numel(), per = int64_t(IpcArena::kChunk / 4);
      for (int64_t a = 0; a < n; a += per) {
        const int64_t len = std::min(per, n - a);
        copy_bytes(ipc_->mine(), dev_, fptr(t) + a, dev_, size_t(len) * 4);
        ipc_round();
        Tensor dst = device_view(fptr(t) + a, len);
        sum_peers(dst, 0, len, op);
        ipc_round();
      }
      return done();
    }
    if (shm_ && t.numel() > 0) {
      check(t, "all_reduce", "the tensor");
      // Each rank reduces its slice into the result area after the inputs, then every rank
      // copies the whole result back from page-locked memory.
      const int64_t n = t.numel(), W = world(), per = (n + W - 1) / W;
      char* a = shm_->get(size_t((W + 1) * n) * 4);
      put(a + size_t(rank() * n) * 4, t);
      host_->barrier();
      const int64_t lo = std::min(n, rank() * per), hi = std::min(n, lo + per);
      float* result = reinterpret_cast<float*>(a) + W * n;
      reduce(a, hi - lo, n, lo, op, result + lo);
      host_->barrier();
      copy_bytes(t.raw(), t.device(), result, Device::cpu(), t.nbytes());
      host_->barrier();
      return done();
    }
    Tensor h = stage_in(t, "all_reduce", "the tensor");
    return std::make_shared<StagedWork>(host_->all_reduce_async(h, op), back(t, h));
  }
  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) override {
    if (ipc_ && out.numel() > 0 && op != ReduceOp::Max) {
      check(in, "reduce_scatter", "the input");
      check(out, "reduce_scatter", "the output");
      if (in.numel() != out.numel() * world())
        bad_input("reduce_scatter: input has {} elements, expected world {} x output {}",
                  in.numel(), world(), out.numel());
      // Each round: every rank's [a, a + len) of each block side by side in its buffer; rank r
      // sums block r's over the buffers.
      const int64_t m = out.numel(), per = int64_t(IpcArena::kChunk / 4) / world();
      for (int64_t a = 0; a < m; a += per) {
        const int64_t len = std::min(per, m - a);
        for (int q = 0; q < world(); ++q)
          copy_bytes(ipc_->mine() + size_t(q * len) * 4, dev_, fptr(in) + q * m + a, dev_,
                     size_t(len) * 4);
        ipc_round();
        Tensor dst = device_view(fptr(out) + a, len);
        sum_peers(dst, rank() * len, len, op);
        ipc_round();
      }
      return done();
    }
    if (shm_ && out.numel() > 0) {
      check(in, "reduce_scatter", "the input");
      check(out, "reduce_scatter", "the output");
      if (in.numel() != out.numel() * world())
        bad_input("reduce_scatter: input has {} elements, expected world {} x output {}",
                  in.numel(), world(), out.numel());
      const int64_t n = in.numel(), m = out.numel();
      char* a = shm_->get(size_t((world() + 1) * n) * 4);
      put(a + size_t(rank() * n) * 4, in);
      host_->barrier();
      float* result = reinterpret_cast<float*>(a) + world() * n + rank() * m;
      reduce(a, m, n, rank() * m, op, result);
      copy_bytes(out.raw(), out.device(), result, Device::cpu(), out.nbytes());
      host_->barrier();
      return done();
    }
    Tensor hi = stage_in(in, "reduce_scatter", "the input");
    Tensor ho = stage_out(out, "reduce_scatter", "the output");
    return std::make_shared<StagedWork>(host_->reduce_scatter_async(hi, ho, op), back(out, ho));
  }
  WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override {
    if (ipc_ && in.numel() > 0) {
      check(in, "all_gather", "the input");
      check(out, "all_gather", "the output");
      if (out.numel() != in.numel() * world())
        bad_input("all_gather: output has {} elements, expected world {} x input {}", out.numel(),
                  world(), in.numel());
      const size_t S = in.nbytes();
      for (size_t off = 0; off < S; off += IpcArena::kChunk) {
        const size_t len = std::min(IpcArena::kChunk, S - off);
        copy_bytes(ipc_->mine(), dev_, static_cast<const char*>(in.raw()) + off, dev_, len);
        ipc_round();
        for (int q = 0; q < world(); ++q)
          copy_bytes(static_cast<char*>(out.raw()) + size_t(q) * S + off, dev_, ipc_->peer(q),
                     dev_, len);
        ipc_round();
      }
      return done();
    }
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
    if (ipc_ && t.numel() > 0 && root >= 0 && root < world()) {
      check(t, "broadcast", "the tensor");
      const size_t S = t.nbytes();
      for (size_t off = 0; off < S; off += IpcArena::kChunk) {
        const size_t len = std::min(IpcArena::kChunk, S - off);
        char* mine = static_cast<char*>(t.raw()) + off;
        if (rank() == root) copy_bytes(ipc_->mine(), dev_, mine, dev_, len);
        ipc_round();
        if (rank() != root) copy_bytes(mine, dev_, ipc_->peer(root), dev_, len);
        ipc_round();
      }
      return done();
    }
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
  // The device work queued so far has finished and every rank has got here: the buffers written
  // before are complete, and those read before may be written again.
  void ipc_round() {
    device_stream_sync(dev_.index);
    host_->barrier();
  }
  static float* fptr(const Tensor& t) { return static_cast<float*>(t.raw()); }
  Tensor device_view(float* p, int64_t n) const {
    return Tensor::view(p, {n}, DType::F32, dev_, nullptr);
  }
  // dst = op over ranks q (in rank order, the same on every rank) of the len floats at `offset`
  // of each rank's buffer.
  void sum_peers(Tensor& dst, int64_t offset, int64_t len, ReduceOp op) {
    copy_bytes(dst.raw(), dev_, ipc_->peer(0) + size_t(offset) * 4, dev_, size_t(len) * 4);
    for (int q = 1; q < world(); ++q) {
      Tensor src = device_view(reinterpret_cast<float*>(ipc_->peer(q)) + offset, len);
      ops::add_(dst, src, 1.0f);
    }
    if (op == ReduceOp::Avg) ops::scale_(dst, 1.0f / float(world()));
  }
  static void put(char* dst, const Tensor& t) {
    copy_bytes(dst, Device::cpu(), t.raw(), t.device(), t.nbytes());
  }
  // acc = op over ranks q of the n floats at [q * stride + offset] of the segment, summed in rank
  // order (the same order on every rank, whichever rank reduces an element).
  void reduce(const char* a, int64_t n, int64_t stride, int64_t offset, ReduceOp op, float* acc) {
    const auto* f = reinterpret_cast<const float*>(a);
    std::memcpy(acc, f + offset, size_t(n) * 4);
    for (int q = 1; q < world(); ++q) {
      const float* src = f + q * stride + offset;
      if (op == ReduceOp::Max)
        for (int64_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], src[i]);
      else
        for (int64_t i = 0; i < n; ++i) acc[i] += src[i];
    }
    if (op == ReduceOp::Avg)
      for (int64_t i = 0; i < n; ++i) acc[i] /= float(world());
  }

  std::unique_ptr<Communicator> host_;
  Device dev_;
  std::shared_ptr<StagingPool> pool_ = std::make_shared<StagingPool>();
  std::unique_ptr<ShmArena> shm_;  // every rank on this host
  std::unique_ptr<IpcArena> ipc_;  // every rank on this GPU (before shm_ in use, after in teardown)
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
