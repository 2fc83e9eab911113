// What data-parallel and sharded training need from the communicator, built on it:
// bucketed async all-reduce of many tensors, and reduce-scatter / all-gather of one flat
// buffer split evenly across ranks.
#pragma once
#include <cstddef>
#include <vector>

#include "rig/dist/communicator.h"

namespace rig::dist {

// All-reduces a fixed list of tensors (gradients) through flat buckets of about `bucket_bytes`,
// so many small tensors cost a few large collectives. Buckets follow the list order: pass the
// tensors in the order their values become final (for gradients, reverse layer order), and
// call mark_ready(i) as each one does; a bucket's all-reduce starts, async, as soon as all its
// tensors are ready, overlapping with the work that produces the rest. finish() waits and
// writes the results back. The tensors must all live on comm.device() with one dtype.
class BucketedAllReduce {
 public:
  BucketedAllReduce(Communicator& comm, std::vector<Tensor> tensors, size_t bucket_bytes = 25u << 20,
                    ReduceOp op = ReduceOp::Avg);
  size_t num_buckets() const { return buckets_.size(); }
  // The tensor indices in bucket b.
  const std::vector<size_t>& bucket(size_t b) const { return buckets_[b].members; }

  void mark_ready(size_t i);
  // Starts the buckets not started yet, waits for all, copies back, and resets for the next step.
  void finish();
  // mark_ready on everything, then finish().
  void all_reduce();

 private:
  struct Bucket {
    std::vector<size_t> members;
    std::vector<int64_t> offsets;
    Tensor flat;
    size_t pending = 0;
    WorkPtr work;
  };
  void launch(Bucket& b);
  Communicator& comm_;
  std::vector<Tensor> tensors_;
  std::vector<size_t> bucket_of_;
  std::vector<bool> ready_;
  std::vector<Bucket> buckets_;
  ReduceOp op_;
};

// One flat buffer of `numel` elements split evenly over `world` ranks: padded to a multiple of
// world, rank r owns [r * shard, (r + 1) * shard). The padding is zeros and stays zeros.
struct FlatShard {
  int64_t numel = 0;
  int64_t padded = 0;
  int64_t shard = 0;
  int world = 1;
  static FlatShard of(int64_t numel, int world);
  int64_t begin(int rank) const { return rank * shard; }
  // The part of [0, numel) rank r owns (the rest of its shard is padding).
  int64_t valid(int rank) const;
};

// `full` holds numel or padded elements (1-D); `shard` holds fs.shard. Rank r's shard gets op
// over every rank's [begin(r), begin(r) + shard) of `full`. An unpadded `full` goes through a
// padded copy.
WorkPtr reduce_scatter_flat(Communicator& comm, const FlatShard& fs, const Tensor& full, const Tensor& shard,
                            ReduceOp op = ReduceOp::Avg);
// The inverse: every rank's `full` gets all shards (padding dropped if `full` is unpadded).
WorkPtr all_gather_flat(Communicator& comm, const FlatShard& fs, const Tensor& shard, const Tensor& full);

}  // namespace rig::dist
