// cuDNN's fused attention on packed rows: every run of one segment id is a ragged batch entry.
//
// The graphs are the dense ones (sdpa_cudnn_cuda.cpp) plus what cuDNN's ragged (THD) pattern asks
// for: per-entry lengths that override each matmul's padded extent, a padding mask before the
// causal one, and element offsets on every tensor. The batch is n entries of S rows, n and S the
// run count and the longest run rounded up to powers of two, so that one plan serves many batches.
//
// Layouts: Q/O/dQ (and the fp32 dQ accumulator and, with grouped heads, the full-head dK/dV
// partials) are [tokens, Hq, D] with offsets token·Hq·D; K/V/dK/dV are [tokens, Hk, D] with
// offsets token·Hk·D (cuDNN scales those by Hq/Hk for the full-head partials). Stats are
// per-token rows [tokens, Hq]; rig's lse [B,Hq,T] is converted to and from that layout around the
// calls. The backward's softmax_sum is padded [n, Hq, S].
#include "rig/ops/cuda/sdpa_cudnn.h"

#ifdef RIG_WITH_CUDNN
#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <limits>

#include "rig/core/cuda_check.h"
#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/launch.h"
#include "rig/ops/cuda/sdpa_cudnn_graph.h"
#include "rig/ops/segment_runs.h"
#endif

