// One interface for collectives, whatever the backend: Gloo for CPU tensors (float32), NCCL for
// CUDA tensors. A run is always N ranks, N = 1 included. Collectives must be issued in the same
// order on every rank. Every call has an async form returning a Work; the plain form waits.
// Errors (a dead or hung peer, a timeout) throw rig::Error naming the rank(s) responsible; after
// one, the communicator is broken and every later call throws at once.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "rig/core/tensor.h"
#include "rig/dist/env.h"
#include "rig/dist/store.h"

namespace rig::dist {

enum class ReduceOp { Sum, Avg, Max };
enum class Backend { Gloo, Nccl };
const char* reduce_op_name(ReduceOp op);
const char* backend_name(Backend b);
Backend parse_backend(std::string_view s);  // "gloo" | "nccl"; InputError otherwise

// Completion of one async collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done; rethrows the collective's error. Safe to call more than once.
  virtual void wait() = 0;
  // True once finished (successfully or not); never blocks.
  virtual bool done() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

struct CommOptions {
  // End-to-end limit for one collective and for rendezvous; a peer that does not show up within
  // it is reported by rank.
  Millis timeout{std::chrono::seconds(60)};
  // NCCL only: the CUDA stream (a cudaStream_t) whose work the collectives follow; nullptr is
  // the legacy default stream. Collectives run on the communicator's own stream, after the
  // work already queued on this one.
  void* cuda_stream = nullptr;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual Backend backend() const = 0;
  // Where tensors handed to this communicator must live.
  virtual Device device() const = 0;
  // How the data of staged collectives moves between ranks sharing a GPU ("CUDA IPC device
  // buffers", "shared host memory", "Gloo sockets"); empty for the others.
  virtual std::string transport() const { return {}; }
  // Device memory this communicator holds outside the caching allocator (the CUDA IPC staging
  // buffer), which a run's max_memory must leave room for.
  virtual size_t device_bytes() const { return 0; }

  // In place: every rank ends with op over all ranks' `t`.
  virtual WorkPtr all_reduce_async(const Tensor& t, ReduceOp op = ReduceOp::Sum) = 0;
  // `in` has world * out.numel() elements; rank r gets op over block r of every rank's `in`.
  virtual WorkPtr reduce_scatter_async(const Tensor& in, const Tensor& out,
                                       ReduceOp op = ReduceOp::Sum) = 0;
  // `out` has world * in.numel() elements; block r of `out` is rank r's `in`.
  virtual WorkPtr all_gather_async(const Tensor& in, const Tensor& out) = 0;
  // In place: every rank ends with `root`'s `t`.
  virtual WorkPtr broadcast_async(const Tensor& t, int root = 0) = 0;
  virtual WorkPtr barrier_async() = 0;

  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) { all_reduce_async(t, op)->wait(); }
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op = ReduceOp::Sum) {
    reduce_scatter_async(in, out, op)->wait();
  }
  void all_gather(const Tensor& in, const Tensor& out) { all_gather_async(in, out)->wait(); }
  void broadcast(const Tensor& t, int root = 0) { broadcast_async(t, root)->wait(); }
  void barrier() { barrier_async()->wait(); }
};

// Builds the Gloo backend (tcp transport) on `store`; every rank of the world must call this.
// `iface_addr` is the address peers reach this host on ("" picks the one that routes to the
// store's host).
std::unique_ptr<Communicator> make_gloo(std::shared_ptr<Store> store, int rank, int world,
                                        const CommOptions& opts = {}, std::string iface_addr = "");
// Builds the NCCL backend on CUDA device `device`; the unique id travels through `store`.
// Throws in builds without NCCL.
std::unique_ptr<Communicator> make_nccl(std::shared_ptr<Store> store, int rank, int world, int device,
                                        const CommOptions& opts = {});
bool nccl_built();
// Takes F32 tensors on `dev` (a GPU that several ranks share) and runs each collective on `host`
// (Gloo) through page-locked host copies; the results reach `dev` when the Work is waited for.
// With `node_store` (every rank of the world on this host, the store they share) the data moves
// through one shared-memory segment instead, each collective complete when issued, with Gloo
// for the barriers (RIG_STAGED_SHM=0 turns that off); on a GPU, through device buffers the
// ranks map with CUDA IPC when every rank can (RIG_STAGED_IPC=0 turns that off). `dev` on the CPU without a store returns
// `host` itself.
std::unique_ptr<Communicator> make_staged(std::unique_ptr<Communicator> host, Device dev,
                                          std::shared_ptr<Store> node_store = nullptr);

// Where one rank computes and how its collectives travel. GPU ranks take cuda:(local_rank mod
// GPUs); when a node has more ranks than GPUs they share them, and since NCCL refuses two ranks
// on one device, the collectives go through Gloo staged in host memory.
struct Placement {
  Device device;
  Backend backend = Backend::Gloo;
  int ranks_per_gpu = 1;  // the most ranks any GPU of this node hosts
  bool staged() const { return device.is_cuda() && backend == Backend::Gloo; }
  std::string describe(int local_world) const;  // one line for the log
};
// `gpus`: the GPUs this process sees (0: CPU ranks). `backend`: "" picks as above; "gloo" on GPUs
// stages even with a GPU per rank; "nccl" with shared GPUs is an InputError.
Placement place_rank(const DistEnv& env, int gpus, std::string_view backend = "");

// Everything one rank of a run holds: its place, the store (rank 0 also hosts the server) and
// the communicator. Destroy it after the last collective.
struct Group {
  DistEnv env;
  std::shared_ptr<StoreServer> server;  // rank 0 only
  std::shared_ptr<Store> store;
  std::unique_ptr<Communicator> comm;
  ~Group();
};

// The one-call set-up: rank 0 hosts the store at env.master_port, everyone connects, waits for
// the whole world (a missing rank is named), then builds the backend. Also sets
// rig::set_current_rank(env.rank) so error messages carry it.
std::unique_ptr<Group> init_group(const DistEnv& env, Backend backend, const CommOptions& opts = {});
// The same for a placement: NCCL on its GPU, or Gloo (staged when the device is a GPU).
std::unique_ptr<Group> init_group(const DistEnv& env, const Placement& where,
                                  const CommOptions& opts = {});
// Backend by the device: NCCL when a GPU and NCCL are available, Gloo otherwise.
Backend default_backend();

// Backends call this when a collective fails: names the rank to blame. A dead one is found
// through the store (it saw the closed connection); otherwise every failing rank posts what it
// was stuck in (`what`, e.g. "all_reduce #12"), and ranks that post nothing are alive but not
// taking part. Marks this rank failed in the store. Throws PeerGone if the store is gone.
std::string blame_failure(Store& store, int rank, int world, Millis timeout, const std::string& what);

// Bus bandwidth factor as nccl-tests defines it (all-reduce 2(n-1)/n, reduce-scatter and
// all-gather (n-1)/n, broadcast 1).
double busbw_factor(std::string_view op, int world);

}  // namespace rig::dist
