#include "rig/dist/bucket.h"

#include <algorithm>
#include <functional>

namespace rig::dist {

namespace {

Tensor flat_view(const Tensor& t) { return t.reshape({t.numel()}); }

// Runs `after` once `inner` completes successfully (on the waiting thread).
class ThenWork : public Work {
 public:
  ThenWork(WorkPtr inner, std::function<void()> after) : inner_(std::move(inner)), after_(std::move(after)) {}
  void wait() override {
    inner_->wait();
    if (after_) {
      auto f = std::move(after_);
      after_ = nullptr;
      f();
    }
  }
  bool done() override { return inner_->done(); }

 private:
  WorkPtr inner_;
  std::function<void()> after_;
};

}  // namespace

BucketedAllReduce::BucketedAllReduce(Communicator& comm, std::vector<Tensor> tensors, size_t bucket_bytes,
                                     ReduceOp op)
    : comm_(comm), tensors_(std::move(tensors)), op_(op) {
  if (bucket_bytes == 0) bad_input("bucketed all-reduce: bucket size must be positive");
  bucket_of_.resize(tensors_.size());
  ready_.assign(tensors_.size(), false);
  size_t bytes = 0;
  for (size_t i = 0; i < tensors_.size(); i++) {
    const Tensor& t = tensors_[i];
    if (!(t.device() == comm.device()))
      bad_input("bucketed all-reduce: tensor {} is on {}, the {} communicator needs {}", i, t.device().str(),
                backend_name(comm.backend()), comm.device().str());
    if (t.dtype() != tensors_[0].dtype())
      bad_input("bucketed all-reduce: tensor {} is {}, tensor 0 is {}", i, dtype_name(t.dtype()),
                dtype_name(tensors_[0].dtype()));
    if (buckets_.empty() || (bytes > 0 && bytes + t.nbytes() > bucket_bytes)) {
      buckets_.emplace_back();
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    b.offsets.push_back(b.members.empty() ? 0 : b.offsets.back() + tensors_[b.members.back()].numel());
    b.members.push_back(i);
    bucket_of_[i] = buckets_.size() - 1;
    bytes += t.nbytes();
  }
  for (auto& b : buckets_) {
    int64_t n = b.offsets.back() + tensors_[b.members.back()].numel();
    b.flat = Tensor::empty({n}, tensors_[0].dtype(), comm.device(), "gradient bucket");
    b.pending = b.members.size();
  }
}

void BucketedAllReduce::launch(Bucket& b) {
  for (size_t k = 0; k < b.members.size(); k++) {
    const Tensor& t = tensors_[b.members[k]];
    b.flat.slice_rows(b.offsets[k], b.offsets[k] + t.numel()).copy_from(flat_view(t));
  }
  b.work = comm_.all_reduce_async(b.flat, op_);
}

void BucketedAllReduce::mark_ready(size_t i) {
  if (i >= tensors_.size()) bad_input("bucketed all-reduce: no tensor {} (have {})", i, tensors_.size());
  if (ready_[i]) fail("bucketed all-reduce: tensor {} marked ready twice in one step", i);
  ready_[i] = true;
  Bucket& b = buckets_[bucket_of_[i]];
  if (--b.pending == 0) launch(b);
}

void BucketedAllReduce::finish() {
  // Launch in bucket order: every rank must issue the same collectives in the same order.
  for (auto& b : buckets_)
    if (!b.work) {
      for (size_t i : b.members) ready_[i] = true;
      b.pending = 0;
      launch(b);
    }
  for (auto& b : buckets_) {
    b.work->wait();
    for (size_t k = 0; k < b.members.size(); k++) {
      const Tensor& t = tensors_[b.members[k]];
      flat_view(t).copy_from(b.flat.slice_rows(b.offsets[k], b.offsets[k] + t.numel()));
    }
    b.work.reset();
    b.pending = b.members.size();
  }
  ready_.assign(tensors_.size(), false);
}

void BucketedAllReduce::all_reduce() {
  for (size_t i = 0; i < tensors_.size(); i++)
    if (!ready_[i]) mark_ready(i);
  finish();
}

FlatShard FlatShard::of(int64_t numel, int world) {
  if (world < 1 || numel < 0) bad_input("flat shard: {} elements over {} ranks", numel, world);
  FlatShard f;
  f.numel = numel;
  f.world = world;
  f.shard = (numel + world - 1) / world;
  f.padded = f.shard * world;
  return f;
}

int64_t FlatShard::valid(int rank) const {
  return std::clamp<int64_t>(numel - begin(rank), 0, shard);
}

WorkPtr reduce_scatter_flat(Communicator& comm, const FlatShard& fs, const Tensor& full, const Tensor& shard,
                            ReduceOp op) {
  if (fs.world != comm.world()) fail("flat shard made for {} ranks used on {}", fs.world, comm.world());
  if (shard.numel() != fs.shard) bad_input("reduce_scatter_flat: shard has {} elements, expected {}", shard.numel(), fs.shard);
  Tensor f = flat_view(full);
  if (f.numel() == fs.padded) return comm.reduce_scatter_async(f, flat_view(shard), op);
  if (f.numel() != fs.numel)
    bad_input("reduce_scatter_flat: buffer has {} elements, expected {} or {} (padded)", f.numel(), fs.numel,
              fs.padded);
  Tensor padded = Tensor::zeros({fs.padded}, f.dtype(), f.device(), "padded flat buffer");
  padded.slice_rows(0, fs.numel).copy_from(f);
  return comm.reduce_scatter_async(padded, flat_view(shard), op);
}

WorkPtr all_gather_flat(Communicator& comm, const FlatShard& fs, const Tensor& shard, const Tensor& full) {
  if (fs.world != comm.world()) fail("flat shard made for {} ranks used on {}", fs.world, comm.world());
  if (shard.numel() != fs.shard) bad_input("all_gather_flat: shard has {} elements, expected {}", shard.numel(), fs.shard);
  Tensor f = flat_view(full);
  if (f.numel() == fs.padded) return comm.all_gather_async(flat_view(shard), f);
  if (f.numel() != fs.numel)
    bad_input("all_gather_flat: buffer has {} elements, expected {} or {} (padded)", f.numel(), fs.numel,
              fs.padded);
  Tensor padded = Tensor::empty({fs.padded}, f.dtype(), f.device(), "padded flat buffer");
  auto w = comm.all_gather_async(flat_view(shard), padded);
  return std::make_shared<ThenWork>(w, [padded, f, n = fs.numel]() mutable { f.copy_from(padded.slice_rows(0, n)); });
}

}  // namespace rig::dist