namespace rig::ops::cuda::sdpa_cudnn {

#ifndef RIG_WITH_CUDNN

bool ragged_supported(int, std::string* why) {
  *why = "rig was built without cuDNN";
  return false;
}
bool forward_packed(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                    std::string* why) {
  *why = "rig was built without cuDNN";
  return false;
}
bool backward_packed(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                     const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, bool,
                     std::string* why) {
  *why = "rig was built without cuDNN";
  return false;
}

#else

using namespace detail;
using ops::segment_runs;
using ops::SegmentRuns;

namespace {

// The runs of one seg tensor, and their offsets on the GPU per head shape.
struct Runs {
  std::weak_ptr<void> storage;
  const void* data = nullptr;
  int64_t rows = 0, numel = 0;
  SegmentRuns runs;  // runs.repeat non-empty: the rows cannot be ragged batches
  int64_t longest = 0;
  // (Hq, Hk, D) -> I32 [q offsets (n+1) | kv offsets (n+1) | stats offsets (n+1) | lengths (n)]
  std::map<std::array<int64_t, 3>, Tensor> offsets;
};

bool same_storage(const std::weak_ptr<void>& a, const std::shared_ptr<void>& b) {
  return !a.expired() && !a.owner_before(b) && !b.owner_before(a);
}

// The run table of seg, read to the host on first sight of its storage and kept for the few
// most recent ones (a step's layers all share one seg tensor).
Runs& runs_of(const Tensor& seg) {
  static thread_local std::deque<Runs> cache;
  for (Runs& r : cache)
    if (same_storage(r.storage, seg.storage()) && r.data == seg.raw() && r.rows == seg.dim(0) &&
        r.numel == seg.numel())
      return r;
  if (cache.size() >= 4) cache.pop_back();
  Runs& r = cache.emplace_front();
  r.storage = seg.storage();
  r.data = seg.raw();
  r.rows = seg.dim(0);
  r.numel = seg.numel();
  const Tensor host = seg.to(Device::cpu(), "segment ids");
  r.runs = segment_runs(host.data<int64_t>(), seg.dim(0), seg.dim(1));
  for (int64_t l : r.runs.len) r.longest = std::max(r.longest, l);
  return r;
}

// Batch entries for n runs: the next power of two from 8. The entries past the runs are empty
// (length 0, offsets at the end), so one plan serves every batch with up to that many runs;
// building a plan costs 0.1-0.3 s, and each packed batch has its own run count.
int64_t entries_for(int64_t n) {
  int64_t e = 8;
  while (e < n) e *= 2;
  return e;
}

const Tensor& offsets_for(Runs& r, int64_t Hq, int64_t Hk, int64_t D, int dev) {
  Tensor& t = r.offsets[{Hq, Hk, D}];
  if (t.defined()) return t;
  const std::vector<int64_t>&start = r.runs.start, &len = r.runs.len;
  const int64_t runs = int64_t(start.size()), n = entries_for(runs);
  Tensor h = Tensor::empty({4 * n + 3}, DType::I32, Device::cpu(), "ragged offsets");
  int32_t* p = h.data<int32_t>();
  const int64_t tokens = runs ? start.back() + len.back() : 0;
  for (int64_t i = 0; i <= n; ++i) {
    const int64_t tok = i < runs ? start[size_t(i)] : tokens;
    p[i] = int32_t(tok * Hq * D);
    p[n + 1 + i] = int32_t(tok * Hk * D);
    p[2 * (n + 1) + i] = int32_t(tok * Hq);
  }
  for (int64_t i = 0; i < n; ++i) p[3 * (n + 1) + i] = i < runs ? int32_t(len[size_t(i)]) : 0;
  t = h.to(Device::cuda(dev), "ragged offsets");
  return t;
}

// The tensors both graphs start from: offsets, lengths, Q, Kᵀ, O, Stats and the scale.
struct Common {
  Desc qoff, kvoff, toff, len_q, len_kv, Q, Kt, O, stats, scale;
};
Common common(Graph& g, const Shape& x) {
  const auto bf = CUDNN_DATA_BFLOAT16, i32 = CUDNN_DATA_INT32;
  Common c;
  const Dims off_d{x.B + 1, 1, 1, 1}, len_d{x.B, 1, 1, 1}, unit{1, 1, 1, 1};
  c.qoff = g.tensor(kQOffsets, i32, off_d, unit, false);
  c.kvoff = g.tensor(kKVOffsets, i32, off_d, unit, false);
  c.toff = g.tensor(kStatsOffsets, i32, off_d, unit, false);
  c.len_q = g.tensor(kSeqLen, i32, len_d, unit, false);
  c.len_kv = g.tensor(kSeqLenKV, i32, len_d, unit, false);
  c.Q = g.tensor(kQ, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false, false, c.qoff);
  c.Kt = g.tensor(kK, bf, bhdt(x, x.Hk), bhdt_strides(x, x.Hk), false, false, c.kvoff);
  c.O = g.tensor(kO, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false, false, c.qoff);
  c.stats = g.tensor(kStats, CUDNN_DATA_FLOAT, {x.B, x.Hq, x.T, 1}, {x.T * x.Hq, 1, x.Hq, 1}, false,
                     false, c.toff);
  c.scale = g.scalar(kScale);
  return c;
}

// scale·Q·Kᵀ, each entry's padded tail and the causal upper triangle masked.
Desc masked_scores(Graph& g, const Common& c, const Shape& x) {
  const auto f32 = CUDNN_DATA_FLOAT;
  const Dims sd{x.B, x.Hq, x.T, x.T}, ss{x.Hq * x.T * x.T, x.T * x.T, x.T, 1};
  Desc S = g.virt(f32, sd, ss), S2 = g.virt(f32, sd, ss);
  g.matmul(c.Q, c.Kt, S, c.len_q, c.len_kv);
  g.pointwise(CUDNN_POINTWISE_MUL, f32, S, c.scale, nullptr, S2);
  Desc S3 = g.padding(S2, c.len_q, c.len_kv, g.scalar(kLowest), sd, ss);
  return g.causal(S3, g.scalar(kNegInf), sd, ss);
}

std::unique_ptr<Graph> forward_graph(cudnnHandle_t h, const Shape& x) {
  auto g = std::make_unique<Graph>();
  const Common c = common(*g, x);
  Desc V = g->tensor(kV, CUDNN_DATA_BFLOAT16, bhtd(x, x.Hk), bhtd_strides(x, x.Hk), false, false,
                     c.kvoff);
  g->softmax_times_v(masked_scores(*g, c, x), V, c.O, c.stats, x, c.len_q, c.len_kv);
  g->plan(h);
  return g;
}

std::unique_ptr<Graph> backward_graph(cudnnHandle_t h, const Shape& x) {
  auto g = std::make_unique<Graph>();
  const auto bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  const Dims sd{x.B, x.Hq, x.T, x.T}, ss{x.Hq * x.T * x.T, x.T * x.T, x.T, 1};
  const Dims ts{x.Hq * x.T * x.T, x.T * x.T, 1, x.T};
  const Dims rd{x.B, x.Hq, x.T, 1}, rs{x.Hq * x.T, x.T, 1, 1};
  const bool gqa = x.Hq != x.Hk;
  const Common c = common(*g, x);
  Desc Vt = g->tensor(kV, bf, bhdt(x, x.Hk), bhdt_strides(x, x.Hk), false, false, c.kvoff);
  Desc dO = g->tensor(kDO, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false, false, c.qoff);
  Desc dQ = g->tensor(kDQ, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false, false, c.qoff);
  Desc dK = g->tensor(kDK, bf, bhtd(x, x.Hk), bhtd_strides(x, x.Hk), false, false, c.kvoff);
  Desc dV = g->tensor(kDV, bf, bhtd(x, x.Hk), bhtd_strides(x, x.Hk), false, false, c.kvoff);
  Desc one = g->scalar(kOne);
  // softmax_sum padded, not ragged: cuDNN then takes its dense dO·O kernel, 8× faster here.
  Desc softmax_sum = g->tensor(kSoftmaxSum, f32, rd, rs, false);
  Desc dOO = g->virt(f32, bhtd(x, x.Hq), bhtd_strides(x, x.Hq));
  g->pointwise(CUDNN_POINTWISE_MUL, f32, dO, c.O, nullptr, dOO);
  Desc rsum = g->virt(f32, rd, rs);
  g->reduce(CUDNN_REDUCE_TENSOR_ADD, dOO, rsum);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, rsum, one, nullptr, softmax_sum);
  // P = exp(masked scores - stats)
  Desc scores = masked_scores(*g, c, x);
  Desc S5 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_SUB, f32, scores, c.stats, nullptr, S5);
  Desc P = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_EXP, f32, S5, nullptr, nullptr, P);
  // dV = Pᵀ dO; with grouped heads through a full-head partial that cuDNN reduces.
  Desc Pt = g->virt(bf, sd, ts);
  g->reshape(P, Pt);
  auto grad_kv = [&](Desc lhs, Desc rhs, Desc out, Uid full_uid) {
    if (!gqa) return g->matmul(lhs, rhs, out, c.len_kv, nullptr, c.len_q);
    Desc full =
        g->tensor(full_uid, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false, false, c.kvoff);
    g->matmul(lhs, rhs, full, c.len_kv, nullptr, c.len_q);
    g->reduce(CUDNN_REDUCE_TENSOR_ADD, full, out);
  };
  grad_kv(Pt, dO, dV, kDVFull);
  // dS = P * (dO Vᵀ - softmax_sum) * scale
  Desc dP = g->virt(f32, sd, ss);
  g->matmul(dO, Vt, dP, c.len_q, c.len_kv);
  Desc dP2 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_SUB, f32, dP, softmax_sum, nullptr, dP2);
  Desc dP3 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, dP2, P, nullptr, dP3);
  Desc dS = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, dP3, c.scale, nullptr, dS);
  // dK = dSᵀ Q
  Desc dSt = g->virt(bf, sd, ts);
  g->reshape(dS, dSt);
  grad_kv(dSt, c.Q, dK, kDKFull);
  // dQ = dS K, through the fp32 accumulator (the nondeterministic, workspace-free algorithm).
  Desc K = g->virt(bf, bhtd(x, x.Hk), bhtd_strides(x, x.Hk));
  g->reshape(c.Kt, K);
  Desc acc = g->tensor(kDQAccum, f32, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false, false, c.qoff);
  g->matmul(dS, K, acc, c.len_q, nullptr, c.len_kv);
  g->pointwise(CUDNN_POINTWISE_IDENTITY, f32, acc, nullptr, nullptr, dQ);
  g->plan(h);
  return g;
}

