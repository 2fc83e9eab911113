// The Gloo backend: CPU float32 collectives over Gloo's tcp transport, using Gloo's own
// algorithms (ring all-reduce, ring all-gather, halving-doubling reduce-scatter, broadcast,
// barrier). Rendezvous goes through our Store.
#include <arpa/inet.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <cstring>

#include "rig/dist/communicator.h"
#include "rig/dist/work_queue.h"

namespace rig::dist {

namespace {

// gloo's rendezvous::Store on top of ours, under the prefix "gloo/". Gloo's keys are rank
// numbers, so a key that never arrives names the rank that never showed up.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<rig::dist::Store> s, Millis timeout) : s_(std::move(s)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_->set("gloo/" + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = s_->get("gloo/" + key, timeout_);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (auto& k : keys) full.push_back("gloo/" + k);
    try {
      s_->wait(full, timeout);
    } catch (const StoreTimeout& e) {
      std::vector<int> ranks;
      for (auto& m : e.missing) ranks.push_back(std::atoi(m.c_str() + 5));
      throw StoreTimeout(fmt::format("{} did not join the Gloo rendezvous within {} ms",
                                     ranks_str(ranks), timeout.count()),
                         e.missing);
    }
  }

 private:
  std::shared_ptr<rig::dist::Store> s_;
  Millis timeout_;
};

// The local address that routes to `host`: connecting a UDP socket sends nothing but picks the
// interface, which is the one peers on other nodes can reach us on.
std::string route_addr(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res)
    bad_input("cannot resolve the master address '{}'", host);
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  std::string out = "127.0.0.1";
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in me{};
    socklen_t len = sizeof(me);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0) {
      char buf[INET_ADDRSTRLEN];
      if (::inet_ntop(AF_INET, &me.sin_addr, buf, sizeof(buf))) out = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

// Gloo writes to its sockets without MSG_NOSIGNAL: a write to a dead peer would kill this process
// with SIGPIPE before the error can name that peer. Ignore it (as Python, hence torch, does),
// unless the program installed its own handler.
void ignore_sigpipe() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
}

void check_cpu_f32(const Tensor& t, const char* op, const char* which) {
  if (!t.device().is_cpu() || t.dtype() != DType::F32)
    bad_input("Gloo {}: {} must be a CPU F32 tensor, got a {} {} tensor (use NCCL for GPU tensors)", op,
              which, t.device().str(), dtype_name(t.dtype()));
}

class GlooComm : public Communicator {
 public:
  GlooComm(std::shared_ptr<rig::dist::Store> store, int rank, int world, const CommOptions& opts,
           std::string iface)
      : store_(std::move(store)), rank_(rank), world_(world), opts_(opts) {
    if (world < 1 || rank < 0 || rank >= world) fail("Gloo: rank {} outside a world of {}", rank, world);
    ignore_sigpipe();
    gloo::transport::tcp::attr attr;
    attr.hostname = iface.empty() ? route_addr(store_->host()) : iface;
    try {
      dev_ = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
      ctx->setTimeout(opts.timeout);
      GlooStore gs(store_, opts.timeout);
      ctx->connectFullMesh(gs, dev_);
      ctx_ = ctx;
    } catch (const PeerGone& e) {
      fail("rank {}: Gloo rendezvous failed: {}", rank, e.what());
    } catch (const StoreTimeout& e) {
      fail("rank {}: Gloo rendezvous failed: {}", rank, e.what());
    } catch (const gloo::Exception& e) {
      fail("rank {}: Gloo rendezvous failed on {}: {}", rank, attr.hostname, e.what());
    }
  }
  ~GlooComm() override {
    queue_.reset();  // finish queued work before tearing down the context
    // A rank that closes its sockets while a peer still reads its last messages can reset the
    // connection under that peer (unread data turns close into RST): meet first.
    if (broken_.empty() && world_ > 1 && std::uncaught_exceptions() == 0) {
      try {
        store_->barrier(world_, "gloo-close");
      } catch (const std::exception&) {
      }
    }
  }

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Backend backend() const override { return Backend::Gloo; }
  Device device() const override { return Device::cpu(); }

