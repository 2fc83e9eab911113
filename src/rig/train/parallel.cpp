#include "rig/train/parallel.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "rig/ops/ops.h"

// DataParallel: gradients summed in buckets during the backward pass, and PowerSGD compression.

namespace rig {

// ---- data parallel --------------------------------------------------------------------------

// One weight matrix's gradient under PowerSGD: the warm-started Q and the error feedback.
struct DataParallel::Compressed {
  Tensor grad, q, error;  // grad [n, m], q [m, r], error [n, m]
  Tensor q0;              // the seeded start of q
};

DataParallel::DataParallel(dist::Communicator& comm, LlamaModel& model, size_t bucket_bytes,
                           int powersgd_rank, uint64_t seed)
    : comm_(comm), rank_(powersgd_rank) {
  model.zero_grad();
  const std::vector<int> groups = model.param_groups();
  int layers = 0;
  for (int g : groups) layers = std::max(layers, g + 1);
  // Bucket order = the order gradients become final: last layer first, the outer ones last.
  std::vector<int> order;
  for (int l = layers - 1; l >= 0; --l) order.push_back(l);
  order.push_back(-1);
  std::vector<Tensor> tensors;
  auto& ps = model.params();
  std::mt19937_64 rng(seed ^ 0x9051ull);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int g : order)
    for (size_t i = 0; i < ps.size(); ++i) {
      if (groups[i] != g || !ps[i].trainable || !ps[i].grad.defined()) continue;
      const Tensor& gr = ps[i].grad;
      // Worth compressing: (n + m) r numbers instead of n m.
      if (rank_ > 0 && gr.ndim() == 2 && (gr.dim(0) + gr.dim(1)) * rank_ < gr.dim(0) * gr.dim(1)) {
        Compressed c;
        c.grad = gr;
        // The same start on every rank (same seed, same order).
        Tensor q = Tensor::empty({gr.dim(1), rank_}, DType::F32, Device::cpu(), "powersgd q");
        for (int64_t k = 0; k < q.numel(); ++k) q.f32()[k] = normal(rng);
        c.q = q.to(gr.device(), "powersgd q");
        c.q0 = q.to(gr.device(), "powersgd q start");
        c.error = Tensor::zeros(gr.shape(), DType::F32, gr.device(), "powersgd error");
        compressed_.push_back(std::move(c));
        continue;
      }
      of_group_[g].push_back(tensors.size());
      tensors.push_back(gr);
    }
  if (!tensors.empty())
    buckets_ = std::make_unique<dist::BucketedAllReduce>(comm, std::move(tensors), bucket_bytes,
                                                         dist::ReduceOp::Sum);
}

DataParallel::~DataParallel() = default;

void DataParallel::reset_compression() {
  for (auto& c : compressed_) {
    c.error.zero_();
    c.q.copy_from(c.q0);
  }
}

void DataParallel::after(int group, Phase phase) {
  if (!sync_ || phase != Backward || !buckets_) return;
  auto it = of_group_.find(group);
  if (it == of_group_.end()) return;
  for (size_t i : it->second) buckets_->mark_ready(i);
}

void DataParallel::finish() {
  if (buckets_) buckets_->finish();
  if (!compressed_.empty()) powersgd();
}

namespace {

// Gram-Schmidt on the columns of p [n, r] (on the host; r is small).
void orthonormalize_columns(Tensor& p) {
  Tensor h = p.device().is_cpu() ? p : p.to(Device::cpu(), "powersgd p");
  const int64_t n = h.dim(0), r = h.dim(1);
  float* x = h.f32();
  for (int64_t j = 0; j < r; ++j) {
    for (int64_t k = 0; k < j; ++k) {
      double dot = 0;
      for (int64_t i = 0; i < n; ++i) dot += double(x[i * r + j]) * x[i * r + k];
      for (int64_t i = 0; i < n; ++i) x[i * r + j] -= float(dot) * x[i * r + k];
    }
    double norm = 0;
    for (int64_t i = 0; i < n; ++i) norm += double(x[i * r + j]) * x[i * r + j];
    const float inv = float(1.0 / (std::sqrt(norm) + 1e-8));
    for (int64_t i = 0; i < n; ++i) x[i * r + j] *= inv;
  }
  if (!p.device().is_cpu()) p.copy_from(h);
}

}  // namespace

// PowerSGD (one power iteration, warm-started): M = grad + error; P = sum over ranks of M Q;
// orthonormalise P; Q = sum over ranks of M^T P; grad = P Q^T; error = M - P (M^T P)^T with this
// rank's own M. Two all-reduces of (n + m) r numbers per matrix, batched over all matrices.
void DataParallel::powersgd() {
  int64_t np = 0, nq = 0;
  for (auto& c : compressed_) {
    np += c.grad.dim(0) * rank_;
    nq += c.grad.dim(1) * rank_;
  }
  const Device dev = compressed_[0].grad.device();
  Tensor pall = Tensor::empty({np}, DType::F32, dev, "powersgd p"),
         qall = Tensor::empty({nq}, DType::F32, dev, "powersgd q");
  std::vector<Tensor> ps, qs;
  int64_t op = 0, oq = 0;
  for (auto& c : compressed_) {
    const int64_t n = c.grad.dim(0), m = c.grad.dim(1);
    ops::add_(c.grad, c.error);  // M
    Tensor p = pall.slice_rows(op, op + n * rank_).reshape({n, rank_});
    ops::gemm(c.grad, false, c.q, false, p, 1.0f, 0.0f);
    ps.push_back(p);
    qs.push_back(qall.slice_rows(oq, oq + m * rank_).reshape({m, rank_}));
    op += n * rank_;
    oq += m * rank_;
  }
  comm_.all_reduce(pall, dist::ReduceOp::Sum);
  for (size_t i = 0; i < compressed_.size(); ++i) {
    Compressed& c = compressed_[i];
    orthonormalize_columns(ps[i]);
    ops::gemm(c.grad, true, ps[i], false, qs[i], 1.0f, 0.0f);  // this rank's Q
    c.error.copy_from(c.grad);
    ops::gemm(ps[i], false, qs[i], true, c.error, -1.0f, 1.0f);
  }
  comm_.all_reduce(qall, dist::ReduceOp::Sum);
  for (size_t i = 0; i < compressed_.size(); ++i) {
    Compressed& c = compressed_[i];
    ops::gemm(ps[i], false, qs[i], true, c.grad, 1.0f, 0.0f);
    c.q.copy_from(qs[i]);  // the warm start of the next step
  }
}

}  // namespace rig