// The checks and the run table both directions share, then the plan. Null with *why when cuDNN
// cannot take the call.
struct Call {
  Graph* graph = nullptr;
  Shape x{};
  const Tensor* offsets = nullptr;
};
Call prepare(const Tensor& q, const Tensor& k, const Tensor& seg,
             std::initializer_list<const Tensor*> io, bool backward, std::string* why) {
  const int dev = q.device().index;
  if (!bf16_aligned(q, io, why) || !ragged_supported(dev, why)) return {};
  const int64_t B = q.dim(0), T = q.dim(1), Hq = q.dim(2), Hk = k.dim(2), D = q.dim(3);
  if (B * T * Hq * D >= (int64_t(1) << 31)) {
    *why = "the batch has too many elements for cuDNN's 32-bit ragged offsets";
    return {};
  }
  Runs& r = runs_of(seg);
  if (!r.runs.repeat.empty()) {
    *why = r.runs.repeat;
    return {};
  }
  int64_t S = 64;
  while (S < r.longest) S *= 2;
  if (!supported(D, S, dev, backward, why)) return {};
  Call c;
  c.x = Shape{entries_for(int64_t(r.runs.start.size())), S, Hq, Hk, D};
  c.offsets = &offsets_for(r, Hq, Hk, D, dev);
  const Shape x = c.x;
  c.graph = cached_plan(
      {dev, backward ? 11 : 10, x.B, x.T, Hq, Hk, D}, dev,
      [&](cudnnHandle_t h) { return backward ? backward_graph(h, x) : forward_graph(h, x); }, why);
  return c;
}

// The variant pack's offsets and lengths: views into the one offsets tensor.
void add_offsets(const Call& c, std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
  int32_t* p = c.offsets->data<int32_t>();
  const int64_t n = c.x.B;
  uids.insert(uids.end(), {kQOffsets, kKVOffsets, kStatsOffsets, kSeqLen, kSeqLenKV});
  ptrs.insert(ptrs.end(), {p, p + (n + 1), p + 2 * (n + 1), p + 3 * (n + 1), p + 3 * (n + 1)});
}

}  // namespace