  WorkPtr all_reduce_async(const Tensor& t, ReduceOp op) override {
    check_cpu_f32(t, "all_reduce", "the tensor");
    return submit("all_reduce", t.numel(), [this, t, op](uint32_t tag) {
      if (world_ == 1 || t.numel() == 0) return;
      gloo::AllreduceOptions o(ctx_);
      o.setOutput(t.f32(), size_t(t.numel()));
      o.setReduceFunction(op == ReduceOp::Max
                              ? gloo::AllreduceOptions::Func(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<float>))
                              : gloo::AllreduceOptions::Func(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>)));
      o.setTag(tag);
      o.setTimeout(opts_.timeout);
      gloo::allreduce(o);
      if (op == ReduceOp::Avg) scale(t.f32(), t.numel(), 1.0f / float(world_));
    });
  }

  WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out, ReduceOp op) override {
    check_cpu_f32(in, "reduce_scatter", "the input");
    check_cpu_f32(out, "reduce_scatter", "the output");
    if (in.numel() != out.numel() * world_)
      bad_input("reduce_scatter: input has {} elements, expected world {} x output {}", in.numel(), world_,
                out.numel());
    return submit("reduce_scatter", in.numel(), [this, in, out, op](uint32_t) {
      int64_t n = out.numel();
      if (world_ == 1 || n == 0) {
        std::memcpy(out.f32(), in.f32(), size_t(n) * 4);
        return;
      }
      // Halving-doubling works in place on its buffer and leaves this rank's block at the front.
      std::vector<float> buf(in.f32(), in.f32() + in.numel());
      std::vector<int> counts(static_cast<size_t>(world_), static_cast<int>(n));
      auto* fn = op == ReduceOp::Max ? gloo::ReductionFunction<float>::max : gloo::ReductionFunction<float>::sum;
      gloo::ReduceScatterHalvingDoubling<float> alg(ctx_, {buf.data()}, int(in.numel()), counts, fn);
      alg.run();
      std::memcpy(out.f32(), buf.data(), size_t(n) * 4);
      if (op == ReduceOp::Avg) scale(out.f32(), n, 1.0f / float(world_));
    });
  }

  WorkPtr all_gather_async(const Tensor& in, const Tensor& out) override {
    check_cpu_f32(in, "all_gather", "the input");
    check_cpu_f32(out, "all_gather", "the output");
    if (out.numel() != in.numel() * world_)
      bad_input("all_gather: output has {} elements, expected world {} x input {}", out.numel(), world_,
                in.numel());
    return submit("all_gather", out.numel(), [this, in, out](uint32_t tag) {
      if (world_ == 1 || in.numel() == 0) {
        std::memmove(out.f32(), in.f32(), in.nbytes());
        return;
      }
      gloo::AllgatherOptions o(ctx_);
      o.setInput(in.f32(), size_t(in.numel()));
      o.setOutput(out.f32(), size_t(out.numel()));
      o.setTag(tag);
      o.setTimeout(opts_.timeout);
      gloo::allgather(o);
    });
  }

  WorkPtr broadcast_async(const Tensor& t, int root) override {
    check_cpu_f32(t, "broadcast", "the tensor");
    if (root < 0 || root >= world_) bad_input("broadcast: root {} outside a world of {}", root, world_);
    return submit("broadcast", t.numel(), [this, t, root](uint32_t tag) {
      if (world_ == 1 || t.numel() == 0) return;
      gloo::BroadcastOptions o(ctx_);
      o.setOutput(t.f32(), size_t(t.numel()));
      o.setRoot(root);
      o.setTag(tag);
      o.setTimeout(opts_.timeout);
      gloo::broadcast(o);
    });
  }

  WorkPtr barrier_async() override {
    return submit("barrier", 0, [this](uint32_t tag) {
      if (world_ == 1) return;
      gloo::BarrierOptions o(ctx_);
      o.setTag(tag);
      o.setTimeout(opts_.timeout);
      gloo::barrier(o);
    });
  }

 private:
  static void scale(float* p, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) p[i] *= s;
  }

  // Queues one collective. Its failure is turned into an error that names the dead or hung
  // rank, and breaks the communicator for every later call.
  WorkPtr submit(const char* name, int64_t numel, std::function<void(uint32_t)> body) {
    uint64_t seq = seq_++;
    return queue_->submit([this, name, numel, seq, body = std::move(body)] {
      if (!broken_.empty()) fail("{}", broken_);
      try {
        body(uint32_t(seq & 0xffffff));
      } catch (const InputError&) {
        throw;
      } catch (const std::exception& e) {
        broken_ = explain(name, seq, numel, e.what());
        fail("{}", broken_);
      }
    });
  }

  std::string explain(const char* name, uint64_t seq, int64_t numel, const std::string& detail) {
    std::string head = fmt::format("rank {}: Gloo {} #{} ({} floats) failed", rank_, name, seq, numel);
    std::string cause;
    try {
      cause = blame_failure(*store_, rank_, world_, opts_.timeout, fmt::format("{} #{}", name, seq));
    } catch (const PeerGone& e) {
      cause = e.what();
    } catch (const std::exception& e) {
      cause = fmt::format("the store could not say which rank is to blame: {}", e.what());
    }
    return fmt::format("{}: {} [gloo: {}]", head, cause, detail);
  }

  std::shared_ptr<rig::dist::Store> store_;
  int rank_, world_;
  CommOptions opts_;
  std::shared_ptr<gloo::transport::Device> dev_;
  std::shared_ptr<gloo::Context> ctx_;
  uint64_t seq_ = 0;
  std::string broken_;  // touched only on the worker thread
  std::unique_ptr<WorkQueue> queue_ = std::make_unique<WorkQueue>();
};

}  // namespace

std::unique_ptr<Communicator> make_gloo(std::shared_ptr<Store> store, int rank, int world,
                                        const CommOptions& opts, std::string iface_addr) {
  return std::make_unique<GlooComm>(std::move(store), rank, world, opts, std::move(iface_addr));
}

}  // namespace rig::dist