// Ragged batches need cuDNN 9.6 on sm_90 and newer, 9.18.1 on sm_8x (its backward).
bool ragged_supported(int dev, std::string* why) {
  int major = 0;
  RIG_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  const int need = major >= 9 ? 90600 : 91801;
  if (runtime_version() >= need) return true;
  *why = fmt::format("cuDNN {} has no ragged attention on compute capability {}.x (needs {})",
                     runtime_version(), major, need);
  return false;
}

bool forward_packed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                    Tensor& out, Tensor& lse, std::string* why) {
  const int dev = q.device().index;
  DeviceGuard guard(dev);
  const Call c = prepare(q, k, seg, {&q, &k, &v, &out}, false, why);
  if (!c.graph) return false;
  const int64_t B = q.dim(0), T = q.dim(1), Hq = q.dim(2);
  float scale = 1.0f / std::sqrt(float(c.x.D)), neg_inf = -std::numeric_limits<float>::infinity(),
        lowest = std::numeric_limits<float>::lowest();
  Tensor stats = Tensor::empty({B * T * Hq}, DType::F32, Device::cuda(dev), "cuDNN packed stats");
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf, kLowest};
  std::vector<void*> ptrs{q.raw(), k.raw(),  v.raw(),    out.raw(),
                          stats.raw(), &scale, &neg_inf, &lowest};
  add_offsets(c, uids, ptrs);
  Tensor ws = workspace(c.graph->workspace(), dev);
  c.graph->execute(bound_handle(dev), uids, ptrs, ws.raw());
  RIG_CUDA_CHECK(k::lse_layout(stats.f32(), lse.f32(), int(B), int(T), int(Hq), false,
                               stream_for(dev)));
  return true;
}

bool backward_packed(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& seg, const Tensor& out, const Tensor& lse, Tensor& dq,
                     Tensor& dk, Tensor& dv, bool deterministic, std::string* why) {
  if (deterministic) {
    *why = "deterministic mode: the flash kernel is deterministic and needs no n·Hq·S² workspace";
    return false;
  }
  const int dev = q.device().index;
  DeviceGuard guard(dev);
  const Call c = prepare(q, k, seg, {&dout, &q, &k, &v, &out, &dq, &dk, &dv}, true, why);
  if (!c.graph) return false;
  const int64_t B = q.dim(0), T = q.dim(1), Hq = q.dim(2), D = q.dim(3);
  const Device on = Device::cuda(dev);
  float scale = 1.0f / std::sqrt(float(D)), neg_inf = -std::numeric_limits<float>::infinity(),
        lowest = std::numeric_limits<float>::lowest(), one = 1.0f;
  Tensor stats = Tensor::empty({B * T * Hq}, DType::F32, on, "cuDNN packed stats");
  RIG_CUDA_CHECK(k::lse_layout(lse.f32(), stats.f32(), int(B), int(T), int(Hq), true,
                               stream_for(dev)));
  Tensor softmax_sum =
      Tensor::empty({c.x.B * Hq * c.x.T}, DType::F32, on, "cuDNN packed softmax sum");
  Tensor acc = Tensor::empty({B * T * Hq * D}, DType::F32, on, "cuDNN packed dq accumulator");
  std::vector<int64_t> uids{kQ,  kK,      kV,       kO,      kDO,  kStats,      kDQ,     kDK,
                            kDV, kScale,  kNegInf,  kLowest, kOne, kSoftmaxSum, kDQAccum};
  std::vector<void*> ptrs{q.raw(),  k.raw(),    v.raw(),   out.raw(), dout.raw(),
                          stats.raw(), dq.raw(), dk.raw(),  dv.raw(),  &scale,
                          &neg_inf, &lowest,    &one,      softmax_sum.raw(), acc.raw()};
  Tensor dk_full, dv_full;
  if (c.x.Hq != c.x.Hk) {
    dk_full = Tensor::empty({B * T * Hq * D}, DType::BF16, on, "cuDNN packed dk partial");
    dv_full = Tensor::empty({B * T * Hq * D}, DType::BF16, on, "cuDNN packed dv partial");
    uids.insert(uids.end(), {kDKFull, kDVFull});
    ptrs.insert(ptrs.end(), {dk_full.raw(), dv_full.raw()});
  }
  add_offsets(c, uids, ptrs);
  Tensor ws = workspace(c.graph->workspace(), dev);
  c.graph->execute(bound_handle(dev), uids, ptrs, ws.raw());
  return true;
}

#endif  // RIG_WITH_CUDNN

}  // namespace rig::ops::cuda::sdpa_cudnn
